"""AVSE multi-view image encoder, the view regulariser, and a tiny AVSE model trained end to end.

Float comparisons: encodings of the same image alone or reordered in a batch are O(0.3) entries of unit views
from sums of <= 10 float32 terms: rtol 1e-5 / atol 1e-6 (>= 30 eps of them); same input, same generator ->
identical (default tolerances); regularisers against float64 by hand at rel 1e-5 (column norms and dots of
<= 32 rows: a few tens of eps at most).
"""

import dataclasses
import json

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.config import ImageEncoderConfig, LossConfig, PoolingConfig, load_recipe
from vsekit.losses import create_loss
from vsekit.losses.view_reg import ViewRegularisedLoss, cross_correlation, view_regulariser
from vsekit.models.multiview import MultiViewImageEncoder, kept_count, view_groups
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.training.trainer import Trainer
from vsekit_lab.bench.view_reg import grad_norm_ratio, random_grad_ratios, view_reg_grad_ratio


def make_encoder(
    views=2, feature_type="grid", pooling="gpo", keep_train=0.75, keep_test=0.9
) -> MultiViewImageEncoder:
    torch.manual_seed(0)
    cfg = ImageEncoderConfig(
        feature_type=feature_type,
        views=views,
        view_keep_train=keep_train,
        view_keep_test=keep_test,
        mlp_hidden=16,
        pooling=PoolingConfig(name=pooling),
    )
    return MultiViewImageEncoder(12, 8, cfg)


def batch(b=5, n=10, d=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(b, n, d, generator=g)
    lengths = torch.tensor([n, n - 3, 4, n, 1][:b])
    return feats, lengths


def test_output_is_concatenation_of_normalised_views():
    enc = make_encoder(views=3).eval()
    feats, lengths = batch()
    pooled = enc(feats, lengths)
    assert pooled.shape == (5, 24)
    # the model normalises each view on its own (VSEModel._output): the same as normalising each block
    recipe = load_recipe("avse", ["model.embed_dim=8", "model.image.views=3", "model.similarity.block_dim=4"])
    model = VSEModel(recipe, DataSpec(img_dim=12, vocab_words=["<pad>", "a"]))
    model.image_encoder = enc
    out = model.encode_images(feats, lengths)
    torch.testing.assert_close(enc.split_views(out).norm(dim=-1), torch.ones(5, 3))
    blocks = enc.split_views(pooled)
    by_hand = blocks / blocks.norm(dim=-1, keepdim=True)
    torch.testing.assert_close(enc.split_views(out), by_hand, atol=1e-6, rtol=1e-5)


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
    assert reg0.abs() < 1e-9  # diagonal term at its minimum: (1 - c_ii)^2 with c_ii = 1 +- 32 eps: < 1e-10
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
    cfg = LossConfig(name="triplet", view_reg_weight=2.0, view_reg_variant="paper")
    loss_fn = create_loss(cfg, image_views=2)
    assert isinstance(loss_fn, ViewRegularisedLoss)
    assert not isinstance(create_loss(LossConfig(name="triplet")), ViewRegularisedLoss)

    g = torch.Generator().manual_seed(0)
    sims = torch.randn(4, 4, generator=g)
    emb = torch.randn(4, 16, generator=g)
    total, diag = loss_fn(sims, image_ids=torch.arange(4), warmup=False, image_emb=emb)
    # independent values: VSE++ hardest-negative hinge and Eq. 3-4 by brute force in numpy
    s = sims.double().numpy()
    cost_cap = np.maximum(0.0, 0.2 + s - s.diagonal()[:, None])  # image i -> caption j
    cost_img = np.maximum(0.0, 0.2 + s - s.diagonal()[None, :])  # caption j -> image i
    np.fill_diagonal(cost_cap, 0.0)
    np.fill_diagonal(cost_img, 0.0)
    triplet = cost_cap.max(1).sum() + cost_img.max(0).sum()
    a, b = emb.double().numpy()[:, :8], emb.double().numpy()[:, 8:]  # the two views [batch, d]
    c = np.array(
        [
            [a[:, i] @ b[:, j] / (np.linalg.norm(a[:, i]) * np.linalg.norm(b[:, j])) for j in range(8)]
            for i in range(8)
        ]
    )
    reg = sum((1 - c[i, i]) ** 2 for i in range(8)) + 0.0051 * sum(
        c[i, j] ** 2 for i in range(8) for j in range(8) if i != j
    )
    assert float(diag["view_reg"]) == pytest.approx(reg, rel=1e-5)
    assert float(total) == pytest.approx(triplet + 2.0 * reg, rel=1e-5)
    with pytest.raises(ValueError, match="multi-view"):
        create_loss(cfg)(sims, image_ids=torch.arange(4), image_emb=emb)  # one view: nothing to regularise


TINY = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "train.batch_size=32",
    "train.log_every=0",
    "train.epochs=2",
    "optim.lr=0.002",
    "model.similarity.block_dim=16",
    "data.captions_per_image=5",
]


