"""Coherence metrics of the ladder-loss paper (Wang et al., TMM 2022): Coherent Score CS@K and i2t mAP.

CS@K (Sec. III-D): for every query, take the top-K candidates by model score and compute Kendall's τ-b
(Eq. 13: (P − Q) / sqrt((P + Q + T)(P + Q + U)), ties counted the τ-b way) between the model's ranking
and the ranking by relevance degree; CS@K is the mean over queries. τ only depends on orders, so the
model scores and relevance values are compared directly (as the reference `doTau` does with
scipy.stats.kendalltau). A query whose top-K scores or relevances are all tied has no defined τ; it
counts as 0 (no evidence either way) instead of poisoning the mean with NaN.

Relevance of a candidate (reference code and paper Eq. 1): text–text relevance between the query's own
caption(s) and the candidate's caption(s), from a caption x caption matrix R (computed and cached by
`vsekit.relevance`; this module only takes arrays and imports no model). In the `all_captions` protocol an
image's several captions are combined with `max` by default:
i2t rel(image q, caption c) = max over q's captions a of R[a, c]; t2i rel(caption c, image p) = max over
p's captions a of R[c, a]. With one caption per image this is exactly the reference's definition.

Protocols (`coherence_metrics(protocol=...)`): `paper` (default, keys `i2t_cs@K`) is the paper's Table I and
the release's `doTau`: 1,000 test images with **one caption each** (the first; the release's `[::5]`),
K in {100, 1000}, so every query ranks 1,000 candidates; under the COCO 1K protocol (`fold5`) it is computed
per 1K-image fold and averaged, like the recalls. `all_captions` (keys `i2t_cs_allcap@K`) ranks every
caption of the split (5 per image: i2t over 5N captions, t2i over N images for 5N caption queries), an
extension of the paper's metric, not comparable with its numbers.

mAP (Sec. V-F, i2t only): average precision of each image query with its own captions as the relevant
set; ties are resolved like the R@K code (a candidate ranks above a positive only with a strictly
greater score).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vsekit.metrics.common import MetricsInputError, check_inputs, fold_slices
from vsekit.utils.io import open_npy

COMBINE_RULES = ("max", "mean")
CS_PROTOCOLS = ("paper", "all_captions")
PAPER_CS_K = (100, 1000)  # the paper's CS@K on 1,000 test images (Tables I, III)


def check_relevance(relevance: np.ndarray, n_captions: int, where: str = "relevance matrix") -> np.ndarray:
    """A caption x caption relevance matrix of the right shape and finite values, else a clear error."""
    rel = np.asarray(relevance)
    if rel.ndim != 2 or rel.shape[0] != rel.shape[1]:
        raise MetricsInputError(f"{where}: expected a square caption x caption matrix, got shape {rel.shape}")
    if rel.shape[0] != n_captions:
        raise MetricsInputError(
            f"{where}: {rel.shape[0]} captions but the similarity matrix has {n_captions}"
        )
    if not (np.issubdtype(rel.dtype, np.floating) or np.issubdtype(rel.dtype, np.integer)):
        raise MetricsInputError(f"{where}: expected numbers, got dtype {rel.dtype}")
    return rel


def image_caption_relevance(
    relevance: np.ndarray,
    cap2img: np.ndarray,
    combine: str = "max",
    transpose: bool = False,
    block: int = 1024,
) -> np.ndarray:
    """[images, captions] relevance of caption c to image i: `combine` over i's captions a of R[a, c]
    (`transpose=True` uses R[c, a], the caption-query direction; equal for a symmetric R)."""
    if combine not in COMBINE_RULES:
        raise MetricsInputError(f"combine={combine!r}; choose one of {', '.join(COMBINE_RULES)}")
    cap2img = np.asarray(cap2img, dtype=np.int64)
    n_img, n_cap = int(cap2img.max()) + 1, len(cap2img)
    order = np.argsort(cap2img, kind="stable")
    starts = np.searchsorted(cap2img[order], np.arange(n_img))
    counts = np.bincount(cap2img, minlength=n_img).astype(np.float32)
    out = np.empty((n_img, n_cap), dtype=np.float32)
    for c0 in range(0, n_cap, block):
        cols = slice(c0, min(c0 + block, n_cap))
        part = relevance[cols, :].T if transpose else relevance[:, cols]  # [all captions, block]
        grouped = np.asarray(part, dtype=np.float32)[order]
        if combine == "max":
            out[:, cols] = np.maximum.reduceat(grouped, starts, axis=0)
        else:
            out[:, cols] = np.add.reduceat(grouped, starts, axis=0) / counts[:, None]
    return out


def kendall_tau_b(x: np.ndarray, y: np.ndarray, chunk_elems: int = 1 << 23) -> np.ndarray:
    """Row-wise Kendall τ-b of two [Q, K] arrays (NaN-free: an undefined τ is 0). O(K²) per row, vectorised
    over rows in chunks of at most `chunk_elems` pair comparisons."""
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.ndim != 2:
        raise MetricsInputError(
            f"kendall_tau_b needs two [queries, K] arrays of one shape, got {x.shape}, {y.shape}"
        )
    q, k = x.shape
    out = np.zeros(q, dtype=np.float64)
    if k < 2:
        return out
    step = max(1, chunk_elems // (k * k))
    for s in range(0, q, step):
        xs, ys = x[s : s + step], y[s : s + step]
        sx = np.sign(xs[:, :, None] - xs[:, None, :]).astype(np.int8)
        sy = np.sign(ys[:, :, None] - ys[:, None, :]).astype(np.int8)
        pq = (sx * sy).sum(axis=(1, 2), dtype=np.int64)  # 2 (P - Q)
        nx = np.abs(sx).sum(axis=(1, 2), dtype=np.int64)  # 2 (P + Q + U): pairs not tied in x
        ny = np.abs(sy).sum(axis=(1, 2), dtype=np.int64)  # 2 (P + Q + T): pairs not tied in y
        den = np.sqrt(nx.astype(np.float64) * ny.astype(np.float64))
        out[s : s + step] = np.divide(pq, den, out=np.zeros(len(pq)), where=den > 0)
    return out


def coherent_scores(scores: np.ndarray, relevance: np.ndarray, k: int, chunk_rows: int = 256) -> np.ndarray:
    """Per-query τ-b over the top-`k` candidates of each row of `scores` ([queries, candidates]).

    The top-k is taken by descending score, equal scores in index order (deterministic); k larger than
    the candidate count uses all candidates.
    """
    if scores.shape != relevance.shape:
        raise MetricsInputError(f"scores {scores.shape} and relevance {relevance.shape} differ in shape")
    if k < 2:
        raise MetricsInputError(f"CS@K needs K >= 2, got {k}")
    k = min(k, scores.shape[1])
    out = np.empty(scores.shape[0], dtype=np.float64)
    for s in range(0, scores.shape[0], chunk_rows):
        sc = np.asarray(scores[s : s + chunk_rows], dtype=np.float64)
        top = np.argsort(-sc, axis=1, kind="stable")[:, :k]
        rel = np.asarray(relevance[s : s + chunk_rows], dtype=np.float64)
        out[s : s + chunk_rows] = kendall_tau_b(
            np.take_along_axis(sc, top, 1), np.take_along_axis(rel, top, 1)
        )
    return out


def average_precision_i2t(sims: np.ndarray, cap2img: np.ndarray, shard: int = 512) -> np.ndarray:
    """AP of each image query over all captions, its own captions being the relevant ones."""
    sims, cap2img = check_inputs(sims, cap2img)
    n_cap = sims.shape[1]
    cols = np.arange(n_cap)
    pos_score = np.asarray(sims[cap2img, cols], dtype=np.float64)
    greater = np.empty(n_cap, dtype=np.int64)  # candidates scored strictly above each positive
    for start in range(0, n_cap, shard):
        c = slice(start, min(start + shard, n_cap))
        rows = np.asarray(sims[cap2img[c]], dtype=np.float64)
        greater[c] = (rows > pos_score[c, None]).sum(1)
    # order positives within each image by descending score: k = position among its image's positives;
    # positives strictly above = start of its tie run (ties among positives do not change AP)
    order = np.lexsort((cols, -pos_score, cap2img))
    img_s, score_s = cap2img[order], pos_score[order]
    idx = np.arange(n_cap)
    new_group = np.r_[True, img_s[1:] != img_s[:-1]]
    new_run = new_group | np.r_[True, score_s[1:] != score_s[:-1]]
    group_start = np.maximum.accumulate(np.where(new_group, idx, 0))
    run_start = np.maximum.accumulate(np.where(new_run, idx, 0))
    k = idx - group_start + 1
    pos_above = run_start - group_start
    neg_above = greater[order] - pos_above
    precision = k / (k + neg_above)
    n_img = sims.shape[0]
    return np.bincount(img_s, weights=precision, minlength=n_img) / np.bincount(img_s, minlength=n_img)


def _as_relevance(relevance: np.ndarray | str | Path, n_cap: int) -> np.ndarray:
    if isinstance(relevance, (str, Path)):
        path = Path(relevance)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: relevance file does not exist")
        return check_relevance(open_npy(path, MetricsInputError), n_cap, str(path))
    return check_relevance(relevance, n_cap)


def first_caption_per_image(cap2img: np.ndarray) -> np.ndarray:
    """Index of each image's first caption in caption order (SCAN's 5-per-image layout: the release's `[::5]`)."""
    cap2img = np.asarray(cap2img, dtype=np.int64)
    images, first = np.unique(cap2img, return_index=True)
    if len(images) != int(cap2img.max()) + 1:
        raise MetricsInputError("every image row needs a caption for the one-caption-per-image CS@K")
    return first


