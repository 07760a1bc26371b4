"""Coherence metrics of the ladder-loss paper (Wang et al., TMM 2022): Coherent Score CS@K and i2t mAP.

CS@K (Sec. III-D): for every query, take the top-K candidates by model score and compute Kendall's τ-b
(Eq. 13: (P − Q) / sqrt((P + Q + T)(P + Q + U)), ties counted the τ-b way) between the model's ranking
and the ranking by relevance degree; CS@K is the mean over queries. τ only depends on orders, so the
model scores and relevance values are compared directly (as the reference `doTau` does with
scipy.stats.kendalltau). A query whose top-K scores or relevances are all tied has no defined τ; it
counts as 0 (no evidence either way) instead of poisoning the mean with NaN.

Relevance of a candidate (reference code and paper Eq. 1): text–text relevance between the query's own
caption(s) and the candidate's caption(s), from a caption x caption matrix R (see
`vsekit.data.relevance`). With several captions per image they are combined with `max` by default:
i2t rel(image q, caption c) = max over q's captions a of R[a, c]; t2i rel(caption c, image p) = max over
p's captions a of R[c, a]. With one caption per image this is exactly the reference's definition.

mAP (Sec. V-F, i2t only): average precision of each image query with its own captions as the relevant
set; ties are resolved like the R@K code (a candidate ranks above a positive only with a strictly
greater score).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vsekit.data.relevance import check_relevance, image_caption_relevance
from vsekit.metrics.retrieval import MetricsInputError, check_inputs
from vsekit.utils.io import open_npy


def kendall_tau_b(x: np.ndarray, y: np.ndarray, chunk_elems: int = 1 << 23) -> np.ndarray:
    """Row-wise Kendall τ-b of two [Q, K] arrays (NaN-free: an undefined τ is 0). O(K²) per row, vectorised
    over rows in chunks of at most `chunk_elems` pair comparisons."""
    x, y = np.asarray(x), np.asarray(y)
    if x.shape != y.shape or x.ndim != 2:
        raise MetricsInputError(f"kendall_tau_b needs two [queries, K] arrays of one shape, got {x.shape}, {y.shape}")
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
        out[s : s + chunk_rows] = kendall_tau_b(np.take_along_axis(sc, top, 1), np.take_along_axis(rel, top, 1))
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


def coherence_metrics(sims: np.ndarray, cap2img: np.ndarray, relevance: np.ndarray | str | Path,
                      ks: list[int] | tuple[int, ...] = (100, 500), combine: str = "max") -> dict[str, float]:  # fmt: skip
    """`i2t_cs@K`, `t2i_cs@K` for each K, and `i2t_map`, from an [images, captions] similarity matrix and
    a [captions, captions] relevance matrix. (Mean rank is `i2t_meanr` / `t2i_meanr` of `evaluate_sims`.)"""
    sims, cap2img = check_inputs(sims, cap2img)
    rel = _as_relevance(relevance, sims.shape[1])
    for r0 in range(0, len(rel), 1024):
        block = np.asarray(rel[r0 : r0 + 1024], dtype=np.float32)
        if not np.isfinite(block).all():
            bad = np.argwhere(~np.isfinite(block))[0]
            raise MetricsInputError(f"relevance matrix has NaN/inf values, first at ({r0 + bad[0]}, {bad[1]})")
    rel_i2t = image_caption_relevance(rel, cap2img, combine)  # [images, captions]
    rel_t2i = image_caption_relevance(rel, cap2img, combine, transpose=True).T  # [captions, images]
    out: dict[str, float] = {}
    for k in ks:
        out[f"i2t_cs@{k}"] = float(coherent_scores(sims, rel_i2t, int(k)).mean())
        out[f"t2i_cs@{k}"] = float(coherent_scores(np.asarray(sims).T, rel_t2i, int(k)).mean())
    out["i2t_map"] = float(average_precision_i2t(sims, cap2img).mean())
    return out


def format_coherence(metrics: dict) -> str:
    """One-line summary of the coherence keys present in `metrics` (empty when there are none)."""
    keys = [k for k in metrics if k.startswith(("i2t_cs@", "t2i_cs@"))] + (["i2t_map"] if "i2t_map" in metrics else [])
    return " ".join(f"{k} {metrics[k]:.3f}" for k in keys)
