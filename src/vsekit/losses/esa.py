"""ESA's SEL loss (the released `ContrastiveLoss` with `hardnum`): a hinge loss over groups of views.

The encoders give every sample g views (ESA: two masked image views, two augmented captions), consecutive rows
of the [g*B, g*B] matrix S. Row i's positive score is the *lowest* S over the columns of its own group (the
hardest positive), column j's the lowest over its group's rows; every pair inside a group's g x g block is a
positive, never a negative. cost_s[i, j] = max(0, margin + S[i, j] - pos_row[i]) and
cost_im[i, j] = max(0, margin + S[i, j] - pos_col[j]); with the hardest negative (after the warm-up) the loss
is the sum of the rows' maxima of cost_s plus the columns' maxima of cost_im, otherwise the plain sums.
g comes from the shapes: rows / the number of samples (len(image_ids)).
"""

from __future__ import annotations

import torch

from vsekit.losses.base import InBatchLoss, StepContext, warmup_of


def group_positives(
    groups: int, size: int, image_ids: torch.Tensor | None, device: torch.device
) -> torch.Tensor:
    """[g*B, g*B] True inside each sample's g x g block, and (with `image_ids` [B]) wherever the two rows'
    samples show the same image."""
    sample = torch.arange(groups * size, device=device) // size
    if image_ids is not None:
        sample = image_ids.to(device)[sample]
    return sample.unsqueeze(1) == sample.unsqueeze(0)


def sel_loss(
    sims: torch.Tensor,
    views: int,
    margin: float = 0.2,
    hardest: bool = True,
    image_ids: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict]:
    """The SEL loss of a [g*B, g*B] matrix whose consecutive groups of `views` rows/columns are one sample
    (module docstring); `image_ids` [B]: samples of the same image are positives too."""
    if sims.ndim != 2 or sims.shape[0] != sims.shape[1] or sims.shape[0] % views:
        raise ValueError(
            f"the SEL loss needs a square matrix of groups of {views} views, got {tuple(sims.shape)}"
        )
    n = sims.shape[0]
    block = group_positives(n // views, views, None, sims.device)
    positives = group_positives(n // views, views, image_ids, sims.device) if image_ids is not None else block
    big = torch.finfo(sims.dtype).max
    pos_row = sims.masked_fill(~block, big).amin(1)  # hardest positive of each row (its own group's columns)
    pos_col = sims.masked_fill(~block, big).amin(0)
    cost_s = (margin + sims - pos_row.unsqueeze(1)).clamp_min(0).masked_fill(positives, 0)
    cost_im = (margin + sims - pos_col.unsqueeze(0)).clamp_min(0).masked_fill(positives, 0)
    if hardest:
        cost_s_total, cost_im_total = cost_s.amax(1).sum(), cost_im.amax(0).sum()
    else:
        cost_s_total, cost_im_total = cost_s.sum(), cost_im.sum()
    return cost_s_total + cost_im_total, {"cost_s": cost_s_total.detach(), "cost_im": cost_im_total.detach()}


class SELLoss(InBatchLoss):
    """ESA's SEL loss on the views of a batch (module docstring); the warm-up sums over all negatives."""

    def __init__(
        self, margin: float = 0.2, max_violation: bool = True, mask_same_image: bool = False
    ) -> None:
        super().__init__()
        self.margin, self.max_violation, self.mask_same_image = margin, max_violation, mask_same_image

    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        *,
        warmup: bool = False,
        context: StepContext | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, dict]:
        if image_ids is None:
            raise ValueError(
                "the SEL loss needs image_ids (one per sample) to know how many views each sample has"
            )
        samples = int(image_ids.shape[0])
        if samples < 1 or sims.shape[0] % samples:
            raise ValueError(
                f"the SEL loss got {sims.shape[0]} rows for {samples} samples: the encoders must give the same "
                "number of views per sample (ESA's pooling, model.*.pooling.name=esa)"
            )
        views = sims.shape[0] // samples
        ids = image_ids if self.mask_same_image else None
        loss, diag = sel_loss(
            sims,
            views,
            self.margin,
            hardest=self.max_violation and not warmup_of(context, warmup),
            image_ids=ids,
        )
        if self.host_diag:
            diag = {k: float(v) for k, v in diag.items()}
        return loss, diag
