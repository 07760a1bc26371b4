"""RCL's complementary contrastive loss (TPAMI'23, released code at 1096a24), every variant of its `--loss`.

`P = exp(S / tau)`, per-row softmaxes both ways (`i2t`, `t2i`, with the release's 1e-10 in the denominator);
the loss pushes down the probability of negatives (all off-diagonal entries, or a random subset per row), so a
mismatched positive pair costs little: `ccl_loss`. RCL trains with that one term (no warm-up, no split).
"""

from __future__ import annotations

import torch

from vsekit.losses.base import InBatchLoss
from vsekit.losses.noisy_split import hardest_hinge, hinge_costs

CCL_METHODS = ("log", "tan", "abs", "exp", "gce", "infoNCE")
EPS = 1e-10


def complementary(x: torch.Tensor, method: str, q: float) -> torch.Tensor:
    """Per-entry cost of a negative's probability x: log -log(1 - x), tan tan(x), abs x, exp exp(x - 1),
    gce (1 - (1 - x)^q) / q (with the release's 1e-10 inside)."""
    if method == "log":
        return -torch.log(1 - x + EPS)
    if method == "tan":
        return torch.tan(x)
    if method == "abs":
        return x
    if method == "exp":
        return torch.exp(-(1 - x))
    if method == "gce":
        return (1 - (1 - x + EPS) ** q) / q
    raise ValueError(f"CCL method {method!r} is not one of {', '.join(CCL_METHODS)}")


def negative_mask(n: int, ratio: float, uniforms: torch.Tensor | None = None) -> torch.Tensor:
    """Which negatives count (float 0/1, `[n, n]`): every off-diagonal entry when `ratio` is not in (0, 1),
    else per row the `int(ratio * n)` entries with the largest `uniforms` (drawn here when not given), the
    diagonal excluded; the same mask serves both directions."""
    off = 1 - torch.eye(n)
    if not 0 < ratio < 1:
        return off
    if uniforms is None:
        uniforms = torch.rand(n, n)
    keep = int(ratio * n)
    scores = uniforms.masked_fill(torch.eye(n, dtype=torch.bool), -1.0)
    mask = torch.zeros(n, n)
    return mask.scatter(1, scores.topk(keep, dim=1)[1], 1.0)


def ccl_loss(
    sims: torch.Tensor,
    tau: float,
    method: str = "log",
    q: float = 0.5,
    ratio: float = 0.0,
    uniforms: torch.Tensor | None = None,
    not_negative: torch.Tensor | None = None,
) -> torch.Tensor:
    """RCL's loss `c(i2t) + c(t2i)` of a square batch; c = mean over rows of the masked row sum of
    `complementary`, or for infoNCE -mean(log diag). `not_negative` (bool `[n, n]`, optional): entries also
    left out of the mask (other captions of the same image); the release has none."""
    n = sims.shape[0]
    p = torch.exp(sims / tau)
    i2t = p / (p.sum(1, keepdim=True) + EPS)
    t2i = p.t() / (p.t().sum(1, keepdim=True) + EPS)
    if method == "infoNCE":
        return -torch.log(i2t.diagonal()).mean() - torch.log(t2i.diagonal()).mean()
    mask = negative_mask(n, ratio, None if uniforms is None else uniforms.cpu()).to(sims.device, sims.dtype)
    if not_negative is not None:
        mask = mask.masked_fill(not_negative, 0.0)
    return sum((complementary(x, method, q) * mask).sum(1).mean() for x in (i2t, t2i))


def max_margin_loss(sims: torch.Tensor, margin: float, max_violation: bool = True) -> torch.Tensor:
    """RCL's `--loss max-margin`: the VSE++ hinge, hardest negatives (`hardest_hinge`) or the sum of all."""
    if max_violation:
        return hardest_hinge(sims, margin)
    cost_s, cost_im = hinge_costs(sims, margin)
    return cost_s.sum() + cost_im.sum()


class RCLLoss(InBatchLoss):
    """RCL's training loss as a vsekit loss (`loss.name: rcl`): `ccl_loss` of the batch, one term, no warm-up.

    `mask_same_image`: other captions of a caption's image are left out of the negatives (the release keeps
    them: false there). A subset `ratio` in (0, 1) draws its uniforms from the step's generator, so a resumed
    run draws the same negatives."""

    needs_generator = True

    def __init__(
        self,
        tau: float,
        method: str = "log",
        q: float = 0.2,
        ratio: float = -1.0,
        mask_same_image: bool = False,
    ) -> None:
        super().__init__()
        if method not in CCL_METHODS:
            raise ValueError(f"CCL method {method!r} is not one of {', '.join(CCL_METHODS)}")
        self.tau, self.method, self.q, self.ratio = tau, method, q, ratio
        self.mask_same_image = mask_same_image

    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        *,
        generator: torch.Generator | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, dict]:
        n = sims.shape[0]
        uniforms = None
        if 0 < self.ratio < 1:
            where = generator.device if generator is not None else sims.device
            uniforms = torch.rand(n, n, generator=generator, device=where)
        same = None
        if self.mask_same_image and image_ids is not None:
            same = (image_ids.view(-1, 1) == image_ids.view(1, -1)).to(sims.device)
        loss = ccl_loss(sims, self.tau, self.method, self.q, self.ratio, uniforms, same)
        return loss, {}
