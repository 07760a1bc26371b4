"""Checks that run before training starts, so a bad file fails in seconds rather than an hour in."""

from __future__ import annotations

import numpy as np

from vsekit.data.precomp import DataFormatError


def check_split_features(split, chunk_rows: int = 2048) -> None:
    """NaN/inf scan of a split's features, chunk by chunk (memory-mapped files stay on disk)."""
    feats = split.features
    path = split.root / f"{split.split}_ims.npy"
    for start in range(0, feats.shape[0], chunk_rows):
        block = np.asarray(feats[start : start + chunk_rows])
        finite = np.isfinite(block)
        if not finite.all():
            row = start + int(np.argwhere(~finite.all(axis=(1, 2)))[0, 0])
            raise DataFormatError(f"{path}: image row {row} has NaN or inf features")
    for i, cap in enumerate(split.captions):
        if not cap.strip():
            raise DataFormatError(f"{split.root / f'{split.split}_caps.txt'}:{i + 1}: empty caption")
