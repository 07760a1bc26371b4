"""Similarity-matrix files, read for `vse eval-sims` and the evaluation benchmarks: one or more [images, captions]
.npy score matrices (`vse eval --save-sims` writes them; several are averaged, an ensemble) and a caption->image
map (one image row per line). Read and checked here, naming the file and the problem before any metric is
computed; `vsekit.metrics` then takes the arrays. numpy only, no torch."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vsekit.data.precomp import DataFormatError, read_int_lines
from vsekit.utils.io import open_npy


def load_sims(paths: list[str]) -> np.ndarray:
    """Average of one or more [images, captions] .npy matrices (an ensemble = mean similarity), as float32.

    One float32 file is returned memory-mapped, not copied: the metrics read it once, in row blocks, from the
    page cache (a 5K x 25K matrix is 500 MB that need not be allocated and filled first).
    """
    total = None
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: similarity file does not exist")
        arr = open_npy(path, DataFormatError)
        if arr.ndim != 2:
            raise DataFormatError(f"{path}: expected a 2-D (images x captions) matrix, got shape {arr.shape}")
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise DataFormatError(f"{path}: expected numbers, got dtype {arr.dtype}")
        if arr.size == 0:  # before any caption->image map is compared with it
            raise DataFormatError(
                f"{path}: the similarity matrix is empty ({arr.shape[0]} x {arr.shape[1]}); "
                f"expected an images x captions matrix of scores"
            )
        if total is None and len(paths) == 1 and arr.dtype == np.float32:
            return arr
        if total is None:
            total = np.array(arr, dtype=np.float32)
        elif arr.shape != total.shape:
            raise DataFormatError(f"{path}: shape {arr.shape} differs from {paths[0]}'s {total.shape}")
        else:
            total += arr
    if total is None:
        raise DataFormatError("no similarity file given")
    if len(paths) > 1:
        total /= len(paths)
    return total


def read_cap2img(path: str | Path, n_cap: int) -> np.ndarray:
    """A caption->image map file (one 0-based image row per line) for a matrix of `n_cap` caption columns."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: caption->image file does not exist")
    c2i = read_int_lines(p)
    if len(c2i) != n_cap:
        raise DataFormatError(f"{p}: {len(c2i)} lines but the similarity matrix has {n_cap} caption columns")
    return c2i
