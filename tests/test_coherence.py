"""Coherent Score (Kendall τ-b CS@K), i2t mAP, image-level relevance, and the eval-sims wiring.

Float comparisons: τ-b, CS@K and AP are float64 statistics of rankings (scipy / sklearn / by hand in float64:
abs 1e-12 or pytest.approx's rel 1e-6); image-level relevance comes back in float32 and is compared with its
float64 value at the rounding of one float32 sum and division (rtol 3e-7).
"""

import json

import numpy as np
import pytest
from scipy.stats import kendalltau
from sklearn.metrics import average_precision_score

from vsekit.cli import main
from vsekit.metrics import MetricsInputError
from vsekit.metrics.coherence import (
    average_precision_i2t,
    coherence_metrics,
    coherence_metrics_by_fold,
    coherent_scores,
    first_caption_per_image,
    image_caption_relevance,
    kendall_tau_b,
)
from vsekit.metrics.retrieval import add_coherence, retrieval_metrics_fold5


def _cs_of_ranking(ranking: list[int]) -> float:
    """One query over h1..h5 with relevance h1 > h2 > … > h5; the model ranks them as `ranking`."""
    relevance = np.array([[5.0, 4.0, 3.0, 2.0, 1.0]])
    scores = np.zeros((1, 5))
    for pos, h in enumerate(ranking):
        scores[0, h - 1] = 10.0 - pos
    return float(coherent_scores(scores, relevance, 5)[0])


def test_paper_examples():
    # Sec. III-D: (R@1, CS@5) = (100, -0.2) for h1,h5,h4,h3,h2; (0, 0.8) for h2,h1,h3,h4,h5; ...
    assert _cs_of_ranking([1, 5, 4, 3, 2]) == pytest.approx(-0.2)
    assert _cs_of_ranking([2, 1, 3, 4, 5]) == pytest.approx(0.8)
    assert _cs_of_ranking([1, 3, 2, 4, 5]) == pytest.approx(0.8)
    assert _cs_of_ranking([1, 2, 3, 4, 5]) == pytest.approx(1.0)


def test_tau_b_equals_scipy_with_ties(rng):
    for k in (2, 5, 17, 60):
        x = rng.integers(0, 4, size=(30, k)).astype(float)  # many ties in both
        y = rng.integers(0, 3, size=(30, k)).astype(float)
        ours = kendall_tau_b(x, y, chunk_elems=7 * k * k)  # several chunks
        for i in range(30):
            ref = kendalltau(x[i], y[i], variant="b").statistic
            assert ours[i] == pytest.approx(0.0 if np.isnan(ref) else ref, abs=1e-12), (k, i)


def test_cs_top_k_matches_slow_loop(rng):
    scores = rng.normal(size=(12, 40))
    relevance = np.round(rng.normal(size=(12, 40)), 1)  # ties in relevance
    for k in (5, 10, 40, 100):  # 100 > candidates: all of them
        ours = coherent_scores(scores, relevance, k)
        for i in range(12):
            top = np.argsort(-scores[i])[: min(k, 40)]
            assert ours[i] == pytest.approx(
                kendalltau(scores[i, top], relevance[i, top]).statistic, abs=1e-12
            )


def test_image_caption_relevance_combines_captions():
    rel = np.array([[1.0, 0.8, 0.2, 0.1], [0.8, 1.0, 0.5, 0.3], [0.2, 0.5, 1.0, 0.4], [0.1, 0.3, 0.4, 1.0]])
    cap2img = np.array([0, 0, 1, 2])
    mx = image_caption_relevance(rel, cap2img, "max")
    # float32 results: the inputs rounded to float32, then one sum and one division, 1/2 ulp (6e-8) each: 3e-7
    np.testing.assert_allclose(
        mx, [[1.0, 1.0, 0.5, 0.3], [0.2, 0.5, 1.0, 0.4], [0.1, 0.3, 0.4, 1.0]], rtol=3e-7
    )
    mean = image_caption_relevance(rel, cap2img, "mean")
    np.testing.assert_allclose(mean[0], [0.9, 0.9, 0.35, 0.2], rtol=3e-7)
    asym = rel.copy()
    asym[3, 0] = 0.9  # caption 3 -> caption 0 differs from 0 -> 3
    assert image_caption_relevance(asym, cap2img, "max", transpose=True)[0, 3] == pytest.approx(0.9)
    assert image_caption_relevance(asym, cap2img, "max")[0, 3] == pytest.approx(0.3)
    with pytest.raises(ValueError, match="combine"):
        image_caption_relevance(rel, cap2img, "median")


