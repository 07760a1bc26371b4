"""`vse eval-sims --eccv` speed on COCO 5K test (5,000 x 25,000) against the plain way of feeding eccv-caption.

The plain way (eccv-caption's README: "retrieved item ids sorted by similarity") sorts every query's scores
in full, 5,000 sorts of 25,000 and 25,000 of 5,000, before the package's metric code runs. vsekit builds only
the prefixes the metrics read (`np.argpartition` top-k in row blocks, and each query's 1K-fold top-10; see
vsekit.metrics.eccv). `bench_eccv` writes a planted matrix to a temporary .npy (noise, with the original, CxC
and ECCV positive pairs lifted so every metric lands mid-range), times what `vse eval-sims --eccv` adds (load
+ `eccv_metrics`), and, unless `reference=False`, the full-sort construction (stable argsort of every row,
so ties keep index order, lists cut after the prefix the package reads) fed to the same package code, and
checks that both give the same numbers.

    from vsekit_lab.bench.eccv import bench_eccv
    row = bench_eccv()   # row["eccv_s"], row["reference_s"], row["speedup"], row["max_abs_diff"]
"""

from __future__ import annotations

import logging
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from vsekit.errors import VseInputError
from vsekit.metrics.eccv import (
    CAPTIONS_PER_IMAGE,
    ECCV_KEYS,
    N_CAPTIONS,
    N_FOLDS,
    N_IMAGES,
    EccvGroundTruth,
    eccv_metrics,
    ground_truth,
    package_scores,
    retrieved_items,
)

log = logging.getLogger(__name__)


def planted_eccv_sims(gt: EccvGroundTruth, seed: int = 0) -> np.ndarray:
    """float32 5K x 25K standard-normal scores; original positive pairs +3, CxC and ECCV ones +2."""
    rng = np.random.default_rng(seed)
    sims = rng.standard_normal((N_IMAGES, N_CAPTIONS), dtype=np.float32)
    row_of = {int(q): i for i, q in enumerate(gt.image_ids)}
    col_of = {int(q): c for c, q in enumerate(gt.caption_ids)}
    for gts, lift in ((gt.metrics.eccv_gts, 2.0), (gt.metrics.cxc_gts, 2.0), (gt.metrics.coco_gts, 3.0)):
        pairs = [(row_of[i], col_of[c]) for i, caps in gts["i2t"].items() for c in caps if c in col_of]
        pairs += [(row_of[i], col_of[c]) for c, imgs in gts["t2i"].items() for i in imgs if c in col_of]
        r, c = np.array(pairs).T
        sims[r, c] = rng.standard_normal(len(r), dtype=np.float32) + lift
    return sims


def _full_sort_lists(
    scores: np.ndarray, query_fold: np.ndarray, fold_size: int, item_ids: np.ndarray, k: int, block: int
) -> list[list[int]]:
    """A stable argsort of each whole row, as item ids, cut after max(k, the query's 10th same-fold item)."""
    lists: list[list[int]] = []
    for r0 in range(0, len(scores), block):
        order = np.argsort(-np.asarray(scores[r0 : r0 + block]), axis=1, kind="stable")
        seen = np.cumsum(order // fold_size == query_fold[r0 : r0 + block, None], axis=1)
        lengths = np.maximum(k, np.argmax(seen >= 10, axis=1) + 1)
        lists += [item_ids[o[:n]].tolist() for o, n in zip(order, lengths)]
    return lists


def reference_scores(sims: np.ndarray, gt: EccvGroundTruth) -> dict[str, float]:
    """The plain construction: every query's scores sorted in full, then the package's metric code."""
    img_fold = np.arange(N_IMAGES) // (N_IMAGES // N_FOLDS)
    cap_fold = np.arange(N_CAPTIONS) // (N_CAPTIONS // N_FOLDS)
    i2t = dict(
        zip(
            gt.image_ids.tolist(),
            _full_sort_lists(sims, img_fold, N_CAPTIONS // N_FOLDS, gt.caption_ids, gt.k_i2t, 250),
        )
    )
    t2i = dict(
        zip(
            gt.caption_ids.tolist(),
            _full_sort_lists(
                np.ascontiguousarray(sims.T), cap_fold, N_IMAGES // N_FOLDS, gt.image_ids, gt.k_t2i, 1250
            ),
        )
    )
    return package_scores(gt.metrics, i2t, t2i)


def bench_eccv(
    repeats: int = 3,
    reference: bool = True,
    seed: int = 0,
    sims_path: str | None = None,
    tmp_dir: str | None = None,
) -> dict:
    """Seconds for what `vse eval-sims S.npy --eccv` adds (median of `repeats`, memory-mapped load included),
    split into the retrieved lists and the package's metric code (in memory), and for the full-sort
    reference (once); `max_abs_diff`: the largest key difference between the two (0.0: the same numbers).
    `sims_path`: time a matrix of your own instead of the planted one."""
    from vsekit.data.sims import load_sims

    if repeats < 1:
        raise VseInputError(f"repeats must be positive, got {repeats}")
    gt = ground_truth()
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        path = Path(sims_path) if sims_path else Path(tmp) / "sims.npy"
        if not sims_path:
            np.save(path, planted_eccv_sims(gt, seed))
        times, metrics = [], {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            loaded = load_sims([str(path)])  # what `vse eval-sims FILE` runs
            metrics = eccv_metrics(loaded, str(path))
            times.append(time.perf_counter() - t0)
            del loaded
        sims = np.array(load_sims([str(path)]), dtype=np.float32)
    t0 = time.perf_counter()
    i2t, t2i = retrieved_items(sims, gt)
    t1 = time.perf_counter()
    package_scores(gt.metrics, i2t, t2i)
    t2 = time.perf_counter()
    del i2t, t2i
    row = {
        "images": N_IMAGES,
        "captions": N_CAPTIONS,
        "captions_per_image": CAPTIONS_PER_IMAGE,
        "repeats": repeats,
        "k_i2t": gt.k_i2t,
        "k_t2i": gt.k_t2i,
        "matrix": Path(sims_path).name if sims_path else "planted",
        "eccv_s": statistics.median(times),
        "eccv_min_s": min(times),
        "lists_s": t1 - t0,
        "package_s": t2 - t1,
        "reference_s": float("nan"),
        "speedup": float("nan"),
        "max_abs_diff": float("nan"),
        "eccv_i2t_map_at_r": metrics["eccv_i2t_map_at_r"],
        "coco_5k_i2t_r1": metrics["coco_5k_i2t_r1"],
    }
    if reference:
        t0 = time.perf_counter()
        ref = reference_scores(sims, gt)
        row["reference_s"] = time.perf_counter() - t0
        row["speedup"] = row["reference_s"] / row["eccv_s"]
        row["max_abs_diff"] = max(abs(ref[k] - metrics[k]) for k in ECCV_KEYS)
    log.debug("bench eccv: %s", row)
    return row
