"""Ladder loss (fixed / cumulative / reference variant), adaptive levels (batched k-means + silhouette),
relevance caching, and the trainer / `vse eval` wiring.

Float comparisons: float32 losses of small batches against hand values or float64 sums (pytest.approx, rel
<= 1e-5); exact equality where the ladder loss reduces to the very same triplet computation plus an exact 0;
k-means / silhouette in float64 against sklearn (1e-9); relevance cosines (float32) against float64 by hand
at `cos_atol(d)`, which also bounds quantiles of them (an order statistic moves no more than its inputs).
"""

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from sklearn.cluster import KMeans
from sklearn.metrics import silhouette_score
from threadpoolctl import threadpool_limits

from conftest import StepClock
from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.losses import TripletLoss, create_loss
from vsekit.losses.ladder import LadderLoss, adaptive_levels, kmeans_1d, silhouette_1d
from vsekit.relevance import cached_relevance, sentence_embeddings, split_caption_embeddings
from vsekit.training.trainer import Trainer
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

EPS32 = float(np.finfo(np.float32).eps)


def cos_atol(d: int) -> float:
    """Bound on a float32 cosine of two d-dim rows against its float64 value: <= d u for the dot and
    (d / 2 + 2) u per normalised row (u = eps / 2), i.e. (d + 2) eps; (d + 4) eps with a margin."""
    return (d + 4) * EPS32


S = torch.tensor([[0.9, 0.3, 0.5], [0.8, 0.6, 0.0], [0.2, 0.3, 0.4]])
R = torch.tensor([[1.0, 0.7, 0.1], [0.7, 1.0, 0.2], [0.1, 0.2, 1.0]])  # θ=0.4: levels [0,1,2],[1,0,2],[2,2,0]


def _ladder(**kw) -> LadderLoss:
    args = {"margins": [0.2, 0.01], "weights": [1.0, 0.25], "thresholds": [0.4]}
    args.update(kw)
    return LadderLoss(**args)


