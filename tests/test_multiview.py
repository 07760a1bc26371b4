"""AVSE multi-view image encoder, the view regulariser, and a tiny AVSE model trained end to end."""

import json

import pytest
import torch

from vsekit.cli import main
from vsekit.config import ImageEncoderConfig, LossConfig, PoolingConfig, load_recipe
from vsekit.losses import create_loss
from vsekit.losses.view_reg import ViewRegularisedLoss, cross_correlation, view_regulariser
from vsekit.models.multiview import MultiViewImageEncoder, kept_count, view_groups
from vsekit.training.trainer import Trainer


def make_encoder(
    views=2, feature_type="grid", pooling="gpo", keep_train=0.75, keep_test=0.9
) -> MultiViewImageEncoder:
    torch.manual_seed(0)
    cfg = ImageEncoderConfig(feature_type=feature_type, views=views, view_keep_train=keep_train,
                             view_keep_test=keep_test, mlp_hidden=16, pooling=PoolingConfig(name=pooling))  # fmt: skip
    return MultiViewImageEncoder(12, 8, cfg)


def batch(b=5, n=10, d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, n, d, generator=g)
    lengths = torch.tensor([n, n - 3, 4, n, 1][:b])
    return feats, lengths


def test_output_is_concatenation_of_normalised_views():
    enc = make_encoder(views=3).eval()
    feats, lengths = batch()
    out = enc(feats, lengths)
    assert out.shape == (5, 24)
    torch.testing.assert_close(enc.split_views(out).norm(dim=-1), torch.ones(5, 3))


def test_kept_count_follows_the_paper_fractions():
    assert kept_count(torch.tensor([36, 49, 4, 1]), 0.75).tolist() == [27, 37, 3, 1]
    assert kept_count(torch.tensor([36, 49, 4, 1]), 0.9).tolist() == [32, 44, 4, 1]


def test_groups_sample_valid_positions_without_replacement():
    lengths = torch.tensor([10, 7, 2])
    g = torch.Generator().manual_seed(1)
    order, counts = view_groups(lengths, 4, 0.75, 10, generator=g)
    assert counts.tolist() == [[8] * 4, [5] * 4, [2] * 4]
    for b in range(3):
        for k in range(4):
            chosen = order[b, k, : counts[b, k]].tolist()
            assert len(set(chosen)) == len(chosen) and max(chosen) < lengths[b]
    # views differ from each other
    assert not all(order[0, 0, :8].sort().values.equal(order[0, k, :8].sort().values) for k in range(1, 4))


def test_padding_and_dropped_elements_never_leak():
    enc = make_encoder().eval()
    feats, lengths = batch()
    out = enc(feats, lengths)
    noisy = feats.clone()
    for b, n in enumerate(lengths.tolist()):
        noisy[b, n:] = 1e3  # padding
    torch.testing.assert_close(enc(noisy, lengths), out)
    # at test time a view keeps 90% of a 10-set: changing a dropped cell of view 0 leaves view 0 alone
    order, counts = view_groups(lengths, 2, 0.9, 10, deterministic=True)
    dropped = order[0, 0, counts[0, 0] :].tolist()
    assert dropped and dropped[0] < 10
    poked = feats.clone()
    poked[0, dropped[0]] += 5.0
    torch.testing.assert_close(enc.split_views(enc(poked, lengths))[0, 0], enc.split_views(out)[0, 0])


def test_eval_grouping_is_deterministic_and_batch_independent():
    enc = make_encoder().eval()
    feats, lengths = batch()
    a = enc(feats, lengths)
    torch.testing.assert_close(enc(feats, lengths), a)
    alone = enc(feats[2:3], lengths[2:3])  # same image encoded on its own
    torch.testing.assert_close(alone[0], a[2], atol=1e-6, rtol=1e-5)
    reordered = enc(feats.flip(0), lengths.flip(0))
    torch.testing.assert_close(reordered.flip(0), a, atol=1e-6, rtol=1e-5)


