"""ECCV Caption, CxC and COCO 1K/5K keys of `vse eval --eccv` / `vse eval-sims --eccv`.

The reference is the eccv-caption package's own `Metrics.compute_all_metrics`, fed with lists built here the
slow, plain way: a full sort of every query's scores. vsekit.metrics.eccv builds only the prefixes the
metrics read (argpartition top-k, plus each query's 1K-fold top-10); both must give the same numbers on full
5,000 x 25,000 matrices (the package's ids are fixed): random, near-perfect (planted positives) and one
with ties everywhere.

Tie rule under test: higher score first, equal scores in index order (column for i2t, row for t2i), i.e.
what `np.argsort(-s, kind="stable")` gives; -0.0 and 0.0 are equal scores.

Float comparisons are exact (`assert_same`, `==`): both sides feed the package's own metric code the same
ranked id lists, and those lists depend only on comparisons of the given scores (no arithmetic on them), so
no CPU kernel can change a number; the tie matrix holds exact multiples of 0.5.
"""

from __future__ import annotations

import json
import sys
import warnings

import numpy as np
import pytest

with warnings.catch_warnings():  # eccv_caption warns on import when ujson is missing
    warnings.simplefilter("ignore")
    eccv_caption = pytest.importorskip(
        "eccv_caption", reason="the eccv extra is not installed: pip install 'vsekit[eccv]'"
    )

from vsekit.cli import main  # noqa: E402
from vsekit.errors import MissingPackageError, VseInputError  # noqa: E402
from vsekit.metrics import eccv as E  # noqa: E402

N_IMG, N_CAP = 5000, 25000
FOLD_IMG, FOLD_CAP = 1000, 5000


