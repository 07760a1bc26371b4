"""RCL's complementary contrastive loss (TPAMI'23, released code at 1096a24), every variant of its `--loss`.

`P = exp(S / tau)`, per-row softmaxes both ways (`i2t`, `t2i`, with the release's 1e-10 in the denominator);
the loss pushes down the probability of negatives (all off-diagonal entries, or a random subset per row), so a
mismatched positive pair costs little: `ccl_loss`. RCL trains with that one term (no warm-up, no split).
"""

from __future__ import annotations

import torch

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
) -> torch.Tensor:
    """RCL's loss `c(i2t) + c(t2i)` of a square batch; c = mean over rows of the masked row sum of
    `complementary`, or for infoNCE -mean(log diag)."""
    n = sims.shape[0]
    p = torch.exp(sims / tau)
    i2t = p / (p.sum(1, keepdim=True) + EPS)
    t2i = p.t() / (p.t().sum(1, keepdim=True) + EPS)
    if method == "infoNCE":
        return -torch.log(i2t.diagonal()).mean() - torch.log(t2i.diagonal()).mean()
    mask = negative_mask(n, ratio, uniforms).to(sims.device, sims.dtype)
    return sum((complementary(x, method, q) * mask).sum(1).mean() for x in (i2t, t2i))


def max_margin_loss(sims: torch.Tensor, margin: float, max_violation: bool = True) -> torch.Tensor:
    """RCL's `--loss max-margin`: the VSE++ hinge, hardest negatives (`hardest_hinge`) or the sum of all."""
    if max_violation:
        return hardest_hinge(sims, margin)
    cost_s, cost_im = hinge_costs(sims, margin)
    return cost_s.sum() + cost_im.sum()
