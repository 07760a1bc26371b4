"""ECCV Caption, CxC and the COCO 1K / 5K recalls of a COCO 5K test similarity matrix.

The ids, the positives (original COCO, CxC, ECCV Caption) and the metric code are those of the PyPI package
`eccv-caption` (NAVER, MIT; `pip install 'vsekit[eccv]'`), so the numbers are the package's own. Its
`Metrics.compute_all_metrics` takes, per query id, the retrieved ids best first; building those lists with a
full argsort per query costs about as much as the reference evaluation loop (30,000 sorts), so this module
builds only the prefix each metric reads:

- top-k per query with `np.argpartition` (then a sort of those k only), in row blocks; k = max(10, the
  largest number of ECCV positives of any query in that direction: 48 captions i2t, 19 images t2i with
  eccv-caption 0.1.0), because ECCV's mAP@R and R-Precision read the first R items (R = positives);
- COCO 1K filters each list to the query's 1K fold and reads its first 10 fold items: the fold's own top-10
  (computed on the fold's sub-matrix) is appended after the global top-k, minus the fold items the global
  prefix already holds. A global ranking restricted to a fold is the fold's ranking (same scores, same tie
  rule), so the filtered list starts with exactly the fold's top-10.

The matrix is the 5,000 x 25,000 Karpathy test split in the package's order: caption column c is COCO
caption id `coco_test_ids.npy[c]`, image row i owns captions 5i..5i+4. **Ties** are ordered by index:
higher score first, equal scores in row/column order (as `np.argsort(-s, kind="stable")`), so the lists,
and the metrics, do not depend on the partition algorithm. (vsekit's main recall keys rank ties
pessimistically; the two agree whenever no score is tied.)

Arrays only: this module imports no dataset or model code.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np

from vsekit.errors import MissingPackageError, SetupError
from vsekit.metrics.common import MetricsInputError

log = logging.getLogger(__name__)

INSTALL_HINT = "pip install 'vsekit[eccv]'"
N_IMAGES, N_CAPTIONS, CAPTIONS_PER_IMAGE, N_FOLDS = 5000, 25000, 5, 5
RECALL_KS = (1, 5, 10)
DIRECTIONS = ("i2t", "t2i")
ECCV_KEYS: tuple[str, ...] = (
    *(f"{bench}_{d}_r{k}" for bench in ("coco_1k", "coco_5k", "cxc") for d in DIRECTIONS for k in RECALL_KS),
    *(f"eccv_{d}_{m}" for m in ("map_at_r", "rprecision", "r1") for d in DIRECTIONS),
)
# what compute_all_metrics is asked for: R@1/5/10 of COCO 1K, 5K and CxC; ECCV mAP@R, R-Precision and R@1
_TARGETS = (
    "coco_1k_recalls",
    "coco_5k_recalls",
    "cxc_recalls",
    "eccv_map_at_r",
    "eccv_rprecision",
    "eccv_r1",
)


class EccvGroundTruth:
    """The package's `Metrics` object with the standard order spelled out as arrays.

    caption_ids[c]: COCO caption id of column c; image_ids[i]: COCO image id of row i (the image of caption
    5i); k_i2t / k_t2i: how many retrieved items per query the metrics read (at least 10, at least R).
    """

    def __init__(self, metrics: Any) -> None:
        self.metrics = metrics
        self.caption_ids = np.asarray(metrics.coco_ids, dtype=np.int64)
        t2i = metrics.coco_gts["t2i"]
        owner = np.array([t2i[int(c)][0] for c in self.caption_ids], dtype=np.int64)
        if (
            len(owner) != N_CAPTIONS
            or (owner.reshape(-1, CAPTIONS_PER_IMAGE) != owner[::CAPTIONS_PER_IMAGE, None]).any()
        ):
            raise SetupError(
                "eccv_caption's coco_test_ids.npy is not 5,000 images x 5 captions in image order "
                f"(an eccv-caption version vsekit does not know; {INSTALL_HINT} installs one it does)"
            )
        self.image_ids = owner[::CAPTIONS_PER_IMAGE].copy()
        longest = {d: max(len(set(v)) for v in metrics.eccv_gts[d].values()) for d in DIRECTIONS}
        self.k_i2t = max(max(RECALL_KS), longest["i2t"])
        self.k_t2i = max(max(RECALL_KS), longest["t2i"])


def _import_package() -> Any:
    try:
        with warnings.catch_warnings():  # "failed to import `ujson`. use `json` instead." on every import
            warnings.filterwarnings("ignore", message=".*ujson.*")
            import eccv_caption
            import eccv_caption._metrics  # noqa: F401  (the module whose progress bar `_quiet` turns off)
    except ImportError as e:
        raise MissingPackageError(f"--eccv needs the eccv-caption package: {INSTALL_HINT} ({e})") from e
    return eccv_caption


@functools.lru_cache(maxsize=1)
def ground_truth() -> EccvGroundTruth:
    """The package's ids and positives (JSON shipped in its wheel, parsed once per process)."""
    pkg = _import_package()
    return EccvGroundTruth(pkg.Metrics())