@pytest.fixture(scope="module")
def package():
    """A Metrics object of the package's own, and (image ids per row, caption ids per column) derived here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        metrics = eccv_caption.Metrics()
    caption_ids = np.asarray(metrics.coco_ids, dtype=np.int64)
    image_ids = np.array([metrics.coco_gts["t2i"][int(c)][0] for c in caption_ids[::5]], dtype=np.int64)
    return metrics, image_ids, caption_ids


# ------------------------------------------------------------------------------------ the reference
def full_ranking_lists(
    rows: np.ndarray, query_fold: np.ndarray, item_fold: np.ndarray, item_ids: np.ndarray, k: int
) -> list[list[int]]:
    """Every row sorted whole (score descending, equal scores in index order), as item ids.

    Each list stops where compute_all_metrics stops reading (a full 25,000-id list per query would be 30,000
    lists of Python ints, gigabytes): after max(k, R) items (k >= 10 and every ECCV R) and after the query's
    10th item of its own 1K fold (COCO 1K filters the list to the fold and reads 10).

    Integer scores get a stable sort (equal scores keep index order; numpy's radix sort for int16). Float
    scores get a quicksort, and a row whose first L+1 sorted scores hold two equal values (so that the
    order of its first L is not fixed) is sorted again with kind="stable".
    """
    stable = np.issubdtype(rows.dtype, np.integer)
    order = np.argsort(-rows, axis=1, kind="stable" if stable else None)
    lengths = prefix_lengths(order, query_fold, item_fold, k)
    if not stable:
        width = int(lengths.max()) + 1
        vals = np.take_along_axis(rows, order[:, :width], axis=1)
        ties = (vals[:, 1:] == vals[:, :-1]) & (np.arange(width - 1) < lengths[:, None])
        redo = np.flatnonzero(ties.any(axis=1))
        if redo.size:
            order[redo] = np.argsort(-rows[redo], axis=1, kind="stable")
            lengths[redo] = prefix_lengths(order[redo], query_fold[redo], item_fold, k)
    return [item_ids[o[:n]].tolist() for o, n in zip(order, lengths)]


def prefix_lengths(order: np.ndarray, query_fold: np.ndarray, item_fold: np.ndarray, k: int) -> np.ndarray:
    """max(k, 1 + the position of each row's 10th item from the query's fold), looking at the first 256
    columns, then (rows not done) 2,048, then all."""
    out = np.empty(len(order), dtype=np.int64)
    todo, width = np.arange(len(order)), 256
    while todo.size:
        seen = np.cumsum(item_fold[order[todo, :width]] == query_fold[todo, None], axis=1)
        done = seen[:, -1] >= 10
        out[todo[done]] = np.maximum(k, np.argmax(seen[done] >= 10, axis=1) + 1)
        todo, width = todo[~done], width * 8
    return out


def reference_scores(sims: np.ndarray, package) -> dict[str, float]:
    """compute_all_metrics on full-sort lists, renamed to vsekit's keys (percent). `sims` may hold integer
    keys with the same order as the scores (see the ties test)."""
    metrics, image_ids, caption_ids = package
    k_i2t = max(10, max(len(set(v)) for v in metrics.eccv_gts["i2t"].values()))
    k_t2i = max(10, max(len(set(v)) for v in metrics.eccv_gts["t2i"].values()))
    img_fold, cap_fold = np.arange(N_IMG) // FOLD_IMG, np.arange(N_CAP) // FOLD_CAP
    i2t, t2i = {}, {}
    for r0 in range(0, N_IMG, 250):
        rows = np.asarray(sims[r0 : r0 + 250])
        lists = full_ranking_lists(rows, img_fold[r0 : r0 + 250], cap_fold, caption_ids, k_i2t)
        i2t.update(zip(image_ids[r0 : r0 + 250].tolist(), lists))
    for c0 in range(0, N_CAP, 1250):
        cols = np.ascontiguousarray(sims[:, c0 : c0 + 1250].T)
        lists = full_ranking_lists(cols, cap_fold[c0 : c0 + 1250], img_fold, image_ids, k_t2i)
        t2i.update(zip(caption_ids[c0 : c0 + 1250].tolist(), lists))
    targets = [
        "coco_1k_recalls",
        "coco_5k_recalls",
        "cxc_recalls",
        "eccv_map_at_r",
        "eccv_rprecision",
        "eccv_r1",
    ]
    raw = metrics.compute_all_metrics(i2t, t2i, target_metrics=targets, Ks=[1, 5, 10])
    out = {}
    for d in ("i2t", "t2i"):
        for bench in ("coco_1k", "coco_5k", "cxc"):
            for kk in (1, 5, 10):
                out[f"{bench}_{d}_r{kk}"] = 100.0 * float(raw[f"{bench}_r{kk}"][d])
        for m in ("map_at_r", "rprecision", "r1"):
            out[f"eccv_{d}_{m}"] = 100.0 * float(raw[f"eccv_{m}"][d])
    return out


def assert_same(ours: dict, ref: dict) -> None:
    assert set(ours) == set(ref) == set(E.ECCV_KEYS)
    diff = {k: (ours[k], ref[k]) for k in ref if ours[k] != ref[k]}
    assert not diff, diff


# ------------------------------------------------------------------------------------ the matrices
def positive_pairs(package, which: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows, cols) of every image-caption positive of `which` (original, cxc, eccv) inside the 5K x 25K."""
    metrics, image_ids, caption_ids = package
    row_of = {int(q): i for i, q in enumerate(image_ids)}
    col_of = {int(q): c for c, q in enumerate(caption_ids)}
    gts = getattr(metrics, f"{'coco' if which == 'original' else which}_gts")
    pairs = [(row_of[i], col_of[c]) for i, caps in gts["i2t"].items() for c in caps if c in col_of]
    pairs += [(row_of[i], col_of[c]) for c, imgs in gts["t2i"].items() for i in imgs if c in col_of]
    r, c = np.array(pairs).T
    return r, c


@pytest.fixture(scope="module")
def planted(package) -> np.ndarray:
    """Near-perfect: noise, then every original, CxC and ECCV positive pair lifted well above it."""
    rng = np.random.default_rng(1)
    sims = rng.standard_normal((N_IMG, N_CAP), dtype=np.float32)
    for which, lift in (("eccv", 6.0), ("cxc", 7.0), ("original", 8.0)):
        r, c = positive_pairs(package, which)
        sims[r, c] = lift + rng.standard_normal(len(r), dtype=np.float32)
    return sims


def test_random_matrix_matches_the_package(package):
    sims = np.random.default_rng(0).standard_normal((N_IMG, N_CAP), dtype=np.float32)
    assert_same(E.eccv_metrics(sims), reference_scores(sims, package))


def test_near_perfect_matrix_matches_the_package(planted, package):
    ours = E.eccv_metrics(planted)
    assert_same(ours, reference_scores(planted, package))
    assert ours["coco_5k_i2t_r1"] > 90 and ours["eccv_i2t_map_at_r"] > 50 and ours["coco_1k_t2i_r10"] > 99


def test_ties_everywhere_match_the_package_with_ties_in_index_order(package):
    """Scores on a 0.5 grid (ties at every rank, -0.0 next to 0.0), three image rows all equal (a collapsed
    image: i2t ranks captions in column order), and three caption columns at the matrix maximum (tied first in
    every image's list)."""
    rng = np.random.default_rng(2)
    sims = rng.standard_normal((N_IMG, N_CAP), dtype=np.float32)
    r, c = positive_pairs(package, "original")
    sims[r, c] += 2.0
    sims = np.round(sims * 2) / 2
    sims[[7, 2500, 4999]] = 0.0
    sims[:, [3, 12345, 24999]] = sims.max()
    zeros = sims[sims == 0]
    assert np.signbit(zeros).any() and not np.signbit(zeros).all()  # both -0.0 and 0.0 present
    ours = E.eccv_metrics(sims)
    # the reference sorts 2*s as int16: exact integers, the same order and the same ties (-0.0 and 0.0 -> 0)
    keys = (sims * 2).astype(np.int16)
    assert np.array_equal(keys, sims * 2)
    del sims
    assert_same(ours, reference_scores(keys, package))


def test_topk_rows_orders_ties_by_index():
    block = np.array([[1.0, 3.0, 3.0, -0.0, 0.0, 3.0, 2.0], [5.0] * 7], dtype=np.float32)
    assert E.topk_rows(block, 2).tolist() == [[1, 2], [0, 1]]
    assert E.topk_rows(block, 5).tolist() == [[1, 2, 5, 6, 0], [0, 1, 2, 3, 4]]
    assert E.topk_rows(block, 7).tolist() == np.argsort(-block, axis=1, kind="stable").tolist()
    rng = np.random.default_rng(3)
    for _ in range(20):
        block = rng.integers(-3, 4, size=(6, 50)).astype(np.float16)
        k = int(rng.integers(1, 50))
        assert (E.topk_rows(block, k) == np.argsort(-block, axis=1, kind="stable")[:, :k]).all()


# ------------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("shape", [(5000, 24999), (25000, 5000), (1000, 5000)])
def test_wrong_shape_is_a_clear_error(shape):
    with pytest.raises(VseInputError, match=r"S\.npy: shape .* is not COCO 5K test's \(5000, 25000\)"):
        E.check_shape(shape, "S.npy")


def test_eval_sims_wrong_shape_names_the_file(tmp_path, capsys):
    path = tmp_path / "small.npy"
    np.save(path, np.eye(30, 150, dtype=np.float32))
    assert main(["eval-sims", str(path), "--eccv"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("vse eval-sims: error: "), err
    assert str(path) in err[0] and "(30, 150)" in err[0] and "(5000, 25000)" in err[0]


def test_missing_package_says_what_to_install(monkeypatch):
    E.ground_truth.cache_clear()
    monkeypatch.setitem(sys.modules, "eccv_caption", None)
    try:
        with pytest.raises(MissingPackageError, match=r"pip install 'vsekit\[eccv\]'"):
            E.eccv_metrics(np.zeros((N_IMG, N_CAP), dtype=np.float32))
    finally:
        monkeypatch.undo()
        E.ground_truth.cache_clear()


def test_nan_is_named():
    sims = np.zeros((N_IMG, N_CAP), dtype=np.float16)
    sims[321, 17] = np.nan
    with pytest.raises(VseInputError, match=r"S\.npy: NaN/inf score at \(image 321, caption 17\)"):
        E.eccv_metrics(sims, "S.npy")


# ------------------------------------------------------------------------------------ the CLI
def test_eval_sims_eccv_json_out_end_to_end(planted, tmp_path, capsys):
    path, out = tmp_path / "s.npy", tmp_path / "m.json"
    np.save(path, planted)
    assert main(["eval-sims", str(path), "--eccv", "--json-out", str(out)]) == 0
    printed = capsys.readouterr().out
    got = json.loads(out.read_text())
    expected = E.eccv_metrics(planted)
    assert {k: got[k] for k in E.ECCV_KEYS} == expected
    assert (
        "rsum" in got and got["coco_5k_i2t_r1"] == got["i2t_r1"]
    )  # no ties: the same number as the main key
    assert "ECCV    i2t mAP@R" in printed and "COCO 1K i2t R@1" in printed and "CxC" in printed
    # a caption -> image map other than 5 per image in order is refused, naming the file
    c2i = tmp_path / "c2i.txt"
    c2i.write_text("".join(f"{(c // 5 + 1) % N_IMG}\n" for c in range(N_CAP)))
    assert main(["eval-sims", str(path), "--cap2img", str(c2i), "--eccv"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "5i..5i+4" in err
    # `vse bench eccv` on the same file (its full-sort reference is what the tests above do)
    assert main(["bench", "eccv", "--sims", str(path), "--repeats", "1", "--no-reference"]) == 0
    row = capsys.readouterr().out
    assert (
        "| 5,000 x 25,000 (s.npy) | 48 / 19 |" in row
        and f"`vse bench eccv --repeats 1 --no-reference --sims {path}`" in row
    )


def test_eval_checks_the_split_before_encoding(tmp_path, package):
    """`vse eval --eccv`: wrong counts, foreign ids and reordered ids are refused; the package's ids pass."""
    from vsekit.commands.evaluate import check_eccv_split
    from vsekit.data.precomp import write_precomp_split

    _, image_ids, _ = package
    feats = np.zeros((N_IMG, 1, 1), dtype=np.float16)
    caps = ["a cat"] * N_CAP
    write_precomp_split(tmp_path, "testall", feats, caps, image_ids=[str(i) for i in image_ids])
    check_eccv_split(str(tmp_path), "testall")
    write_precomp_split(
        tmp_path, "testall", feats, caps, image_ids=[str(i) for i in image_ids], ids_per_caption=True
    )
    check_eccv_split(str(tmp_path), "testall")
    swapped = [str(i) for i in image_ids]
    swapped[10], swapped[11] = swapped[11], swapped[10]
    write_precomp_split(tmp_path, "testall", feats, caps, image_ids=swapped)
    with pytest.raises(VseInputError, match=r"testall_ids.txt: image row 10 .* another order"):
        check_eccv_split(str(tmp_path), "testall")
    write_precomp_split(tmp_path, "testall", feats, caps, image_ids=[f"x{i}" for i in range(N_IMG)])
    with pytest.raises(VseInputError, match="not the same images"):
        check_eccv_split(str(tmp_path), "testall")
    write_precomp_split(tmp_path, "test", feats[:1000], caps[:5000])
    with pytest.raises(VseInputError, match=r"split 'test' has 1,000 images x 5,000 captions, not COCO 5K"):
        check_eccv_split(str(tmp_path), "test")


@pytest.mark.slow
def test_eval_run_eccv_end_to_end(tmp_path, capsys, package):
    """`vse eval RUN --eccv` on a 5,000-image split: refused while its ids are not the package's (before any
    encoding), then the keys land in the same JSON as the main ones."""
    import torch

    from vsekit.config import load_recipe
    from vsekit.training.trainer import Trainer
    from vsekit_lab.datasets.synthetic import make_synthetic_precomp

    torch.set_num_threads(1)
    data = make_synthetic_precomp(tmp_path / "d", n_train=40, n_dev=10, n_test=N_IMG, regions=2, dim=8)
    run = tmp_path / "run"
    tiny = [
        "model.embed_dim=16",
        "model.text.word_dim=8",
        "train.batch_size=16",
        "train.log_every=0",
        "train.epochs=1",
    ]
    Trainer(load_recipe("vsepp", tiny), data, run, progress=False, log=lambda *_: None).fit()
    argv = ["eval", str(run), "--data", str(data), "--split", "test", "--device", "cpu", "--eccv"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "test_ids.txt: image row 0 has id 'test00000'" in err and "not the same images" in err
    _, image_ids, _ = package
    (data / "test_ids.txt").write_text("".join(f"{i}\n" for i in image_ids))
    out = tmp_path / "m.json"
    assert main([*argv, "--json-out", str(out)]) == 0
    got = json.loads(out.read_text())
    assert all(0 <= got[k] <= 100 for k in E.ECCV_KEYS) and "rsum" in got
    # equal captions make equal scores: the index tie rule never ranks a positive lower than the pessimistic one
    assert all(got[f"coco_5k_{d}_r{k}"] >= got[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in (1, 5, 10))
    assert "ECCV    i2t mAP@R" in capsys.readouterr().out