def _checked_relevance(relevance: np.ndarray | str | Path, n_cap: int) -> np.ndarray:
    rel = _as_relevance(relevance, n_cap)
    for r0 in range(0, len(rel), 1024):
        block = np.asarray(rel[r0 : r0 + 1024], dtype=np.float32)
        if not np.isfinite(block).all():
            bad = np.argwhere(~np.isfinite(block))[0]
            raise MetricsInputError(
                f"relevance matrix has NaN/inf values, first at ({r0 + bad[0]}, {bad[1]})"
            )
    return rel


def _coherence(
    sims: np.ndarray, cap2img: np.ndarray, rel: np.ndarray, ks, combine: str, protocol: str
) -> dict:
    out: dict[str, float] = {}
    if protocol == "paper":
        # one caption per image: S = [images, their first captions], relevance R[c_i, c_j] in both directions
        # (i2t: query image i by its caption c_i; t2i: candidate image j by its caption c_j)
        reps = first_caption_per_image(cap2img)
        s = np.asarray(sims[:, reps], dtype=np.float64)
        r = np.asarray(rel[np.ix_(reps, reps)], dtype=np.float64)
        for k in ks:
            out[f"i2t_cs@{k}"] = float(coherent_scores(s, r, int(k)).mean())
            out[f"t2i_cs@{k}"] = float(coherent_scores(s.T, r, int(k)).mean())
    elif protocol == "all_captions":
        rel_i2t = image_caption_relevance(rel, cap2img, combine)  # [images, captions]
        rel_t2i = image_caption_relevance(rel, cap2img, combine, transpose=True).T  # [captions, images]
        for k in ks:
            out[f"i2t_cs_allcap@{k}"] = float(coherent_scores(sims, rel_i2t, int(k)).mean())
            out[f"t2i_cs_allcap@{k}"] = float(coherent_scores(np.asarray(sims).T, rel_t2i, int(k)).mean())
    else:
        raise MetricsInputError(f"CS@K protocol {protocol!r}; choose one of {', '.join(CS_PROTOCOLS)}")
    out["i2t_map"] = float(average_precision_i2t(sims, cap2img).mean())
    return out