def test_training_grouping_follows_the_generator():
    enc = make_encoder(feature_type="region").train()
    feats, lengths = batch()
    a = enc(feats, lengths, generator=torch.Generator().manual_seed(3))
    b = enc(feats, lengths, generator=torch.Generator().manual_seed(3))
    c = enc(feats, lengths, generator=torch.Generator().manual_seed(4))
    torch.testing.assert_close(a, b)
    assert (a - c).abs().max() > 1e-4
    a.sum().backward()
    assert enc.shared.fc.weight.grad.abs().sum() > 0


def test_view_regulariser_diagonal_reaches_zero_only_in_paper_variant():
    g = torch.Generator().manual_seed(0)
    v = torch.randn(32, 6, generator=g)
    views = torch.stack([v, 2.0 * v], dim=1)  # the same dimensions up to scale
    c = cross_correlation(v, 2.0 * v)
    torch.testing.assert_close(c.diagonal(), torch.ones(6))
    reg0 = view_regulariser(views, offdiag=0.0)
    assert reg0.abs() < 1e-9  # diagonal term at its minimum
    off = c.pow(2).sum() - c.diagonal().pow(2).sum()
    torch.testing.assert_close(view_regulariser(views, offdiag=0.5), 0.5 * off)
    ref = view_regulariser(views, offdiag=0.0, variant="reference")
    assert ref >= 6 * (1 - 1 / 32) ** 2 - 1e-5  # the released normalisation cannot reach 0
    with pytest.raises(ValueError, match="variant"):
        view_regulariser(views, variant="nope")


def test_view_regulariser_gradients_pull_views_together():
    g = torch.Generator().manual_seed(1)
    views = torch.randn(16, 2, 8, generator=g, requires_grad=True)
    reg = view_regulariser(views)
    reg.backward()
    with torch.no_grad():
        stepped = view_regulariser(views - 0.5 * views.grad)
    assert stepped < reg


def test_create_loss_wraps_with_regulariser_and_needs_views():
    loss_fn = create_loss(LossConfig(name="triplet", view_reg_weight=2.0))
    assert isinstance(loss_fn, ViewRegularisedLoss)
    assert not isinstance(create_loss(LossConfig(name="triplet")), ViewRegularisedLoss)

    class FakeModel(torch.nn.Module):
        def __init__(self, views):
            super().__init__()
            self.image_encoder = torch.nn.Module()
            self.image_encoder.views = views

    sims = torch.randn(4, 4)
    emb = torch.randn(4, 16)
    total, diag = loss_fn(sims, image_ids=torch.arange(4), warmup=False, image_emb=emb, model=FakeModel(2))
    base, _ = create_loss(LossConfig(name="triplet"))(sims, image_ids=torch.arange(4), warmup=False)
    torch.testing.assert_close(total, base + 2.0 * diag["view_reg"])
    with pytest.raises(ValueError, match="multi-view"):
        loss_fn(sims, image_ids=torch.arange(4), image_emb=emb, model=FakeModel(1))


TINY = ["model.embed_dim=32", "model.text.word_dim=16", "train.batch_size=32", "train.log_every=0",
        "train.epochs=2", "optim.lr=0.002", "model.similarity.block_dim=16", "data.captions_per_image=5"]  # fmt: skip


@pytest.mark.slow
def test_tiny_avse_trains_and_vse_eval_works(synthetic_dir, tmp_path):
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    r = load_recipe("avse", TINY)
    assert r.model.image.views == 2 and r.model.similarity.name == "aeom"
    trainer = Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None)
    z0 = trainer.model.sim.dustbin.item()
    result = trainer.fit()
    assert result["best_rsum"] > 0
    assert trainer.model.sim.dustbin.item() != z0  # the dustbin score is learned
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(row.get("kind") == "val" for row in rows)
    out = tmp_path / "m.json"
    assert main(["eval", str(tmp_path / "run"), "--split", "test", "--json", str(out)]) == 0
    m = json.loads(out.read_text())
    chance = 2 * 100 * (1 + 5 + 10) / 50  # rsum of random scores on 50 test images
    assert m["rsum"] > 3 * chance
    out2 = tmp_path / "m2.json"
    assert main(["eval", str(tmp_path / "run"), "--split", "test", "--json", str(out2)]) == 0
    assert json.loads(out2.read_text())["rsum"] == m["rsum"]  # deterministic test-time views
