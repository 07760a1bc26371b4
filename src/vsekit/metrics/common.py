"""What every metric module shares: the input checks of a similarity matrix and caption->image map, their
error types, and the 1K folds. Kept apart so that retrieval and coherence metrics import it, never each other."""

from __future__ import annotations

import numpy as np

from vsekit.errors import VseInputError


class MetricsInputError(VseInputError):
    """A similarity matrix or caption->image map that cannot be evaluated."""


class NonFiniteScoresError(MetricsInputError):
    """A NaN or inf score in a similarity matrix; `image`, `caption` = the first one (row, column), so that a
    caller that knows the matrix's file(s) can name the one that holds it."""

    def __init__(self, message: str, image: int, caption: int) -> None:
        super().__init__(message)
        self.image, self.caption = image, caption


def check_inputs(sims: np.ndarray, cap2img: np.ndarray, finite: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(sims, cap2img as int64) after checking shapes, types and the map; `finite=False` leaves the NaN/inf scan
    to the caller (`ranks_both` does it in its one pass over the matrix)."""
    sims = np.asarray(sims)
    cap2img = np.asarray(cap2img)
    if sims.ndim != 2:
        raise MetricsInputError(f"similarity matrix must be 2-D (images x captions), got shape {sims.shape}")
    n_img, n_cap = sims.shape
    if n_img == 0 or n_cap == 0:
        raise MetricsInputError(f"similarity matrix is empty: shape {sims.shape}")
    if not np.issubdtype(sims.dtype, np.floating):
        if not np.issubdtype(sims.dtype, np.integer):
            raise MetricsInputError(f"similarity matrix must be numeric, got dtype {sims.dtype}")
        sims = sims.astype(np.float32)
    if cap2img.ndim != 1 or len(cap2img) != n_cap:
        raise MetricsInputError(
            f"caption->image map has {cap2img.size} entries but the matrix has {n_cap} caption columns"
        )
    if not np.issubdtype(cap2img.dtype, np.integer):
        raise MetricsInputError(f"caption->image map must hold integers, got dtype {cap2img.dtype}")
    if cap2img.min() < 0 or cap2img.max() >= n_img:
        raise MetricsInputError(
            f"caption->image map points outside 0..{n_img - 1} (min {cap2img.min()}, max {cap2img.max()})"
        )
    missing = np.setdiff1d(np.arange(n_img), cap2img)
    if len(missing):
        raise MetricsInputError(f"{len(missing)} image row(s) have no caption, e.g. row {missing[0]}")
    if finite and not np.isfinite(sims).all():
        raise_not_finite(sims)
    return sims, cap2img.astype(np.int64)


def raise_not_finite(block: np.ndarray, row0: int = 0) -> None:
    """Raise NonFiniteScoresError at the first NaN/inf of `block` (whose first row is matrix row `row0`)."""
    bad = np.argwhere(~np.isfinite(block))[0]
    image, caption = row0 + int(bad[0]), int(bad[1])
    raise NonFiniteScoresError(
        f"similarity matrix has NaN/inf values, first at (image {image}, caption {caption})", image, caption
    )


def fold_slices(cap2img: np.ndarray, n_img: int, n_folds: int = 5) -> list[tuple[np.ndarray, np.ndarray]]:
    """(image rows, caption columns) of each consecutive image block."""
    if n_img % n_folds:
        raise MetricsInputError(f"fold-{n_folds} needs the image count ({n_img}) to divide by {n_folds}")
    size = n_img // n_folds
    folds = []
    for f in range(n_folds):
        rows = np.arange(f * size, (f + 1) * size)
        cols = np.nonzero((cap2img >= f * size) & (cap2img < (f + 1) * size))[0]
        folds.append((rows, cols))
    return folds
