"""The community retrieval protocol on a similarity matrix (rows = images, columns = captions).

Conventions (SCAN / VSE++ / VSE∞ `evaluation.py`):
- i2t rank of image i = best (smallest) 0-based rank among the image's own captions;
- t2i rank of caption c = 0-based rank of its image;
- R@K = 100 * fraction of queries with rank < K; medr = floor(median(rank)) + 1; meanr = mean(rank) + 1;
- rsum = R@1 + R@5 + R@10 of both directions;
- fold-5 (COCO 1K): five consecutive image blocks with their captions, every key averaged over the folds
  (rsum = mean of per-fold rsums — the SCAN/VSE++ printouts get this wrong, see docs/evaluation.md).

Ties are resolved pessimistically: a negative whose score equals the positive's counts as ranked above it,
so the rank never depends on the sort order of equal scores and a collapsed model (all similarities equal)
scores R@K = 0 instead of a perfect 100. The reference `argsort` breaks exact ties by memory order, which
only matters for such degenerate matrices; on real float scores the two agree.
Everything is vectorised and processed in column/row shards so that 5K x 25K and larger fit in bounded memory.
"""

from __future__ import annotations

import math

import numpy as np

from vsekit.metrics.common import (  # noqa: F401  (MetricsInputError, NonFiniteScoresError: public here too)
    MetricsInputError,
    NonFiniteScoresError,
    check_inputs,
    fold_slices,
    raise_not_finite,
)

RECALL_KS = (1, 5, 10)
METRIC_KEYS = (
    "i2t_r1",
    "i2t_r5",
    "i2t_r10",
    "i2t_medr",
    "i2t_meanr",
    "t2i_r1",
    "t2i_r5",
    "t2i_r10",
    "t2i_medr",
    "t2i_meanr",
    "rsum",
)