@pytest.mark.slow
def test_tiny_avse_trains_and_vse_eval_works(synthetic_dir, tmp_path):
    torch.set_num_threads(1)  # tiny tensors: a second thread only adds contention
    # the DataLoader path's draws: this tiny AVSE run's dev rsum spreads 150-410 over seeds 0-2 on either data
    # path (measured; vse_infty: 476-518), so the 3x-chance bar below holds for these draws, not for any draws
    r = load_recipe("avse", TINY + ["train.data_on_device=false"])
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


# ------------------------------------------------- the released /B regulariser and its gradient ratio


def test_reference_regulariser_divides_by_batch_against_a_hand_computation():
    """The recipe's default (released code): c = Â^T B̂ / B with batch-normalised columns; by hand in numpy."""
    r = load_recipe("avse")
    assert r.loss.view_reg_variant == "reference" and LossConfig().view_reg_variant == "reference"
    g = torch.Generator().manual_seed(5)
    emb = torch.randn(6, 2 * 4, generator=g)
    a, b = emb.double().numpy()[:, :4], emb.double().numpy()[:, 4:]
    an, bn = a / np.linalg.norm(a, axis=0), b / np.linalg.norm(b, axis=0)
    c = np.array([[sum(an[k, i] * bn[k, j] for k in range(6)) / 6 for j in range(4)] for i in range(4)])
    reg = sum((c[i, i] - 1) ** 2 for i in range(4)) + 0.0051 * sum(
        c[i, j] ** 2 for i in range(4) for j in range(4) if i != j
    )
    assert float(view_regulariser(emb.reshape(6, 2, 4), variant="reference")) == pytest.approx(reg, rel=1e-5)
    paper = float(view_regulariser(emb.reshape(6, 2, 4), variant="paper"))
    assert paper != pytest.approx(reg, rel=1e-3)  # the /B matters

    sims = torch.randn(6, 6, generator=g)
    loss_fn = create_loss(dataclasses.replace(r.loss, mask_same_image=False), image_views=2)
    total, diag = loss_fn(sims, image_ids=torch.arange(6), warmup=False, image_emb=emb)
    base, _ = create_loss(LossConfig(name="triplet", mask_same_image=False))(sims, warmup=False)
    assert float(diag["view_reg"]) == pytest.approx(reg, rel=1e-5)
    assert float(total) == pytest.approx(float(base) + r.loss.view_reg_weight * reg, rel=1e-5)


def test_grad_norm_ratio_by_hand():
    x = torch.tensor([[3.0, 4.0]], requires_grad=True)
    rank = (x**2).sum()  # gradient 2x = (6, 8): norm 10
    reg = 0.5 * x.sum()  # gradient (0.5, 0.5): norm 0.7071
    out = grad_norm_ratio(rank, reg, x)
    assert out["rank_grad_norm"] == pytest.approx(10.0) and out["reg_grad_norm"] == pytest.approx(0.5**0.5)
    assert out["ratio"] == pytest.approx(0.5**0.5 / 10)
    (rank + reg).backward()  # the graphs are kept for the caller
    assert x.grad is not None


def test_paper_regulariser_gradient_is_about_batch_times_the_released_one():
    rows = {
        (r["variant"], r["hinge"]): r for r in random_grad_ratios(dim=256, batch=64, views=2, block_dim=128)
    }
    paper, ref = rows[("paper", "hardest")], rows[("reference", "hardest")]
    assert paper["rank_grad_norm"] == ref["rank_grad_norm"]
    assert 32 < paper["reg_grad_norm"] / ref["reg_grad_norm"] < 128  # ~B = 64
    assert (
        ref["ratio"] < 1 < paper["ratio"]
    )  # weight 1: only the released form leaves the ranking loss in charge


