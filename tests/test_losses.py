import torch

from vsekit.losses import TripletLoss, triplet_loss


def test_triplet_hand_values():
    s = torch.tensor([[0.9, 0.5, 0.1], [0.8, 0.6, 0.0], [0.2, 0.3, 0.4]])
    hard, _ = triplet_loss(s, margin=0.2, hardest=True)
    # rows (image->captions): max(0.2+0.5-0.9, 0.2+0.1-0.9)=0 ; max(0.2+0.8-0.6, 0)=0.4 ; max(0.2+0.2-0.4, 0.2+0.3-0.4)=0.1
    # cols (caption->images): col0: max(0.2+0.8-0.9, 0.2+0.2-0.9)=0.1 ; col1: max(0.2+0.5-0.6, 0.2+0.3-0.6)=0.1 ; col2: max(0.2+0.1-0.4, 0.2+0-0.4)=0
    assert torch.isclose(hard, torch.tensor(0.7))
    total, _ = triplet_loss(s, margin=0.2, hardest=False)
    assert torch.isclose(total, torch.tensor(0.7))  # one violation per row/column here
    z = torch.zeros(3, 3)
    assert torch.isclose(triplet_loss(z, 0.2, hardest=True)[0], torch.tensor(1.2))  # 6 hardest x 0.2
    assert torch.isclose(triplet_loss(z, 0.2, hardest=False)[0], torch.tensor(2.4))  # 12 negatives x 0.2


def test_same_image_captions_are_not_negatives():
    s = torch.tensor([[0.9, 0.95], [0.9, 0.95]])
    loss_fn = TripletLoss(margin=0.2, mask_same_image=True)
    masked, _ = loss_fn(s, image_ids=torch.tensor([7, 7]))
    assert masked == 0
    unmasked, _ = TripletLoss(margin=0.2, mask_same_image=False)(s, image_ids=torch.tensor([7, 7]))
    assert unmasked > 0


def test_warmup_uses_all_negatives():
    s = torch.rand(6, 6)
    loss_fn = TripletLoss()
    assert loss_fn(s, warmup=True)[0] >= loss_fn(s, warmup=False)[0]
