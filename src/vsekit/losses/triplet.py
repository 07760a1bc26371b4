"""Hinge triplet loss of VSE++ on an in-batch similarity matrix.

sims[i, j] = s(image_i, caption_j); the diagonal holds the positive pairs. With `hardest=True` only the
hardest negative of each row and column counts (VSE++), otherwise the sum over all negatives (VSE0,
the VSE∞ warm-up epoch). Losses are summed over the batch, as in the reference code. The per-pair terms
(`hinge_terms`) and their one reduction (`reduce_hinge`: per-sample weights) are separate functions, as in
pytorch-metric-learning, so a per-sample strategy weights pairs without a second copy of the loss.
"""

from __future__ import annotations

import torch

from vsekit.losses.base import InBatchLoss, StepContext, warmup_of


def positive_mask(image_ids: torch.Tensor | None, batch: int, device: torch.device) -> torch.Tensor:
    """[B, B] True where image i and caption j are a positive pair (the diagonal, plus captions of
    the same image when `image_ids` is given)."""
    eye = torch.eye(batch, dtype=torch.bool, device=device)
    if image_ids is None:
        return eye
    ids = image_ids.to(device)
    return eye | (ids.unsqueeze(1) == ids.unsqueeze(0))


def hinge_terms(
    sims: torch.Tensor, margin: float | torch.Tensor = 0.2, positives: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The per-pair hinge terms, kept apart from their reduction (`reduce_hinge`) so a caller may weight or
    select them: `cost_caption[i, j]` = [m_ij + s_ij - s_ii]+ (image i's query against caption j),
    `cost_image[i, j]` = [m_ij + s_ij - s_jj]+ (caption j's query against image i), 0 on positives.
    `margin`: a scalar, or a [B, B] tensor of per-pair margins m_ij."""
    if sims.ndim != 2 or sims.shape[0] != sims.shape[1]:
        raise ValueError(f"triplet loss needs a square in-batch similarity matrix, got {tuple(sims.shape)}")
    if torch.is_tensor(margin) and margin.ndim and margin.shape != sims.shape:
        raise ValueError(f"per-pair margins {tuple(margin.shape)} do not match sims {tuple(sims.shape)}")
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
    return cost_caption, cost_image


def reduce_hinge(
    cost_caption: torch.Tensor,
    cost_image: torch.Tensor,
    hardest: bool = True,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """The one reduction of the hinge terms: summed over the batch (the reference code), on each query's
    hardest negative (VSE++) or over all of them (VSE0). `weights` [B]: pair k's weight multiplies the terms
    where it is the query (row k of `cost_caption`, column k of `cost_image`); weight 0 removes exactly those.
    None and all ones give the same numbers bit for bit (x * 1 is exact)."""
    if hardest:
        per_image, per_caption = cost_caption.amax(1), cost_image.amax(0)
        if weights is None:
            return per_image.sum() + per_caption.sum()
        w = weights.to(per_image.dtype)
        return (per_image * w).sum() + (per_caption * w).sum()
    if weights is None:
        return cost_caption.sum() + cost_image.sum()
    w = weights.to(cost_caption.dtype)
    return (cost_caption * w.unsqueeze(1)).sum() + (cost_image * w.unsqueeze(0)).sum()


def triplet_loss(
    sims: torch.Tensor,
    margin: float | torch.Tensor = 0.2,
    hardest: bool = True,
    positives: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """VSE++'s hinge loss: `hinge_terms` reduced by `reduce_hinge`, and the share of violating pairs."""
    cost_caption, cost_image = hinge_terms(sims, margin, positives)
    loss = reduce_hinge(cost_caption, cost_image, hardest, weights)
    return loss, {"violations": (cost_caption > 0).float().mean().detach()}


class TripletLoss(InBatchLoss):
    """VSE++ loss; `hardest` can be switched off for the warm-up epoch(s)."""

    takes_weights = True

    def __init__(self, margin: float = 0.2, max_violation: bool = True, mask_same_image: bool = True) -> None:
        super().__init__()
        self.margin = margin
        self.max_violation = max_violation
        self.mask_same_image = mask_same_image

    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        *,
        warmup: bool = False,
        context: StepContext | None = None,
        weights: torch.Tensor | None = None,
        margins: torch.Tensor | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, dict]:
        """`margins` [B, B]: per-pair margins in place of the scalar `margin`; `weights` [B]: `reduce_hinge`."""
        positives = positive_mask(image_ids if self.mask_same_image else None, sims.shape[0], sims.device)
        hardest = self.max_violation and not warmup_of(context, warmup)
        margin = self.margin if margins is None else margins
        return triplet_loss(sims, margin, hardest=hardest, positives=positives, weights=weights)