def test_coherence_metrics_against_direct_definition(rng):
    cap2img = np.array([0, 0, 1, 2, 2, 2, 3, 4, 4, 5])
    n_img, n_cap = 6, len(cap2img)
    sims = rng.normal(size=(n_img, n_cap))
    emb = rng.normal(size=(n_cap, 8))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    rel = (emb @ emb.T).astype(np.float32)
    np.fill_diagonal(rel, 1.0)  # an image's own captions tie at relevance 1
    out = coherence_metrics(sims, cap2img, rel, ks=[4], protocol="all_captions")
    i2t, t2i = [], []
    for q in range(n_img):
        r = np.array([max(rel[a, c] for a in np.nonzero(cap2img == q)[0]) for c in range(n_cap)])
        top = np.argsort(-sims[q])[:4]
        i2t.append(kendalltau(sims[q, top], r[top]).statistic)
    for c in range(n_cap):
        r = np.array([max(rel[c, a] for a in np.nonzero(cap2img == p)[0]) for p in range(n_img)])
        top = np.argsort(-sims[:, c])[:4]
        t2i.append(kendalltau(sims[top, c], r[top]).statistic)
    assert out["i2t_cs_allcap@4"] == pytest.approx(np.mean(i2t))
    assert out["t2i_cs_allcap@4"] == pytest.approx(np.mean(t2i))
    assert set(out) == {"i2t_cs_allcap@4", "t2i_cs_allcap@4", "i2t_map"}


def test_paper_protocol_on_a_hand_built_matrix():
    """One caption per image (each image's first, in caption order), both directions ranked over the images,
    relevance R[c_i, c_j]: τ-b worked out by hand. The second captions (3-5) must not matter."""
    cap2img = np.array([0, 1, 2, 0, 1, 2])  # first captions: 0, 1, 2
    sims = np.zeros((3, 6))
    sims[:, :3] = [[0.9, 0.1, 0.5], [0.2, 0.8, 0.6], [0.3, 0.4, 0.7]]
    sims[:, 3:] = [[5.0, -5.0, 2.0], [-3.0, 4.0, 9.0], [7.0, 1.0, -2.0]]  # other captions: ignored
    rel = np.full((6, 6), -0.7)
    rel[:3, :3] = [[1.0, 0.5, 0.2], [0.5, 1.0, 0.3], [0.2, 0.3, 1.0]]
    np.fill_diagonal(rel, 1.0)
    # i2t image 0: order c0, c2, c1 with relevance 1, .2, .5 -> 2 concordant, 1 discordant -> 1/3;
    # image 1 likewise 1/3; image 2 fully concordant -> 1. t2i the same by symmetry of this example.
    out = coherence_metrics(sims, cap2img, rel, ks=[3, 1000])
    assert out["i2t_cs@3"] == pytest.approx(5 / 9) and out["t2i_cs@3"] == pytest.approx(5 / 9)
    assert out["i2t_cs@1000"] == out["i2t_cs@3"]  # K above the image count ranks all of them
    assert set(out) == {"i2t_cs@3", "t2i_cs@3", "i2t_cs@1000", "t2i_cs@1000", "i2t_map"}
    assert out["i2t_map"] == pytest.approx(average_precision_i2t(sims, cap2img).mean())  # mAP: all captions


