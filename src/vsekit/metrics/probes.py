"""Scores of compositional probes from similarity arrays: precision@1 of a positive against its negatives
(ARO's order probes), pairwise accuracy (SugarCrepe), each with a binomial interval and its chance level.

Only similarities come in, no model: the same functions score a VSE model, a text-only baseline
(`vsekit.data.text_only`) or any other scorer on the same items. A tie counts as a failure: a scorer that
cannot tell the positive from a negative (a bag of words against a shuffle of the same words) must not get
credit for it, so such a scorer comes out at or below chance, never above. A tie is a difference within `TIE_TOLERANCE` of
the scores' size: a bag of words sums the same word vectors in another order for a shuffle, and float32
rounding then differs in the last bits, which must not decide an item.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import norm

from vsekit.metrics.retrieval import MetricsInputError

CONFIDENCE = 0.95  # the level of every interval a probe reports
TIE_TOLERANCE = 1e-5  # relative: ~80 float32 eps, far below any real preference of a trained model


def beats(positive: np.ndarray, best_negative: np.ndarray) -> np.ndarray:
    """Where the positive scores above the negative by more than a tie (`TIE_TOLERANCE` relative to the
    larger magnitude, at least 1): the one rule of what counts as a win."""
    scale = np.maximum(1.0, np.maximum(np.abs(positive), np.abs(best_negative)))
    return positive - best_negative > TIE_TOLERANCE * scale


def wilson_interval(correct: int, n: int, confidence: float = CONFIDENCE) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion `correct / n`: unlike the normal approximation it stays
    inside [0, 1] and is not zero-width at 0 % or 100 %, the scores probes often have. (nan, nan) for n = 0."""
    if n <= 0:
        return math.nan, math.nan
    if not 0 <= correct <= n:
        raise MetricsInputError(f"{correct} correct out of {n}: not a proportion")
    z = float(norm.ppf(0.5 + confidence / 2))
    p = correct / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # exactly 0 and 1 at the ends (the formula gives them up to rounding)
    return (0.0 if correct == 0 else max(0.0, centre - half)), (
        1.0 if correct == n else min(1.0, centre + half)
    )


def _finite(a: np.ndarray, what: str) -> None:
    bad = ~np.isfinite(a)
    if bad.any():
        raise MetricsInputError(
            f"{what}: score {int(np.flatnonzero(bad.ravel())[0])} is not finite (NaN or inf)"
        )


def summary(correct: np.ndarray, chance: float) -> dict:
    """The record every probe score is reported as: the proportion of `correct` items (in %), its Wilson
    interval (in %), the chance level (in %), n and the count correct."""
    n, k = int(correct.size), int(np.count_nonzero(correct))
    lo, hi = wilson_interval(k, n)
    return {
        "score": 100.0 * k / n if n else math.nan,
        "ci_low": 100.0 * lo,
        "ci_high": 100.0 * hi,
        "chance": 100.0 * chance if n else math.nan,
        "n": n,
        "correct": k,
    }


def precision_at_1(positive: np.ndarray, negatives: np.ndarray) -> dict:
    """Precision@1 of each item's positive against its negatives: an item counts when its positive scores
    above every negative by more than a tie (`beats`: a tie is a failure). `positive` [n]; `negatives` [n, K], NaN where an item
    has fewer than K negatives (each item needs at least one). The chance level is the mean over items of
    1 / (1 + its number of negatives). Returns `summary` with the score under `precision_at_1`."""
    pos = np.asarray(positive, dtype=np.float64).reshape(-1)
    neg = np.asarray(negatives, dtype=np.float64)
    if neg.ndim != 2 or neg.shape[0] != pos.shape[0]:
        raise MetricsInputError(
            f"negatives of shape {neg.shape} for {pos.shape[0]} positives: expected [n, K]"
        )
    _finite(pos, "positive scores")
    present = ~np.isnan(neg)
    counts = present.sum(axis=1)
    if pos.size and counts.min() == 0:
        raise MetricsInputError(f"item {int(np.argmin(counts))} has no negative")
    _finite(neg[present], "negative scores")
    best = np.where(present, neg, -np.inf).max(axis=1) if pos.size else np.zeros(0)
    chance = float(np.mean(1.0 / (1.0 + counts))) if pos.size else math.nan
    out = summary(beats(pos, best), chance)
    out["precision_at_1"] = out.pop("score")
    return out


def pairwise_accuracy(positive: np.ndarray, negative: np.ndarray) -> dict:
    """SugarCrepe's accuracy: the share of items whose positive scores above its one negative (`beats`: a
    tie is a failure); chance 50 %. Returns `summary` with the score under `accuracy`."""
    pos = np.asarray(positive, dtype=np.float64).reshape(-1)
    neg = np.asarray(negative, dtype=np.float64).reshape(-1)
    if pos.shape != neg.shape:
        raise MetricsInputError(f"{pos.size} positive scores but {neg.size} negative scores")
    _finite(pos, "positive scores")
    _finite(neg, "negative scores")
    out = summary(beats(pos, neg), 0.5)
    out["accuracy"] = out.pop("score")
    return out
