# Float comparisons: float32 triplet losses of <= 6x6 matrices against hand values and float64 sums, at
# torch.isclose / pytest.approx rel 1e-5 (84 eps; a sum of <= 30 non-negative hinge terms rounds to <= 30 eps
# relative, measured <= 1e-7).
import pytest
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
    loss_fn = TripletLoss()  # margin 0.2, hardest negatives after the warm-up
    z = torch.zeros(3, 3)  # every negative violates by the margin: 12 of them, 6 hardest (one per row/column)
    assert torch.isclose(loss_fn(z, warmup=True)[0], torch.tensor(2.4))
    assert torch.isclose(loss_fn(z, warmup=False)[0], torch.tensor(1.2))
    # brute force on a random batch: the warm-up sums every hinge, afterwards only each row's/column's largest
    s = torch.rand(6, 6, generator=torch.Generator().manual_seed(0))
    d = s.diagonal().numpy().astype("float64")
    hinge_row = [[max(0.0, 0.2 + float(s[i, j]) - d[i]) for j in range(6) if j != i] for i in range(6)]
    hinge_col = [[max(0.0, 0.2 + float(s[i, j]) - d[j]) for i in range(6) if i != j] for j in range(6)]
    all_sum = sum(map(sum, hinge_row)) + sum(map(sum, hinge_col))
    hardest = sum(map(max, hinge_row)) + sum(map(max, hinge_col))
    assert all_sum > hardest + 0.1  # the two modes differ on this batch
    assert float(loss_fn(s, warmup=True)[0]) == pytest.approx(all_sum, rel=1e-5)
    assert float(loss_fn(s, warmup=False)[0]) == pytest.approx(hardest, rel=1e-5)