def ranks_both(
    sims: np.ndarray, cap2img: np.ndarray, block_bytes: int = 4 << 20
) -> tuple[np.ndarray, np.ndarray]:
    """(i2t ranks, t2i ranks) as `ranks_i2t` and `ranks_t2i` compute them, in one pass over contiguous row
    blocks of about `block_bytes` (a memory-mapped .npy is read once, straight from the page cache), which
    also checks that every score is finite (the error names the first bad entry, as `check_inputs` does).

    Scores are compared in their own floating dtype: float16/32 values are exact in float64, so this gives
    the very counts of the float64 comparisons in `ranks_i2t`. Inputs as `check_inputs` returns them.
    """
    n_img, n_cap = sims.shape
    cols = np.arange(n_cap)
    own = np.asarray(sims[cap2img, cols])  # each caption's score with its own image
    best = np.full(n_img, -np.inf, dtype=own.dtype)  # each image's best own caption
    with np.errstate(invalid="ignore"):  # a NaN here is reported by the pass below, naming its place
        np.maximum.at(best, cap2img, own)
        own_at_best = np.zeros(n_img, dtype=np.int64)  # own captions tied with the best: not negatives
        np.add.at(own_at_best, cap2img, (own >= best[cap2img]).astype(np.int64))
    i2t = np.empty(n_img, dtype=np.int64)
    t2i = np.zeros(n_cap, dtype=np.int64)
    rows_per_block = max(1, block_bytes // max(1, n_cap * sims.dtype.itemsize))
    mask = np.empty((min(rows_per_block, n_img), n_cap), dtype=bool)
    for start in range(0, n_img, rows_per_block):
        stop = min(start + rows_per_block, n_img)
        block = np.asarray(sims[start:stop])
        if not (np.isfinite(block.min()) and np.isfinite(block.max())):  # NaN propagates through min/max
            raise_not_finite(block, start)
        m = mask[: stop - start]
        np.greater_equal(block, own, out=m)  # image above (or tied with) each caption's own image
        t2i += np.count_nonzero(m, axis=0)
        np.greater_equal(block, best[start:stop, None], out=m)  # captions at or above the best own one
        i2t[start:stop] = np.count_nonzero(m, axis=1)
    # `>=` counted the own image once (t2i) and the own captions tied with the best (i2t)
    return i2t - own_at_best, t2i - 1


def ranks_t2i(sims: np.ndarray, cap2img: np.ndarray, shard: int = 2048) -> np.ndarray:
    """0-based rank of each caption's own image among all images."""
    n_cap = sims.shape[1]
    ranks = np.empty(n_cap, dtype=np.int64)
    for start in range(0, n_cap, shard):
        cols = slice(start, min(start + shard, n_cap))
        block = np.asarray(sims[:, cols])
        pos = block[cap2img[cols], np.arange(block.shape[1])]
        # `>=` counts the positive itself once; every other image with an equal score ranks above it.
        ranks[cols] = (block >= pos[None, :]).sum(0) - 1
    return ranks


def ranks_i2t(sims: np.ndarray, cap2img: np.ndarray, shard: int = 512) -> np.ndarray:
    """0-based rank of each image's best-ranked own caption among all captions."""
    n_img = sims.shape[0]
    best_pos = np.full(n_img, -np.inf, dtype=np.float64)
    cols = np.arange(sims.shape[1])
    own_scores = np.asarray(sims[cap2img, cols], dtype=np.float64)
    np.maximum.at(best_pos, cap2img, own_scores)
    # own captions tied with the best one are not negatives: subtract them from the `>=` count
    own_at_best = np.zeros(n_img, dtype=np.int64)
    np.add.at(own_at_best, cap2img, (own_scores >= best_pos[cap2img]).astype(np.int64))
    ranks = np.empty(n_img, dtype=np.int64)
    for start in range(0, n_img, shard):
        rows = slice(start, min(start + shard, n_img))
        block = np.asarray(sims[rows], dtype=np.float64)
        ranks[rows] = (block >= best_pos[rows, None]).sum(1) - own_at_best[rows]
    return ranks


def summarize_ranks(ranks: np.ndarray, prefix: str) -> dict[str, float]:
    out = {f"{prefix}_r{k}": float(100.0 * np.mean(ranks < k)) for k in RECALL_KS}
    out[f"{prefix}_medr"] = float(np.floor(np.median(ranks)) + 1)
    out[f"{prefix}_meanr"] = float(ranks.mean() + 1)
    return out


def retrieval_metrics(sims: np.ndarray, cap2img: np.ndarray) -> dict[str, float]:
    """R@1/5/10, medr, meanr in both directions and rsum for one similarity matrix."""
    sims, cap2img = check_inputs(sims, cap2img, finite=False)  # ranks_both scans for NaN/inf in its pass
    i2t, t2i = ranks_both(sims, cap2img)
    out = summarize_ranks(i2t, "i2t")
    out.update(summarize_ranks(t2i, "t2i"))
    out["rsum"] = sum(out[f"{d}_r{k}"] for d in ("i2t", "t2i") for k in RECALL_KS)
    return {k: out[k] for k in METRIC_KEYS}


# COCO 1K (`--fold5`): the 5,000 COCO test images (Karpathy split) in five folds of 1,000, 5 captions each
FOLD5_IMAGES = 5000
FOLD5_FOLDS = 5
FOLD5_CAPTIONS_PER_IMAGE = 5


def check_fold5_protocol(n_images: int, cap2img: np.ndarray, where: str = "--fold5") -> None:
    """Refuse `--fold5` (COCO 1K) where the protocol does not apply: it means the mean over five folds of
    1,000 of COCO's 5,000 test images with their 5 captions each; on other sizes ("folds" of one image on a
    5 x 25 matrix: rsum 600) the number would read as a COCO 1K score and compare with nothing. A
    `MetricsInputError` (a ValueError) naming the sizes."""
    ids = np.asarray(cap2img).ravel()
    if ids.dtype.kind not in "iu" or (ids.size and (ids.min() < 0 or ids.max() >= n_images)):
        return  # not a caption->image map at all: `check_inputs` names that, before any metric
    counts = np.bincount(ids.astype(np.int64), minlength=int(n_images))
    per_image = sorted({int(c) for c in counts})
    if int(n_images) == FOLD5_IMAGES and per_image == [FOLD5_CAPTIONS_PER_IMAGE]:
        return
    shown = "/".join(str(c) for c in per_image[:3]) + ("/…" if len(per_image) > 3 else "")
    raise MetricsInputError(
        f"{where}: COCO 1K (--fold5) needs exactly {FOLD5_IMAGES:,} images with "
        f"{FOLD5_CAPTIONS_PER_IMAGE} captions each ({FOLD5_FOLDS} folds of {FOLD5_IMAGES // FOLD5_FOLDS:,}); "
        f"this one has {int(n_images):,} images and {len(cap2img):,} captions ({shown} per image): "
        "score it without --fold5"
    )


def retrieval_metrics_fold5(sims: np.ndarray, cap2img: np.ndarray, n_folds: int = 5) -> dict:
    """Metrics on each of `n_folds` consecutive image blocks with their captions, every key averaged over
    the blocks: the mechanism of the COCO 1K protocol; `evaluate_sims(fold5=True)` (what `vse eval --fold5`
    and `vse eval-sims --fold5` call) first checks the protocol's sizes (`check_fold5_protocol`)."""
    sims, cap2img = check_inputs(sims, cap2img)
    folds = []
    for rows, cols in fold_slices(cap2img, sims.shape[0], n_folds):
        sub = np.asarray(sims[rows[0] : rows[-1] + 1][:, cols])
        folds.append(retrieval_metrics(sub, cap2img[cols] - rows[0]))
    out: dict = {k: float(np.mean([f[k] for f in folds])) for k in METRIC_KEYS}
    out["folds"] = folds
    return out


def evaluate_sims(
    sims: np.ndarray,
    cap2img: np.ndarray,
    fold5: bool = False,
    relevance=None,
    cs_k: tuple[int, ...] | list[int] = (100, 1000),
    cs_protocol: str = "paper",
) -> dict:
    """Entry point used by every model, ensemble and search evaluation.

    With a caption x caption `relevance` matrix (array or .npy path) the coherence keys of the ladder-loss
    paper are added: CS@K for K in `cs_k` (`cs_protocol` "paper": `i2t_cs@K`, `t2i_cs@K`, one caption per
    image; "all_captions": `i2t_cs_allcap@K`, …) and `i2t_map`. With `fold5` they are, like the recalls,
    means over the five 1K-image folds (and each fold's values are in `folds`); `fold5` is refused
    (`check_fold5_protocol`, a ValueError) unless the matrix is COCO's 5,000 test images x 5 captions each.
    """
    if fold5:
        check_fold5_protocol(np.shape(sims)[0], cap2img)
    out = retrieval_metrics_fold5(sims, cap2img) if fold5 else retrieval_metrics(sims, cap2img)
    if relevance is not None:
        add_coherence(out, sims, cap2img, relevance, cs_k, cs_protocol, fold5)
    return out


def add_coherence(
    metrics: dict,
    sims: np.ndarray,
    cap2img: np.ndarray,
    relevance,
    cs_k,
    cs_protocol: str = "paper",
    fold5: bool = False,
) -> dict:
    """Add the coherence keys to `metrics` (in place), per fold into `metrics["folds"]` under `fold5`."""
    from vsekit.metrics.coherence import coherence_metrics, coherence_metrics_by_fold, mean_over_folds

    if not fold5:
        metrics.update(coherence_metrics(sims, cap2img, relevance, cs_k, protocol=cs_protocol))
        return metrics
    folds = coherence_metrics_by_fold(sims, cap2img, relevance, cs_k, protocol=cs_protocol)
    metrics.update(mean_over_folds(folds))
    for row, extra in zip(metrics.get("folds", []), folds):
        row.update(extra)
    return metrics


def _nested_hits(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance of h_1 + h_5 + h_10 per query, where h_K = 1[rank < K] with P(h_K) = p[:, K's index]:
    the hits are nested (h_1 <= h_5 <= h_10), so Cov(h_a, h_b) = p_min(a,b) - p_a p_b."""
    mean = p.sum(1)
    lo = np.minimum(p[:, :, None], p[:, None, :])
    var = (lo - p[:, :, None] * p[:, None, :]).sum((1, 2))
    return mean, var


def chance_rsum(cap2img: np.ndarray, n_images: int | None = None) -> tuple[float, float]:
    """rsum of a similarity matrix of independent random scores (no ties) on this caption->image map: its
    expectation and a bound on its standard deviation, so a model can be told apart from chance.

    t2i: a caption's image lies uniformly among the N images, P(rank < K) = min(K, N) / N. i2t: an image's c
    captions are a uniform c-subset of the M columns, P(rank < K) = 1 - C(M - c, K) / C(M, K). Rows are
    independent (as are columns), so each direction's variance is exact; the two directions share the matrix,
    so the returned std is the sum of theirs (the largest any correlation between them allows)."""
    cap2img = np.asarray(cap2img, dtype=np.int64).reshape(-1)
    n_img = int(cap2img.max()) + 1 if n_images is None else int(n_images)
    n_cap = len(cap2img)
    if n_cap == 0 or n_img < 1 or cap2img.min() < 0 or cap2img.max() >= n_img:
        raise MetricsInputError(f"caption->image map does not fit {n_img} images: {n_cap} captions")
    ks = np.asarray(RECALL_KS, dtype=np.float64)
    t2i_p = np.minimum(ks, n_img)[None, :] / n_img
    t2i_mean, t2i_var = _nested_hits(t2i_p)
    counts = np.bincount(cap2img, minlength=n_img).astype(np.float64)
    # C(M - c, K) / C(M, K) = prod_{j < K} (M - c - j) / (M - j), 0 once a factor reaches 0
    j = np.arange(int(ks.max()), dtype=np.float64)
    factors = np.clip((n_cap - counts[:, None] - j) / np.maximum(n_cap - j, 1.0), 0.0, 1.0)
    miss = np.cumprod(factors, axis=1)[:, ks.astype(np.int64) - 1]
    i2t_mean, i2t_var = _nested_hits(1.0 - miss)
    mean = 100.0 * (t2i_mean[0] + i2t_mean.mean())
    std = 100.0 * (math.sqrt(t2i_var[0] / n_cap) + math.sqrt(i2t_var.sum()) / n_img)
    return float(mean), float(std)


def cap2img_for_k(n_img: int, n_cap: int, captions_per_image: int) -> np.ndarray:
    """Caption->image map of the SCAN layout: captions k*i .. k*i+k-1 belong to image i."""
    if n_cap != n_img * captions_per_image:
        raise MetricsInputError(
            f"{n_cap} captions do not fit {n_img} images x {captions_per_image} captions per image"
        )
    return np.arange(n_cap, dtype=np.int64) // captions_per_image


def format_table(metrics: dict) -> str:
    """One-line human summary."""
    return (
        f"i2t R@1 {metrics['i2t_r1']:.1f} R@5 {metrics['i2t_r5']:.1f} R@10 {metrics['i2t_r10']:.1f} "
        f"medr {metrics['i2t_medr']:.0f} meanr {metrics['i2t_meanr']:.1f} | "
        f"t2i R@1 {metrics['t2i_r1']:.1f} R@5 {metrics['t2i_r5']:.1f} R@10 {metrics['t2i_r10']:.1f} "
        f"medr {metrics['t2i_medr']:.0f} meanr {metrics['t2i_meanr']:.1f} | rsum {metrics['rsum']:.1f}"
    )