def standard_image_ids() -> np.ndarray:
    """COCO image ids of the 5,000 test rows in the standard order (what a dataset's `testall_ids.txt` holds)."""
    return ground_truth().image_ids.copy()


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """Silence the package's tqdm bar in `compute_eccv_metrics` (it has no switch for it)."""
    import eccv_caption._metrics as m

    saved = getattr(m, "tqdm", None)
    m.tqdm = lambda it, *a, **kw: it
    try:
        yield
    finally:
        m.tqdm = saved


# ------------------------------------------------------------------------------------------- top-k
def topk_rows(block: np.ndarray, k: int) -> np.ndarray:
    """(rows, k) column indices of each row's k highest scores, best first, equal scores in column order.

    `np.argpartition` picks the k, then only those k are sorted. Where the k-th score is tied with scores
    outside the partition's pick, which of them made the cut is arbitrary: those rows are redone exactly
    (everything above the k-th score, then the lowest-index columns equal to it).
    """
    n = block.shape[1]
    if k >= n:
        return np.argsort(-block, axis=1, kind="stable")[:, :k]
    part = np.argpartition(block, n - k, axis=1)[:, n - k :]
    vals = np.take_along_axis(block, part, axis=1)
    kth = vals.min(axis=1)
    at_least = block >= kth[:, None]
    tied = np.flatnonzero(np.count_nonzero(at_least, axis=1) > k)
    if tied.size:  # the candidates (scores >= the k-th) of those rows, in row-major = column order
        r, c = np.nonzero(at_least[tied] if tied.size < len(block) else at_least)
        v = block[tied[r], c]
        equal = v == kth[tied[r]]
        n_equal = np.cumsum(equal)  # running count; minus the count before the row = place among its equals
        before = np.concatenate(([0], n_equal))[np.searchsorted(r, np.arange(len(tied)))]
        need = k - np.bincount(r[~equal], minlength=len(tied))  # slots left for the equal scores
        keep = ~equal | (n_equal - before[r] <= need[r])
        part[tied] = c[keep].reshape(len(tied), k)
        vals[tied] = v[keep].reshape(len(tied), k)
    order = np.lexsort((part, -vals), axis=-1)  # primary: score, descending; then the index
    return np.take_along_axis(part, order, axis=1)


def _check_finite(block: np.ndarray, row0: int, source: str) -> None:
    if not (np.isfinite(block.min()) and np.isfinite(block.max())):  # NaN propagates through min/max
        bad = np.argwhere(~np.isfinite(block))[0]
        raise MetricsInputError(f"{source}: NaN/inf score at (image {row0 + bad[0]}, caption {bad[1]})")


def topk_i2t(
    sims: np.ndarray, k: int, source: str = "similarity matrix", block_rows: int = 128
) -> np.ndarray:
    """(images, k) caption columns per image row, best first; checks every score is finite on the way."""
    out = np.empty((sims.shape[0], min(k, sims.shape[1])), dtype=np.int64)
    for r0 in range(0, sims.shape[0], block_rows):
        block = np.asarray(sims[r0 : r0 + block_rows])
        _check_finite(block, r0, source)
        out[r0 : r0 + len(block)] = topk_rows(block, k)
    return out


def topk_t2i(sims: np.ndarray, k: int, block_cols: int = 256, tile_rows: int = 1024) -> np.ndarray:
    """(captions, k) image rows per caption column, best first: column blocks transposed tile by tile (a
    cache-friendly copy, about 7x faster than `ascontiguousarray(block.T)`), then `topk_rows`."""
    n_img, n_cap = sims.shape
    out = np.empty((n_cap, min(k, n_img)), dtype=np.int64)
    buf = np.empty((block_cols, n_img), dtype=sims.dtype)
    for c0 in range(0, n_cap, block_cols):
        c1 = min(c0 + block_cols, n_cap)
        tr = buf[: c1 - c0]
        for r0 in range(0, n_img, tile_rows):
            tr[:, r0 : r0 + tile_rows] = np.asarray(sims[r0 : r0 + tile_rows, c0:c1]).T
        out[c0:c1] = topk_rows(tr, k)
    return out