def test_view_reg_grad_ratio_on_a_training_batch(synthetic_dir, tmp_path):
    r = load_recipe("avse", TINY)
    trainer = Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None)
    batch = next(iter(trainer.loader))
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    out = view_reg_grad_ratio(trainer.model, batch, r.loss)
    assert out["rank_grad_norm"] > 0 and out["reg_grad_norm"] > 0
    assert out["ratio"] == pytest.approx(out["reg_grad_norm"] / out["rank_grad_norm"])
    paper = view_reg_grad_ratio(trainer.model, batch, dataclasses.replace(r.loss, view_reg_variant="paper"))
    assert paper["ratio"] > 2 * out["ratio"]
    assert all(torch.equal(v, trainer.model.state_dict()[k]) for k, v in before.items())  # no state change


# ------------------------------------------------------------------------- views of the full set


def _captured_view_sizes(enc, feats, lengths):
    seen = []
    handle = enc.shared.pool.register_forward_pre_hook(lambda _m, args: seen.append(args[1].clone()))
    try:
        with torch.no_grad():
            enc(feats, lengths, generator=torch.Generator().manual_seed(0))
    finally:
        handle.remove()
    return seen[0].reshape(len(lengths), enc.views)


@pytest.mark.parametrize("feature_type", ["region", "grid"])
def test_views_keep_75_and_90_percent_of_the_full_set(synthetic_dir, tmp_path, feature_type):
    """Training batches reach a multi-view model with every region (no size augmentation first), so each view
    keeps round(0.75 n) of the image's full n in training and round(0.9 n) at test (paper §4.2)."""
    r = load_recipe("avse", TINY + [f"model.image.feature_type={feature_type}"])
    assert r.data.size_augment and not r.model.image.view_size_augment
    trainer = Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None)
    split = trainer.train_split
    full = torch.tensor([split.image_features(i).shape[0] for i in range(split.n_images)])
    enc = trainer.model.image_encoder
    for batch in list(trainer.loader)[:2]:
        n_full = full[batch["image_index"]]
        assert torch.equal(batch["image_lengths"].long(), n_full.long())  # nothing dropped before the views
        enc.train()
        train_sizes = _captured_view_sizes(enc, batch["images"], batch["image_lengths"])
        assert torch.equal(train_sizes, torch.round(0.75 * n_full.double()).long().unsqueeze(1).expand(-1, 2))
        enc.eval()
        test_sizes = _captured_view_sizes(enc, batch["images"], batch["image_lengths"])
        assert torch.equal(test_sizes, torch.round(0.9 * n_full.double()).long().unsqueeze(1).expand(-1, 2))
    # the earlier behaviour, kept as an option: regions dropped first, views drawn from what is left
    old = Trainer(
        load_recipe(
            "avse", TINY + [f"model.image.feature_type={feature_type}", "model.image.view_size_augment=true"]
        ),
        synthetic_dir,
        tmp_path / "old",
        progress=False,
        log=lambda *_: None,
    )
    lengths = torch.cat([b["image_lengths"] for b in list(old.loader)[:4]])
    assert lengths.float().mean() < 0.97 * full.float().mean()
    # single-view models keep VSE∞'s size augmentation
    single = Trainer(
        load_recipe("vse_infty", TINY[:4] + [f"model.image.feature_type={feature_type}"]),
        synthetic_dir,
        tmp_path / "single",
        progress=False,
        log=lambda *_: None,
    )
    lengths = torch.cat([b["image_lengths"] for b in list(single.loader)[:4]])
    assert lengths.float().mean() < 0.97 * full.float().mean()


def test_runs_saved_before_the_option_keep_views_of_the_augmented_set():
    from vsekit.config import recipe_from_dict, to_dict

    saved = to_dict(load_recipe("avse"))
    assert saved["model"]["image"]["view_size_augment"] is False
    del saved["model"]["image"]["view_size_augment"]
    assert recipe_from_dict(saved).model.image.view_size_augment is True  # how such a run was trained
