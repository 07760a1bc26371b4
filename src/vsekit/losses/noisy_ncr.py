"""NCR's losses (NeurIPS'21, released code at 60256ba), as pure functions of a batch similarity matrix.

A network is trained on the split made from its *peer's* clean probabilities (co-divide): the labeled batch
with co-rectified soft labels and a soft margin (`rectified_targets`, `soft_margin_loss`), the unlabeled batch
with the mean of both networks' predictions (`unlabeled_targets`); warm-up uses `warmup_loss`. Similarity
matrices are `[images, captions]` with pair i on the diagonal.
"""

from __future__ import annotations

import math

import torch

from vsekit.losses.base import InBatchLoss, StepContext, warmup_of
from vsekit.losses.noisy_split import hardest_hinge, hinge_costs, pair_losses

SOFT_MARGINS = ("linear", "exponential", "sin")  # NCR --soft_margin; the release's default: exponential


def margin_scale(labels: torch.Tensor, kind: str = "exponential") -> torch.Tensor:
    """f(y) of the soft margin M = m * f(y): linear y; exponential (10^y - 1) / 9; sin sin(pi y - pi/2)/2 + 1/2."""
    if kind == "linear":
        return labels
    if kind == "exponential":
        return (torch.pow(10, labels) - 1) / 9
    if kind == "sin":
        return torch.sin(math.pi * labels - math.pi / 2) / 2 + 0.5
    raise ValueError(f"soft margin {kind!r} is not one of {', '.join(SOFT_MARGINS)}")


def soft_margin_loss(
    sims: torch.Tensor, labels: torch.Tensor, margin: float, kind: str = "exponential"
) -> torch.Tensor:
    """Hardest-negative hinge with the margin matrix `margin * f(labels)` broadcast against `sims` (labels
    `[b, b]` or `[b, 1]`: for `[b, 1]` cost_im[i, j] uses row i's label, as released): sum of the row maxima
    of cost_s plus the column maxima of cost_im."""
    return hardest_hinge(sims, margin * margin_scale(labels, kind))


def warmup_loss(sims: torch.Tensor, margin: float) -> torch.Tensor:
    """NCR's warm-up: the sum over pairs of the per-pair loss (row means of cost_s + column means of
    cost_im), no labels."""
    return pair_losses(sims, margin).sum()


def hard_loss(sims: torch.Tensor, margin: float) -> torch.Tensor:
    """Plain VSE++ (hardest negatives, no labels), as released (`hardest_hinge`)."""
    return hardest_hinge(sims, margin)


def predict_raw(sims: torch.Tensor, margin: float) -> torch.Tensor:
    """NCR's `predict` before its last clamp: `clamp(m - mean per-pair cost / 2, 0, m)` divided by the mean of
    its `b // 10 + 1` largest values."""
    cost_s, cost_im = hinge_costs(sims, margin)
    p = (margin - (cost_s.mean(1) + cost_im.mean(0)) / 2).clamp(0, margin)
    top = p.topk(sims.shape[0] // 10 + 1)[0].mean()
    return p / top


def predict(sims: torch.Tensor, margin: float) -> torch.Tensor:
    """NCR's prediction of how well each pair of a batch matches, in [0, 1] (`predict_raw` clamped)."""
    return predict_raw(sims, margin).clamp(0, 1)


def rectified_targets(prob: torch.Tensor, labels: torch.Tensor, pred: torch.Tensor) -> torch.Tensor:
    """Co-rectified labels of the labeled batch, `prob * labels + (1 - prob) * pred`, with the release's shapes:
    prob, labels `[b, 1]` and pred `[b]` broadcast to `[b, b]` (`t[i, j] = prob_i + (1 - prob_i) * pred_j`),
    which is what NCR trains with; pass `pred.view(-1, 1)` for the per-pair `[b, 1]` the paper describes."""
    return prob * labels + (1 - prob) * pred


def unlabeled_targets(pred_a: torch.Tensor, pred_b: torch.Tensor) -> torch.Tensor:
    """Labels of the unlabeled batch: the mean of both networks' predictions, `[b, 1]`."""
    return ((pred_a + pred_b) / 2).view(-1, 1)


class NCRLoss(InBatchLoss):
    """NCR's loss as a vsekit loss (`loss.name: ncr`), as each network's step computes it: the warm-up form
    (`warmup_loss`) during the warm-up epochs, else the soft-margin hinge with the step's `targets` (the
    co-rectified labels `[b, b]` or `[b, 1]` the co-teaching trainer hands it), or plain VSE++ when a batch
    comes without targets. Captions of the same image are negatives of each other, as in the release."""

    def __init__(self, margin: float = 0.2, soft_margin: str = "exponential") -> None:
        super().__init__()
        if soft_margin not in SOFT_MARGINS:
            raise ValueError(f"soft margin {soft_margin!r} is not one of {', '.join(SOFT_MARGINS)}")
        self.margin, self.soft_margin = margin, soft_margin

    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        *,
        warmup: bool = False,
        context: StepContext | None = None,
        targets: torch.Tensor | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, dict]:
        if warmup_of(context, warmup):
            return warmup_loss(sims, self.margin), {}
        if targets is None:
            return hard_loss(sims, self.margin), {}
        return soft_margin_loss(sims, targets.to(sims.dtype), self.margin, self.soft_margin), {}