def test_paper_protocol_is_the_released_dotau(rng):
    """The release's `doTau`: S = images x their first caption ([::5] of the 5-per-image layout); i2t ranks
    row i, t2i column i, both against capsts[i, topK]."""
    n_img, per = 30, 5
    cap2img = np.repeat(np.arange(n_img), per)
    sims = rng.normal(size=(n_img, n_img * per))
    emb = rng.normal(size=(n_img * per, 8))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    rel = emb @ emb.T
    s, capsts = sims[:, ::per], rel[::per, ::per]
    for k in (5, 12):
        i2t = [
            kendalltau(s[i, np.argsort(-s[i])[:k]], capsts[i, np.argsort(-s[i])[:k]]).statistic
            for i in range(n_img)
        ]
        t2i = [
            kendalltau(s[np.argsort(-s[:, i])[:k], i], capsts[i, np.argsort(-s[:, i])[:k]]).statistic
            for i in range(n_img)
        ]
        out = coherence_metrics(sims, cap2img, rel, ks=[k])
        assert out[f"i2t_cs@{k}"] == pytest.approx(np.mean(i2t))
        assert out[f"t2i_cs@{k}"] == pytest.approx(np.mean(t2i))


def test_first_caption_per_image():
    assert first_caption_per_image(np.array([2, 0, 0, 1, 2, 1])).tolist() == [1, 3, 0]
    with pytest.raises(MetricsInputError, match="every image row"):
        first_caption_per_image(np.array([0, 2]))


def _fold_blocks(rng, n_img=25, per=1):
    """Relevance from random embeddings; inside each 5-image fold the scores are the relevance (CS = 1),
    across folds they are high and reversed (so one ranking over all images would put them first, CS = -1)."""
    cap2img = np.repeat(np.arange(n_img), per)
    emb = rng.normal(size=(len(cap2img), 6))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    rel = emb @ emb.T
    img_rel = rel[np.ix_(first_caption_per_image(cap2img), np.arange(len(cap2img)))]  # [images, captions]
    fold = np.arange(n_img) // (n_img // 5)
    same = fold[:, None] == fold[cap2img][None, :]
    sims = np.where(same, img_rel, 5.0 - img_rel)
    return sims, cap2img, rel