def coherence_metrics_by_fold(
    sims: np.ndarray,
    cap2img: np.ndarray,
    relevance: np.ndarray | str | Path,
    ks: list[int] | tuple[int, ...] = PAPER_CS_K,
    combine: str = "max",
    protocol: str = "paper",
    n_folds: int = 5,
) -> list[dict[str, float]]:
    """`coherence_metrics` of each of the `n_folds` consecutive image blocks (COCO 1K: five folds of 1,000
    images with their captions), each fold ranked only among its own images and captions, like the recalls
    of `retrieval_metrics_fold5`."""

    sims, cap2img = check_inputs(sims, cap2img)
    rel = _checked_relevance(relevance, sims.shape[1])
    folds = []
    for rows, cols in fold_slices(cap2img, sims.shape[0], n_folds):
        sub = np.asarray(sims[rows[0] : rows[-1] + 1][:, cols])
        sub_rel = np.asarray(rel[np.ix_(cols, cols)])
        folds.append(_coherence(sub, cap2img[cols] - rows[0], sub_rel, ks, combine, protocol))
    return folds


def mean_over_folds(folds: list[dict[str, float]]) -> dict[str, float]:
    return {k: float(np.mean([f[k] for f in folds])) for k in folds[0]}


def coherence_metrics(
    sims: np.ndarray,
    cap2img: np.ndarray,
    relevance: np.ndarray | str | Path,
    ks: list[int] | tuple[int, ...] = PAPER_CS_K,
    combine: str = "max",
    protocol: str = "paper",
    fold5: bool = False,
) -> dict[str, float]:
    """Coherence keys from an [images, captions] similarity matrix and a [captions, captions] relevance
    matrix: CS@K for each K in `ks`, and `i2t_mAP` (over all captions). (Mean rank is `i2t_meanr` /
    `t2i_meanr` of `evaluate_sims`.)

    `protocol="paper"` (default; keys `i2t_cs@K`, `t2i_cs@K`): the paper's Table I and the release's `doTau`
    — one caption per image (each image's first), so both directions rank N candidates for N queries; K
    above N uses all N (on 1K images: CS@100 and CS@1000). `protocol="all_captions"` (keys
    `i2t_cs_allcap@K`, `t2i_cs_allcap@K`): every caption is a query or candidate, a candidate's relevance to
    an image combined over its captions with `combine`. `fold5=True`: the mean over five 1K-image folds
    (each fold ranked within itself, as the fold-5 recalls), not one 5K ranking.
    """
    if fold5:
        return mean_over_folds(coherence_metrics_by_fold(sims, cap2img, relevance, ks, combine, protocol))
    sims, cap2img = check_inputs(sims, cap2img)
    return _coherence(sims, cap2img, _checked_relevance(relevance, sims.shape[1]), ks, combine, protocol)


def format_coherence(metrics: dict) -> str:
    """One-line summary of the coherence keys present in `metrics` (empty when there are none)."""
    keys = [k for k in metrics if k.startswith(("i2t_cs", "t2i_cs"))] + (
        ["i2t_map"] if "i2t_map" in metrics else []
    )
    return " ".join(f"{k} {metrics[k]:.3f}" for k in keys)
