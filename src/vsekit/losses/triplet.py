"""Hinge triplet loss of VSE++ on an in-batch similarity matrix.

sims[i, j] = s(image_i, caption_j); the diagonal holds the positive pairs. With `hardest=True` only the
hardest negative of each row and column counts (VSE++), otherwise the sum over all negatives (VSE0,
the VSE∞ warm-up epoch). Losses are summed over the batch, as in the reference code.
"""

from __future__ import annotations

import torch

from vsekit.losses.base import InBatchLoss


def positive_mask(image_ids: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """[B, B] True where image i and caption j are a positive pair (the diagonal, plus captions of
    the same image when `image_ids` is given)."""
    eye = torch.eye(batch, dtype=torch.bool, device=device)
    if image_ids is None:
        return eye
    ids = image_ids.to(device)
    return eye | (ids.unsqueeze(1) == ids.unsqueeze(0))


def triplet_loss(
    sims: torch.Tensor, margin: float = 0.2, hardest: bool = True, positives: torch.Tensor | None = None
) -> tuple[torch.Tensor, dict]:
    if sims.ndim != 2 or sims.shape[0] != sims.shape[1]:
        raise ValueError(f"triplet loss needs a square in-batch similarity matrix, got {tuple(sims.shape)}")
    n = sims.shape[0]
    if positives is None:
        positives = torch.eye(n, dtype=torch.bool, device=sims.device)
    diag = sims.diagonal()
    cost_caption = (
        (margin + sims - diag.unsqueeze(1)).clamp_min(0).masked_fill(positives, 0)
    )  # image -> captions
    cost_image = (
        (margin + sims - diag.unsqueeze(0)).clamp_min(0).masked_fill(positives, 0)
    )  # caption -> images
    if hardest:
        loss = cost_caption.amax(1).sum() + cost_image.amax(0).sum()
    else:
        loss = cost_caption.sum() + cost_image.sum()
    return loss, {"violations": (cost_caption > 0).float().mean().detach()}


class TripletLoss(InBatchLoss):
    """VSE++ loss; `hardest` can be switched off for the warm-up epoch(s)."""

    def __init__(self, margin: float = 0.2, max_violation: bool = True, mask_same_image: bool = True) -> None:
        super().__init__()
        self.margin = margin
        self.max_violation = max_violation
        self.mask_same_image = mask_same_image

    def forward(
        self, sims: torch.Tensor, image_ids: torch.Tensor | None = None, *, warmup: bool = False, **_: object
    ):
        positives = positive_mask(image_ids if self.mask_same_image else None, sims.shape[0], sims.device)
        return triplet_loss(sims, self.margin, hardest=self.max_violation and not warmup, positives=positives)