def test_fold5_cs_is_the_mean_over_1k_folds_not_one_5k_ranking(rng):
    from vsekit.metrics import evaluate_sims

    sims, cap2img, rel = _fold_blocks(rng)
    folds = coherence_metrics_by_fold(sims, cap2img, rel, ks=[5])
    assert len(folds) == 5 and all(f["i2t_cs@5"] == pytest.approx(1.0) for f in folds)
    assert all(f["t2i_cs@5"] == pytest.approx(1.0) for f in folds)
    fold5 = coherence_metrics(sims, cap2img, rel, ks=[5], fold5=True)
    assert fold5["i2t_cs@5"] == pytest.approx(1.0) and fold5["t2i_cs@5"] == pytest.approx(1.0)
    whole = coherence_metrics(sims, cap2img, rel, ks=[5])
    assert whole["i2t_cs@5"] == pytest.approx(-1.0) and whole["t2i_cs@5"] == pytest.approx(-1.0)
    # each fold's values are the metrics of that fold's own sub-matrices
    for f, fold in enumerate(folds):
        rows, cols = np.arange(5 * f, 5 * f + 5), np.nonzero(cap2img // 5 == f)[0]
        assert fold == coherence_metrics(
            sims[np.ix_(rows, cols)], cap2img[cols] - 5 * f, rel[np.ix_(cols, cols)], ks=[5]
        )
    # W-D18: evaluate_sims(fold5=True) is COCO 1K only; its fold mechanism on this 25-image matrix
    with pytest.raises(ValueError, match="5,000 images"):
        evaluate_sims(sims, cap2img, fold5=True, relevance=rel, cs_k=[5])
    out = retrieval_metrics_fold5(sims, cap2img)
    add_coherence(out, sims, cap2img, rel, [5], "paper", True)
    assert out["i2t_cs@5"] == pytest.approx(1.0)
    assert all(row["i2t_cs@5"] == pytest.approx(1.0) and "i2t_r1" in row for row in out["folds"])
    assert out["i2t_map"] == pytest.approx(np.mean([f["i2t_map"] for f in folds]))


def test_fold5_all_captions_protocol_is_per_fold_too(rng):
    sims, cap2img, rel = _fold_blocks(rng, per=2)
    folds = coherence_metrics_by_fold(sims, cap2img, rel, ks=[4], protocol="all_captions")
    fold5 = coherence_metrics(sims, cap2img, rel, ks=[4], protocol="all_captions", fold5=True)
    assert fold5["i2t_cs_allcap@4"] == pytest.approx(np.mean([f["i2t_cs_allcap@4"] for f in folds]))
    assert fold5["t2i_cs_allcap@4"] == pytest.approx(np.mean([f["t2i_cs_allcap@4"] for f in folds]))
    assert not any(k.startswith("i2t_cs@") for k in fold5)
    with pytest.raises(ValueError, match="protocol"):
        coherence_metrics(sims, cap2img, rel, ks=[4], protocol="5k")


def test_eval_sims_fold5_prints_the_fold_mean_cs(tmp_path, rng, capsys, monkeypatch):
    import vsekit.metrics.retrieval as retrieval

    # W-D18: --fold5 is COCO 1K only (5,000 images); lifted here to see the fold means printed on 25 images
    monkeypatch.setattr(retrieval, "check_fold5_protocol", lambda *args, **kwargs: None)
    sims, cap2img, rel = _fold_blocks(rng)
    np.save(tmp_path / "sims.npy", sims.astype(np.float32))
    np.save(tmp_path / "rel.npy", rel.astype(np.float32))
    out = tmp_path / "m.json"
    rc = main(
        [
            "eval-sims",
            str(tmp_path / "sims.npy"),
            "--captions-per-image",
            "1",
            "--fold5",
            "--relevance",
            str(tmp_path / "rel.npy"),
            "--cs-k",
            "5",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    metrics = json.loads(out.read_text())
    assert metrics["i2t_cs@5"] == pytest.approx(1.0) and len(metrics["folds"]) == 5
    assert "i2t_cs@5 1.000 t2i_cs@5 1.000 i2t_map" in capsys.readouterr().out


def test_cs_is_one_for_a_coherent_model_and_near_zero_for_random(rng):
    n = 300
    emb = rng.normal(size=(n, 16))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    rel = emb @ emb.T
    cap2img = np.arange(n)
    perfect = coherence_metrics(rel * 3 + 1, cap2img, rel, ks=[10, 100])  # a monotone map of relevance
    assert perfect["i2t_cs@10"] == pytest.approx(1.0) and perfect["t2i_cs@100"] == pytest.approx(1.0)
    random = coherence_metrics(rng.normal(size=(n, n)), cap2img, rel, ks=[100])
    assert abs(random["i2t_cs@100"]) < 0.05 and abs(random["t2i_cs@100"]) < 0.05


def test_map_matches_sklearn(rng):
    cap2img = np.repeat(np.arange(20), rng.integers(1, 5, size=20))
    sims = rng.normal(size=(20, len(cap2img)))
    ours = average_precision_i2t(sims, cap2img)
    for i in range(20):
        assert ours[i] == pytest.approx(average_precision_score(cap2img == i, sims[i]))


def test_map_ties_are_resolved_like_recall():
    # image 0 owns captions 0 and 1; caption 2 ties with caption 1: a tie never ranks above a positive
    sims = np.array([[0.9, 0.5, 0.5, 0.1], [0.0, 0.0, 1.0, 1.0]])
    cap2img = np.array([0, 0, 1, 1])
    ap = average_precision_i2t(sims, cap2img)
    assert ap[0] == pytest.approx(1.0)
    sims[0, 2] = 0.6  # now strictly above caption 1: precisions 1/1 and 2/3
    assert average_precision_i2t(sims, cap2img)[0] == pytest.approx((1 + 2 / 3) / 2)
    tied_pos = np.array([[0.5, 0.5, 0.7, 0.1], [0, 0, 1, 1.0]])  # two tied positives behind one negative
    assert average_precision_i2t(tied_pos, cap2img)[0] == pytest.approx((1 / 2 + 2 / 3) / 2)


def test_bad_relevance_is_a_clear_error(rng):
    sims = rng.normal(size=(3, 6))
    cap2img = np.array([0, 0, 1, 1, 2, 2])
    with pytest.raises(MetricsInputError, match="5 captions but the similarity matrix has 6"):
        coherence_metrics(sims, cap2img, np.eye(5), ks=[3])
    with pytest.raises(MetricsInputError, match="square"):
        coherence_metrics(sims, cap2img, np.ones((6, 5)), ks=[3])
    bad = np.eye(6)
    bad[2, 4] = np.nan
    with pytest.raises(MetricsInputError, match=r"NaN/inf values, first at \(2, 4\)"):
        coherence_metrics(sims, cap2img, bad, ks=[3])
    with pytest.raises(MetricsInputError, match="K >= 2"):
        coherence_metrics(sims, cap2img, np.eye(6), ks=[1])


def test_eval_sims_cli_reports_coherence(tmp_path, rng, capsys):
    n_img, per = 40, 2
    cap2img = np.repeat(np.arange(n_img), per)
    sims = rng.normal(size=(n_img, n_img * per)).astype(np.float32)
    emb = rng.normal(size=(n_img * per, 8))
    emb /= np.linalg.norm(emb, axis=1, keepdims=True)
    rel = (emb @ emb.T).astype(np.float16)
    np.save(tmp_path / "sims.npy", sims)
    np.save(tmp_path / "rel.npy", rel)
    out = tmp_path / "m.json"
    rc = main(
        [
            "eval-sims",
            str(tmp_path / "sims.npy"),
            "--captions-per-image",
            "2",
            "--relevance",
            str(tmp_path / "rel.npy"),
            "--cs-k",
            "10",
            "50",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    metrics = json.loads(out.read_text())
    expected = coherence_metrics(sims, cap2img, rel, ks=[10, 50])
    for key in ("i2t_cs@10", "t2i_cs@10", "i2t_cs@50", "t2i_cs@50", "i2t_map"):
        assert metrics[key] == pytest.approx(expected[key])
    assert "i2t_cs@10" in capsys.readouterr().out


def test_evaluate_sims_adds_coherence_and_names_a_bad_relevance_file(tmp_path, rng, capsys):
    from vsekit.metrics import evaluate_sims

    cap2img = np.repeat(np.arange(10), 2)
    sims = rng.normal(size=(10, 20))
    rel = rng.normal(size=(20, 20))
    rel = (rel + rel.T) / 2
    plain = evaluate_sims(sims, cap2img)
    assert not any(k.startswith(("i2t_cs@", "t2i_cs@", "i2t_map")) for k in plain)
    full = evaluate_sims(sims, cap2img, relevance=rel, cs_k=[5])
    assert full == {**plain, **coherence_metrics(sims, cap2img, rel, ks=[5])}
    np.save(tmp_path / "sims.npy", sims.astype(np.float32))
    missing = tmp_path / "nope.npy"
    rc = main(
        ["eval-sims", str(tmp_path / "sims.npy"), "--captions-per-image", "2", "--relevance", str(missing)]
    )
    assert rc != 0 and "nope.npy" in capsys.readouterr().err
    np.save(tmp_path / "rel.npy", np.ones((19, 19)))
    rc = main(
        [
            "eval-sims",
            str(tmp_path / "sims.npy"),
            "--captions-per-image",
            "2",
            "--relevance",
            str(tmp_path / "rel.npy"),
        ]
    )
    assert rc != 0 and "rel.npy: 19 captions but the similarity matrix has 20" in capsys.readouterr().err


def test_metrics_import_no_dataset_or_model_code():
    """Metrics take arrays: importing them loads neither vsekit.data nor vsekit.models (no metrics -> data ->
    models -> metrics cycle); the relevance computation lives in vsekit.relevance, which metrics never import."""
    import subprocess
    import sys

    code = (
        "import sys, vsekit.metrics, vsekit.metrics.coherence\n"
        "print(sorted(m for m in sys.modules if m.startswith('vsekit')))"
    )
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "vsekit.data" not in loaded and "vsekit.models" not in loaded and "vsekit.relevance" not in loaded
