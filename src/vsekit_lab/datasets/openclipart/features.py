"""EfficientNet-Lite0 grid features of the rendered pictures, cached per picture id in buckets, and the split
files written from them."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np

from vsekit.data.precomp import IMS, SplitWriter
from vsekit.utils.io import atomic_save_npy, atomic_write_text
from vsekit.utils.progress import progress_bar
from vsekit_lab.datasets.openclipart.render import RENDER_VERSION


def compute_features(
    ids: list[str], out_dir: Path, cache_dir: Path, progress: bool
) -> tuple[dict, dict, Counter]:
    """Lite0 grids for every image, cached per image id in buckets (first 2 hex digits of the id).

    Buckets, not fixed-size chunks of the sorted list: adding or removing one drawing then invalidates
    nothing, only the missing ids are computed, and an interrupted run keeps every finished bucket.
    The cache folder is keyed by the extractor spec and the render version, so changing either recomputes.
    Returns (id -> (bucket array, row), extractor spec, stats).
    """
    from vsekit.data.pictures import open_image
    from vsekit.features.extractor import LiteGridExtractor

    extractor = LiteGridExtractor()
    spec = extractor.describe()
    spec_key = hashlib.sha1((json.dumps(spec, sort_keys=True) + RENDER_VERSION).encode()).hexdigest()[:16]
    folder = cache_dir / spec_key
    folder.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.iterdir():  # caches of another extractor / renderer are dead weight
        if stale.name == spec_key:
            continue
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    shape = (spec["regions"], spec["dim"])
    buckets: dict[str, list[str]] = {}
    for ident in ids:
        buckets.setdefault(ident[:2], []).append(ident)
    where: dict[str, tuple[np.ndarray, int]] = {}
    stats: Counter = Counter()
    bar = progress_bar(enabled=progress, total=len(ids), desc="features", unit="img")
    for name in sorted(buckets):
        npy, idf = folder / f"{name}.npy", folder / f"{name}.ids"
        old_ids: list[str] = []
        arr = np.zeros((0, *shape), np.float16)
        if npy.is_file() and idf.is_file():
            try:
                loaded = np.load(npy, mmap_mode="r")
                listed = idf.read_text(encoding="utf-8").split()
                if (
                    loaded.shape[1:] == shape
                    and loaded.dtype == np.float16
                    and len(listed) == loaded.shape[0]
                ):
                    arr, old_ids = loaded, listed
            except (OSError, ValueError):
                pass
        known = set(old_ids)
        missing = [i for i in buckets[name] if i not in known]
        if missing:
            feats = extractor.extract_paths(
                [out_dir / "images" / f"{i}.png" for i in missing], progress=False, open_picture=open_image
            )
            if not np.isfinite(feats).all():
                raise RuntimeError(f"non-finite features for one of {missing}")
            atomic_save_npy(npy, np.concatenate([np.asarray(arr), feats]))
            old_ids = old_ids + missing
            # after the array: a mismatch means redo
            atomic_write_text(idf, "".join(f"{i}\n" for i in old_ids))
            arr = np.load(npy, mmap_mode="r")
        stats["computed"] += len(missing)
        stats["reused"] += len(buckets[name]) - len(missing)
        row_of = {ident: r for r, ident in enumerate(old_ids)}
        for ident in buckets[name]:
            where[ident] = (arr, row_of[ident])
        bar.update(len(buckets[name]))
    bar.close()
    return where, spec, stats


def write_features(split: SplitWriter, ids: list[str], where: dict) -> None:
    """Stream rows into the split's features, filled in place (the train file is ~300 MB) and published with
    the split's other files (`vsekit.data.precomp.writing_split`)."""
    first = where[ids[0]][0] if ids else None
    regions, dim = (first.shape[1], first.shape[2]) if first is not None else (49, 1280)
    mm = split.memmap(IMS, (len(ids), regions, dim), np.float16)
    for row, ident in enumerate(ids):
        arr, r = where[ident]
        mm[row] = arr[r]