# ------------------------------------------------------------------------------------------- lists
def retrieved_items(
    sims: np.ndarray, gt: EccvGroundTruth, source: str = "similarity matrix"
) -> tuple[dict[int, list[int]], dict[int, list[int]]]:
    """(i2t, t2i) as `Metrics.compute_all_metrics` takes them: COCO image id -> caption ids best first, COCO
    caption id -> image ids best first; each list = the global top-k, then the missing part of the query's
    1K-fold top-10 (see the module docstring)."""
    fold_img, fold_cap = N_IMAGES // N_FOLDS, N_CAPTIONS // N_FOLDS
    g_i2t = topk_i2t(sims, gt.k_i2t, source)
    g_t2i = topk_t2i(sims, gt.k_t2i)
    f_i2t = np.empty((N_IMAGES, max(RECALL_KS)), dtype=np.int64)
    f_t2i = np.empty((N_CAPTIONS, max(RECALL_KS)), dtype=np.int64)
    for f in range(N_FOLDS):
        rows, cols = slice(f * fold_img, (f + 1) * fold_img), slice(f * fold_cap, (f + 1) * fold_cap)
        sub = np.asarray(sims[rows, cols])
        f_i2t[rows] = topk_i2t(sub, max(RECALL_KS), source) + f * fold_cap
        f_t2i[cols] = topk_t2i(sub, max(RECALL_KS)) + f * fold_img
    # fold items the global prefix already holds: they are the fold's first ones, so skip that many
    held_i2t = np.count_nonzero(g_i2t // fold_cap == (np.arange(N_IMAGES) // fold_img)[:, None], axis=1)
    held_t2i = np.count_nonzero(g_t2i // fold_img == (np.arange(N_CAPTIONS) // fold_cap)[:, None], axis=1)
    cap, img = gt.caption_ids, gt.image_ids
    i2t = {
        q: g + f[m:]
        for q, g, f, m in zip(img.tolist(), cap[g_i2t].tolist(), cap[f_i2t].tolist(), held_i2t.tolist())
    }
    t2i = {
        q: g + f[m:]
        for q, g, f, m in zip(cap.tolist(), img[g_t2i].tolist(), img[f_t2i].tolist(), held_t2i.tolist())
    }
    return i2t, t2i


def check_shape(shape: tuple[int, ...], source: str = "similarity matrix") -> None:
    """A clear error unless `shape` is the 5,000 x 25,000 of the COCO 5K test matrix the package's ids describe
    (taking a shape, so that a command can check before it computes the matrix)."""
    shape = tuple(int(n) for n in shape)
    if shape != (N_IMAGES, N_CAPTIONS):
        raise MetricsInputError(
            f"{source}: shape {shape} is not COCO 5K test's ({N_IMAGES}, {N_CAPTIONS}); --eccv needs the 5,000 "
            "Karpathy test images x 25,000 captions in eccv_caption's coco_test_ids.npy order (image i owns "
            "captions 5i..5i+4)"
        )


def package_scores(metrics: Any, i2t: dict[int, list[int]], t2i: dict[int, list[int]]) -> dict[str, float]:
    """`Metrics.compute_all_metrics` on the given lists, as vsekit keys in percent (the tests feed it the
    lists of a full argsort to get the reference numbers)."""
    with _quiet():
        raw = metrics.compute_all_metrics(i2t, t2i, target_metrics=_TARGETS, Ks=RECALL_KS, verbose=False)
    out: dict[str, float] = {}
    for name, per_direction in raw.items():
        for d, value in per_direction.items():
            if name.startswith("eccv_"):
                key = f"eccv_{d}_{name[len('eccv_') :]}"
            else:
                bench, k = name.rsplit("_r", 1)
                key = f"{bench}_{d}_r{k}"
            out[key] = 100.0 * float(value)
    return {k: out[k] for k in ECCV_KEYS}


def eccv_metrics(sims: np.ndarray, source: str = "similarity matrix") -> dict[str, float]:
    """The ECCV_KEYS (percent) of a 5,000 x 25,000 COCO 5K test similarity matrix (rows = images, columns =
    captions, the package's order); `source` names the matrix (a file, a split) in error messages."""
    sims = np.asarray(sims)  # a memory map stays one (no copy)
    check_shape(sims.shape, source)
    if not np.issubdtype(sims.dtype, np.floating):
        sims = sims.astype(np.float64)
    gt = ground_truth()
    t0 = time.perf_counter()
    i2t, t2i = retrieved_items(sims, gt, source)
    t1 = time.perf_counter()
    out = package_scores(gt.metrics, i2t, t2i)
    log.debug("eccv: retrieved lists %.2f s, eccv_caption metrics %.2f s", t1 - t0, time.perf_counter() - t1)
    return out


def format_eccv(metrics: dict) -> str:
    """The ECCV_KEYS present in `metrics` as four lines (COCO 1K, COCO 5K, CxC, ECCV); empty when absent."""
    if not all(k in metrics for k in ECCV_KEYS):
        return ""
    lines = []
    for bench, title in (("coco_1k", "COCO 1K"), ("coco_5k", "COCO 5K"), ("cxc", "CxC    ")):
        parts = [
            f"{d} " + " ".join(f"R@{k} {metrics[f'{bench}_{d}_r{k}']:.1f}" for k in RECALL_KS)
            for d in DIRECTIONS
        ]
        lines.append(f"{title} " + " | ".join(parts))
    parts = [
        f"{d} mAP@R {metrics[f'eccv_{d}_map_at_r']:.1f} R-P {metrics[f'eccv_{d}_rprecision']:.1f} "
        f"R@1 {metrics[f'eccv_{d}_r1']:.1f}"
        for d in DIRECTIONS
    ]
    lines.append("ECCV    " + " | ".join(parts))
    return "\n".join(lines)