def _random_batch(b: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    sims = torch.rand(b, b, generator=g) * 2 - 1
    e = torch.nn.functional.normalize(
        torch.randn(6, 16, generator=g)[torch.randint(0, 6, (b,), generator=g)]
        + 0.5 * torch.randn(b, 16, generator=g),
        dim=-1,
    )
    image_ids = torch.arange(b)
    image_ids[1] = 0  # captions of one image: positives, never negatives
    return sims, e @ e.T, image_ids


def test_hand_values_paper_cumulative_reference():
    # VSE++ part (α1 = 0.2): rows 0 + 0.4 + 0.1, columns 0.1 + 0 + 0.3 = 0.9
    assert TripletLoss()(S)[0] == pytest.approx(0.9)
    # paper HC (Eq. 8), α2 = 0.01: image 0 [0.01 - 0.3 + 0.5] = 0.21, caption 1 [0.01 - 0.3 + 0.3] = 0.01;
    # query 2 has no level-1 candidate, so no term. Total 0.9 + 0.25 * 0.22
    assert _ladder()(S, relevance=R)[0] == pytest.approx(0.9 + 0.25 * 0.22)
    # cumulative: [α1 + α2 - s_qq + max far]: image 2 0.21 - 0.4 + 0.3 = 0.11, caption 2 0.21 - 0.4 + 0.5 = 0.31
    assert _ladder(cumulative=True)(S, relevance=R)[0] == pytest.approx(0.9 + 0.25 * 0.42)
    # released code: the near set includes the positive, so caption 2 adds [0.01 - 0.4 + 0.5] = 0.11
    assert _ladder(variant="reference")(S, relevance=R)[0] == pytest.approx(0.9 + 0.25 * 0.33)


def test_degenerates_to_vsepp_when_nothing_is_relevant():
    sims, _, _ = _random_batch(12, 0)
    low = torch.full((12, 12), 0.1).fill_diagonal_(1.0)  # every candidate below θ = 0.4: one level
    vsepp = TripletLoss(mask_same_image=False)(sims)[0]
    # bit-identical by construction: the ladder's first level is the same triplet computation, plus an exact 0
    assert torch.equal(_ladder()(sims, relevance=low)[0], vsepp)
    # the released code still adds β·[α2 − s_qq + max(0, hardest negative)]_+ per query and direction
    diag = sims.diagonal()
    hn_rows = (sims.masked_fill(torch.eye(12, dtype=torch.bool), 0)).amax(1).clamp_min(0)
    hn_cols = (sims.masked_fill(torch.eye(12, dtype=torch.bool), 0)).amax(0).clamp_min(0)
    extra = (0.01 - diag + hn_rows).clamp_min(0).sum() + (0.01 - diag + hn_cols).clamp_min(0).sum()
    ref = _ladder(variant="reference", mask_same_image=False)(sims, relevance=low)[0]
    # sums of 2 x 12 non-negative float32 hinge terms in another order: <= 24 eps (2.9e-6) relative
    assert ref == pytest.approx(float(vsepp + 0.25 * extra), rel=1e-5)


@pytest.mark.parametrize("adaptive", [False, True])
@pytest.mark.parametrize("warmup", [False, True])
def test_equals_vsepp_when_higher_weights_are_zero(adaptive, warmup):
    sims, rel, image_ids = _random_batch(32, 1)
    vsepp = TripletLoss()(sims, image_ids=image_ids, warmup=warmup)[0]
    kw = {"adaptive": adaptive, "margins": [0.2, 0.01, 0.01, 0.01]}
    zero = _ladder(weights=[1.0, 0.0, 0.0, 0.0], **kw)(
        sims, image_ids=image_ids, relevance=rel, warmup=warmup
    )[0]
    assert torch.equal(
        zero, vsepp
    )  # zero-weight levels are skipped: the same triplet computation, bit for bit
    full = _ladder(weights=[1.0, 0.25, 0.125, 0.0625], **kw)(
        sims, image_ids=image_ids, relevance=rel, warmup=warmup
    )
    assert full[0] > vsepp  # the ladders do add violations on random similarities
    assert full[1]["ladder2_active"] > 0


def test_gradients_are_finite_and_reach_the_ladder_pairs():
    sims, rel, image_ids = _random_batch(24, 2)
    for loss_fn in (
        _ladder(),
        _ladder(cumulative=True),
        _ladder(variant="reference"),
        _ladder(adaptive=True, margins=[0.2] + [0.01] * 3, weights=[1, 0.25, 0.125, 0.0625]),
    ):
        s = sims.clone().requires_grad_(True)
        ladder_only = LadderLoss(
            loss_fn.margins,
            [0.0] + loss_fn.weights[1:],
            loss_fn.thresholds,
            loss_fn.cumulative,
            loss_fn.adaptive,
            variant=loss_fn.variant,
        )
        ladder_only(s, image_ids=image_ids, relevance=rel)[0].backward()
        assert torch.isfinite(s.grad).all() and s.grad.abs().sum() > 0
    flat = torch.ones(8, 8)  # every relevance equal: one cluster, no NaN
    s = torch.rand(8, 8).requires_grad_(True)
    _ladder(adaptive=True, margins=[0.2] + [0.01] * 3, weights=[1, 0.25, 0.125, 0.0625])(s, relevance=flat)[
        0
    ].backward()
    assert torch.isfinite(s.grad).all()


def test_fixed_levels_from_thresholds():
    loss = _ladder(thresholds=[0.6, 0.3], margins=[0.2, 0.01, 0.01], weights=[1, 0.25, 0.125])
    rel = torch.tensor(
        [[1.0, 0.7, 0.5, 0.1], [0.7, 1.0, 0.3, 0.29], [0.5, 0.3, 1.0, 0.6], [0.1, 0.29, 0.6, 1.0]]
    )
    pos = torch.eye(4, dtype=torch.bool)
    lv, _ = loss.levels(rel, pos)
    assert lv.tolist() == [[0, 1, 2, 3], [1, 0, 2, 3], [2, 2, 0, 1], [3, 3, 1, 0]]


def _random_rows(rng, q: int, n: int) -> np.ndarray:
    rows = []
    for i in range(q):
        if i % 5 == 4:
            rows.append(rng.uniform(-0.2, 1.0, size=n))  # no cluster structure
            continue
        c = rng.integers(2, 6)
        centres = rng.uniform(-0.2, 1.0, size=c)
        rows.append(rng.normal(centres[rng.integers(0, c, size=n)], rng.uniform(0.02, 0.12)))
    return np.stack(rows)


def test_batched_kmeans_silhouette_matches_sklearn(rng):
    q, n = 25, 40
    x = torch.tensor(_random_rows(rng, q, n))
    valid = torch.ones(q, n, dtype=torch.bool)
    for i in range(q):  # variable numbers of candidates per row (positives excluded)
        valid[i, rng.choice(n, size=int(rng.integers(0, 8)), replace=False)] = False
    levels, k_best, _ = adaptive_levels(x, valid, 2, 4)
    inertia = {k: kmeans_1d(x, valid, k)[1] for k in (2, 3, 4)}
    compared = 0
    with threadpool_limits(1):  # sklearn's OpenMP pool on a tiny problem only adds overhead
        for i in range(q):  # the slow reference: a Python loop over rows with sklearn
            v = x[i][valid[i]].numpy().reshape(-1, 1)
            best, sklearn_optimal = None, True
            for k in (2, 3, 4):
                km = KMeans(k, n_init=10, random_state=0).fit(v)
                assert float(inertia[k][i]) <= km.inertia_ * (1 + 1e-9) + 1e-12, (i, k)  # exact: never worse
                sklearn_optimal &= float(inertia[k][i]) == pytest.approx(km.inertia_, rel=1e-9, abs=1e-12)
                score = silhouette_score(v, km.labels_)
                if best is None or score > best[0]:
                    best = (score, k, km)
            if not sklearn_optimal:  # Lloyd's stopped in a worse local optimum: its k is not comparable
                continue
            compared += 1
            _, k_ref, km = best
            assert int(k_best[i]) == k_ref, i
            ref_levels = (np.argsort(np.argsort(-km.cluster_centers_.ravel())) + 1)[km.labels_]
            np.testing.assert_array_equal(levels[i][valid[i]].numpy(), ref_levels)
            assert (levels[i][~valid[i]] == 0).all()
    assert compared >= 0.75 * q, compared


def test_kmeans_is_the_exact_optimum(rng):
    from itertools import combinations

    x = torch.tensor(rng.uniform(-0.2, 1.0, size=(12, 14)))  # no structure: many local optima
    valid = torch.ones_like(x, dtype=torch.bool)
    valid[::3, -3:] = False
    for k in (2, 3, 4):
        labels, inertia = kmeans_1d(x, valid, k)
        for i in range(12):
            v = np.sort(x[i][valid[i]].numpy())
            best = min(  # brute force over every contiguous partition of the sorted values
                sum(((seg - seg.mean()) ** 2).sum() for seg in np.split(v, list(cuts)))
                for cuts in combinations(range(1, len(v)), k - 1)
            )
            assert float(inertia[i]) == pytest.approx(best, rel=1e-9)
            lab = labels[i][valid[i]].numpy()
            assert sorted(set(lab.tolist())) == list(range(k))
            assert np.all(np.diff(lab[np.argsort(x[i][valid[i]].numpy(), kind="stable")]) >= 0)  # contiguous


def test_silhouette_matches_sklearn(rng):
    x = torch.tensor(rng.normal(size=(6, 30)))
    valid = torch.ones(6, 30, dtype=torch.bool)
    valid[:, :4] = False
    for k in (2, 3, 5):
        labels, _ = kmeans_1d(x, valid, k)
        sil = silhouette_1d(x, valid, labels, k)
        for i in range(6):
            v = x[i][valid[i]].numpy().reshape(-1, 1)
            assert float(sil[i]) == pytest.approx(silhouette_score(v, labels[i][valid[i]].numpy()), abs=1e-9)


def test_adaptive_levels_on_an_obvious_row():
    row = torch.tensor([[1.0, 0.9, 0.88, 0.91, 0.5, 0.52, 0.1, 0.12, 0.11, 0.13]])
    valid = torch.ones_like(row, dtype=torch.bool)
    valid[0, 0] = False  # the positive
    lv, k, _ = adaptive_levels(row, valid, 2, 4)
    assert int(k[0]) == 3
    assert lv[0].tolist() == [0, 1, 1, 1, 2, 2, 3, 3, 3, 3]
    lv1, k1, _ = adaptive_levels(row, valid, 1, 1)  # (1, 1): one level = VSE++
    assert int(k1[0]) == 1 and lv1[0].tolist() == [0] + [1] * 9


def test_bad_ladder_configs_are_clear_errors():
    with pytest.raises(ValueError, match="strictly decreasing"):
        _ladder(thresholds=[0.3, 0.6], margins=[0.2, 0.01, 0.01], weights=[1, 0.25, 0.1])
    with pytest.raises(ValueError, match="needs 4 loss.ladder_margins"):
        create_loss(load_recipe("cvsepp_auto", ["loss.ladder_margins=[0.2, 0.01]"]).loss)
    with pytest.raises(ValueError, match="ladder_variant"):
        create_loss(load_recipe("cvsepp", ["loss.ladder_variant=released"]).loss)
    with pytest.raises(RuntimeError, match="no relevance"):
        _ladder()(torch.rand(4, 4), caption_ids=torch.arange(4))
    loss = _ladder()
    loss.set_caption_embeddings(torch.randn(5, 8))
    with pytest.raises(IndexError, match="out of range 0..4"):
        loss(torch.rand(4, 4), caption_ids=torch.tensor([0, 1, 2, 7]))


def test_recipes_use_the_paper_defaults():
    fixed = create_loss(load_recipe("cvsepp").loss)
    assert (fixed.thresholds, fixed.margins, fixed.weights, fixed.adaptive) == (
        [0.4],
        [0.2, 0.01],
        [1.0, 0.25],
        False,
    )
    auto = create_loss(load_recipe("cvsepp_auto").loss)
    assert (auto.levels_min, auto.levels_max, auto.adaptive) == (2, 4, True)
    assert auto.margins == [0.2, 0.01, 0.01, 0.01] and auto.weights == [1.0, 0.25, 0.125, 0.0625]


def test_cvsepp_recipes_use_the_hardest_negative_from_step_0_and_the_share_rule():
    """The paper and the ladderloss release train with the hardest negative from the first step (no VSE0
    epoch); θ_1 comes from the share rule (15 %), the paper's 0.40 one --set away; the adaptive ladder has
    no threshold."""
    for name in ("cvsepp", "cvsepp_auto"):
        assert load_recipe(name).loss.warmup_epochs == 0
    assert load_recipe("vsepp").loss.warmup_epochs == 1  # VSE∞'s re-run of VSE++ keeps its warm-up
    fixed = create_loss(load_recipe("cvsepp").loss)
    assert fixed.threshold_share == 0.15 and fixed.derived_thresholds is None
    assert (
        create_loss(load_recipe("cvsepp", ["loss.ladder_threshold_share=null"]).loss).threshold_share is None
    )
    assert load_recipe("cvsepp_auto").loss.ladder_threshold_share is None


def _pairs_by_hand(emb: np.ndarray, cap2img: np.ndarray) -> np.ndarray:
    e = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    r = e @ e.T
    return np.array(
        [r[i, j] for i in range(len(e)) for j in range(i + 1, len(e)) if cap2img[i] != cap2img[j]]
    )


def test_threshold_share_rule_is_the_numpy_quantile(rng):
    from vsekit.relevance import (
        pair_relevance_from_embeddings,
        pair_relevance_from_matrix,
        share_at_or_above,
        threshold_for_share,
    )

    cap2img = np.repeat(np.arange(40), rng.integers(1, 4, size=40))
    emb = rng.normal(size=(len(cap2img), 12)).astype(np.float32)
    by_hand = _pairs_by_hand(emb.astype(np.float64), cap2img)
    values = pair_relevance_from_embeddings(emb, cap2img, block=7)  # blocks that split rows unevenly
    np.testing.assert_allclose(
        values, by_hand, atol=cos_atol(12)
    )  # every i < j pair of different images, once
    e = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    np.testing.assert_allclose(pair_relevance_from_matrix(e @ e.T, cap2img), by_hand, atol=cos_atol(12))
    for share in (0.05, 0.15, 0.5):
        theta = threshold_for_share(values, share)
        assert theta == np.quantile(values, 1 - share)  # the same numpy call on the same array: exact
        assert share_at_or_above(values, [theta])[0] == pytest.approx(share, abs=1 / len(values) + 1e-12)
    assert share_at_or_above(np.array([0.1, 0.2, 0.2, 0.4]), [0.2, 0.41, -1.0]).tolist() == [0.75, 0.0, 1.0]
    with pytest.raises(ValueError, match="share must lie in"):
        threshold_for_share(values, 1.0)
    # above `max_pairs`: a fixed-seed sample of that many pairs of different images, close to the exact rule
    sampled = pair_relevance_from_embeddings(emb, cap2img, max_pairs=len(values) // 2)
    assert len(sampled) == len(values) // 2
    np.testing.assert_array_equal(
        sampled, pair_relevance_from_embeddings(emb, cap2img, max_pairs=len(values) // 2)
    )
    assert abs(threshold_for_share(sampled, 0.15) - threshold_for_share(values, 0.15)) < 0.05


def test_ladder_derives_theta_from_the_share_and_the_trainer_records_it(tmp_path, monkeypatch, rng):
    import vsekit.relevance as relevance

    cap2img = np.repeat(np.arange(30), 2)
    emb = rng.normal(size=(60, 16)).astype(np.float32)
    loss = _ladder(threshold_share=0.2)
    logs: list[str] = []
    split = SimpleNamespace(split="train", captions=[str(i) for i in range(60)], cap2img=cap2img)
    monkeypatch.setattr(relevance, "split_caption_embeddings", lambda *a, **k: emb)
    relevance.prepare_ladder_relevance(loss, tmp_path, split, logs.append)
    theta = loss.thresholds[0]
    assert theta == pytest.approx(
        np.quantile(_pairs_by_hand(emb.astype(np.float64), cap2img), 0.8), abs=cos_atol(16)
    )
    assert loss.thresholds == loss.derived_thresholds == [theta] and "20.0%" in logs[0]
    with pytest.raises(ValueError, match="ladder_threshold_share"):
        _ladder(threshold_share=1.5)
    # the share sets ladder_thresholds, which the adaptive and the per-row percentile levels do not use
    assert (
        _ladder(threshold_share=0.2, adaptive=True, margins=[0.2] * 4, weights=[1] * 4).threshold_share
        is None
    )
    assert create_loss(load_recipe("cvsepp", ["loss.ladder_percentile=85"]).loss).threshold_share is None
    with pytest.raises(ValueError, match="2-level ladder"):
        _ladder(threshold_share=0.2, thresholds=[0.5, 0.3], margins=[0.2, 0.01, 0.01], weights=[1, 0.25, 0.1])

    # the trainer: θ_1 from the train split's embeddings (stubbed here: no MiniLM), written to config.json
    data = make_synthetic_precomp(
        tmp_path / "d", n_train=24, n_dev=8, n_test=8, regions=4, dim=8, captions_per_image=2
    )
    train_emb = rng.normal(size=(48, 16)).astype(np.float32)
    monkeypatch.setattr(relevance, "split_caption_embeddings", lambda *a, **k: train_emb)
    overrides = [
        "model.embed_dim=16",
        "train.batch_size=8",
        "train.epochs=1",
        "train.log_every=0",
        "model.text.word_dim=8",
        "data.captions_per_image=2",
        "model.text.vocab_min_count=1",
    ]
    logs.clear()
    trainer = Trainer(
        load_recipe("cvsepp", overrides), data, tmp_path / "run", progress=False, log=logs.append
    )
    expected = np.quantile(_pairs_by_hand(train_emb.astype(np.float64), np.repeat(np.arange(24), 2)), 0.85)
    assert trainer.loss_fn.thresholds[0] == pytest.approx(expected, abs=cos_atol(16))
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["recipe"]["loss"]["ladder_thresholds"] == pytest.approx([expected], abs=cos_atol(16))
    assert any("ladder: θ_1 =" in m for m in logs)


def test_relevance_share_cli(tmp_path, monkeypatch, rng, capsys):
    import vsekit.relevance as relevance

    data = make_synthetic_precomp(
        tmp_path / "d", n_train=20, n_dev=4, n_test=4, regions=2, dim=4, captions_per_image=2
    )
    emb = rng.normal(size=(40, 8)).astype(np.float32)
    monkeypatch.setattr(relevance, "split_caption_embeddings", lambda *a, **k: emb)
    out = tmp_path / "share.json"
    assert (
        main(
            [
                "data",
                "relevance-share",
                str(data),
                "--captions-per-image",
                "2",
                "--theta",
                "0.1",
                "0.4",
                "--share",
                "0.15",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    values = _pairs_by_hand(emb.astype(np.float64), np.repeat(np.arange(20), 2))
    report = json.loads(out.read_text())
    assert report["pairs"] == len(values) == 20 * 19 * 2
    # a share is a count: the same pairs are >= 0.4 in float32, as no value lies within cos_atol(8) of 0.4 (5e-4)
    assert report["thresholds"]["0.4"] == pytest.approx(np.mean(values >= 0.4))
    assert report["shares"]["0.15"] == pytest.approx(np.quantile(values, 0.85), abs=cos_atol(8))
    assert "share 15.0% -> θ =" in capsys.readouterr().out


# ------------------------------------------------------------------------- MiniLM relevance (local)


def test_minilm_sentence_embeddings_are_the_sbert_ones():
    e = sentence_embeddings(
        [
            "A man is riding a horse on the beach.",
            "A person rides a horse along the shore.",
            "A bowl of soup on a kitchen table.",
        ]
    )
    assert np.allclose(np.linalg.norm(e, axis=1), 1.0, atol=1e-5)
    assert e[0] @ e[1] == pytest.approx(0.731, abs=0.01)  # SentenceTransformer.encode's value for this pair
    assert e[0] @ e[2] < 0.2


@pytest.mark.slow  # trains one epoch and loads MiniLM: ~15 s on a shared CPU
def test_relevance_cache_training_and_eval(tmp_path, capsys):
    data = make_synthetic_precomp(
        tmp_path / "d", n_train=48, n_dev=12, n_test=12, regions=6, dim=16, captions_per_image=2
    )
    logs: list[str] = []
    emb = split_caption_embeddings(data, "train", log=logs.append)
    assert emb.shape == (96, 384) and (data / "train_sentemb.npy").is_file()
    assert any("encoding" in m for m in logs)
    logs.clear()
    np.testing.assert_array_equal(split_caption_embeddings(data, "train", log=logs.append), emb)
    assert not any("encoding" in m for m in logs)  # a cache hit

    overrides = [
        "model.embed_dim=32",
        "train.batch_size=16",
        "train.epochs=1",
        "train.log_every=1",
        "model.text.word_dim=16",
        "data.captions_per_image=2",
    ]
    run = tmp_path / "run"
    Trainer(load_recipe("cvsepp_auto", overrides), data, run, progress=False, log=logs.append).fit()
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if r["kind"] == "train"]
    assert train and all(1.0 <= r["ladder_levels"] <= 4.0 for r in train)
    assert any(r["ladder_extra"] > 0 for r in train)

    assert cached_relevance(data, "test") is None  # `vse eval` reports CS only once prepared
    assert main(["data", "relevance", str(data), "--split", "test"]) == 0
    rel = cached_relevance(data, "test")
    assert rel is not None and rel.shape == (24, 24) and rel.dtype == np.float16
    out = tmp_path / "eval.json"
    assert main(["eval", str(run), "--split", "test", "--cs-k", "5", "10", "--json", str(out)]) == 0
    metrics = json.loads(out.read_text())
    assert {"i2t_cs@5", "t2i_cs@5", "i2t_cs@10", "t2i_cs@10", "i2t_map"} <= set(metrics)
    assert -1.0 <= metrics["i2t_cs@5"] <= 1.0 and 0.0 < metrics["i2t_map"] <= 1.0

    caps = data / "test_caps.txt"
    caps.write_text(caps.read_text().replace("the", "a"))  # captions changed: the cache is stale
    assert cached_relevance(data, "test") is None


def test_step_benchmark_runs_all_three_losses():
    import vsekit_lab.bench.ladder as module
    from vsekit_lab.bench.ladder import bench_ladder_step

    row = bench_ladder_step(batch=16, repeats=1, warmup=0, regions=4, img_dim=32, embed_dim=32, vocab=50)
    for name in ("vsepp", "ladder", "ladder_auto"):
        assert row[f"{name}_step_ms"] > 0 and row[f"{name}_loss_ms"] > 0
    # known durations, interleaved as the bench runs them (step, then loss alone, per loss), two repeats:
    # VSE++ steps 10 / 30 ms, ladder 12 / 36 ms, adaptive ladder 13 / 39 ms; loss alone 1-6 ms
    durations = [0.010, 0.001, 0.012, 0.002, 0.013, 0.003, 0.030, 0.004, 0.036, 0.005, 0.039, 0.006]
    with pytest.MonkeyPatch.context() as mp:
        clock = StepClock(durations).install(mp, module)
        row = bench_ladder_step(batch=16, repeats=2, warmup=0, regions=4, img_dim=32, embed_dim=32, vocab=50)
    assert clock.calls == 24
    assert row["vsepp_step_ms"] == pytest.approx(20.0) and row["ladder_auto_step_ms"] == pytest.approx(26.0)
    assert row["ladder_loss_ms"] == pytest.approx(3.5)  # median of 2 and 5 ms
    assert row["ratio_fixed"] == pytest.approx(1.2) and row["ratio_auto"] == pytest.approx(1.3)
    with pytest.raises(ValueError, match="batch must be >= 2"):
        bench_ladder_step(batch=1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graph_levels_equal_eager_and_cpu():
    sims, rel, image_ids = _random_batch(128, 5)
    kw = {"adaptive": True, "margins": [0.2, 0.01, 0.01, 0.01], "weights": [1.0, 0.25, 0.125, 0.0625]}
    graphed, eager = _ladder(**kw).cuda(), _ladder(cuda_graphs=False, **kw).cuda()
    pos = torch.eye(128, dtype=torch.bool)
    ref = _ladder(**kw).levels(rel, pos)
    for _ in range(2):  # capture, then replay
        lv_g, k_g = graphed.levels(rel.cuda(), pos.cuda())
        assert torch.equal(lv_g.cpu(), ref[0]) and torch.equal(k_g.cpu(), ref[1])
    assert graphed.cuda_graphs and len(graphed._graphs) == 1
    a = graphed(sims.cuda(), image_ids=image_ids.cuda(), relevance=rel.cuda())[0]
    b = eager(sims.cuda(), image_ids=image_ids.cuda(), relevance=rel.cuda())[0]
    c = _ladder(**kw)(sims, image_ids=image_ids, relevance=rel)[0]
    # graph replay runs eager's kernels (rel 1e-6 = 8 eps); the CPU sums in another order (rel 1e-5)
    assert float(a) == pytest.approx(float(b), rel=1e-6) and float(a) == pytest.approx(float(c), rel=1e-5)
