"""AVSE's dimension-wise regulariser between image views (AVSE paper §3.3, Eq. 3–4).

For two views A, B of a batch ([B, d] each), C_ij = Σ_b A_bi B_bj / (‖A_:i‖ ‖B_:j‖) — the cosine, over
the batch, of dimension i of view A and dimension j of view B — and
L_reg = Σ_i (1 − C_ii)² + λ₁ Σ_i Σ_{j≠i} C_ij² (λ₁ = 0.0051). It asks every dimension to mean the same
thing in every view (so AEOM can match a caption block to any view's block) without the dimensions
being redundant.

Variants (`variant`):
- "paper" (default): Eq. 3 as written. C_ii = 1 exactly when dimension i of both views is the same
  batch vector up to a positive scale, so the diagonal term can reach 0.
- "reference": the released code's normalisation, c = Â_ᵀ B̂ / B with batch-normalised columns. The
  extra 1/B bounds |c_ij| ≤ 1/B, so (c_ii − 1)² ≥ (1 − 1/B)² and the diagonal term can never approach
  0 — kept only to reproduce that code.
With more than two views the loss is the mean over all view pairs.
"""

from __future__ import annotations

import dataclasses
from itertools import combinations

import torch
from torch import nn

from vsekit.config import LossConfig

VARIANTS = ("paper", "reference")


def cross_correlation(
    a: torch.Tensor, b: torch.Tensor, variant: str = "paper", eps: float = 1e-8
) -> torch.Tensor:
    """[d, d] cross-correlation of two views [B, d] along the batch (Eq. 3)."""
    if a.shape != b.shape or a.ndim != 2:
        raise ValueError(f"views must both be [batch, dim], got {tuple(a.shape)} and {tuple(b.shape)}")
    a_n = a / a.norm(dim=0, keepdim=True).clamp_min(eps)
    b_n = b / b.norm(dim=0, keepdim=True).clamp_min(eps)
    c = a_n.t() @ b_n
    if variant == "reference":
        c = c / a.shape[0]
    elif variant != "paper":
        raise ValueError(f"unknown view regulariser variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return c


def view_regulariser(views: torch.Tensor, offdiag: float = 0.0051, variant: str = "paper") -> torch.Tensor:
    """Eq. 4 on view embeddings [B, V, d], averaged over the V·(V−1)/2 view pairs (0 for one view)."""
    if views.ndim != 3:
        raise ValueError(f"expected view embeddings [batch, views, dim], got {tuple(views.shape)}")
    pairs = list(combinations(range(views.shape[1]), 2))
    if not pairs:
        return views.new_zeros(())
    total = views.new_zeros(())
    for k, m in pairs:
        c = cross_correlation(views[:, k].float(), views[:, m].float(), variant)
        diag = c.diagonal()
        on = (1.0 - diag).pow(2).sum()
        off = c.pow(2).sum() - diag.pow(2).sum()
        total = total + on + offdiag * off
    return total / len(pairs)


class ViewRegularisedLoss(nn.Module):
    """Any similarity loss + `weight` × the view regulariser on the image embedding's views (Eq. 6)."""

    def __init__(
        self, base: nn.Module, weight: float, offdiag: float = 0.0051, variant: str = "paper"
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(
                f"unknown view regulariser variant {variant!r}; choose one of {', '.join(VARIANTS)}"
            )
        self.base, self.weight, self.offdiag, self.variant = base, weight, offdiag, variant

    @property
    def step_log_keys(self) -> tuple[str, ...]:
        return tuple(getattr(self.base, "step_log_keys", ()))

    def prepare(self, data_dir, train_split, log=print) -> None:
        if hasattr(self.base, "prepare"):
            self.base.prepare(data_dir, train_split, log)

    def forward(self, sims: torch.Tensor, *args, image_emb: torch.Tensor | None = None, model: nn.Module | None = None,
                **kwargs):  # fmt: skip
        loss, diag = self.base(sims, *args, image_emb=image_emb, model=model, **kwargs)
        views = _num_views(model)
        if image_emb is None or views < 2:
            raise ValueError("the view regulariser (loss.view_reg_weight > 0) needs a multi-view image encoder "
                             "(model.image.views >= 2) and the image embeddings")  # fmt: skip
        reg = view_regulariser(image_emb.reshape(image_emb.shape[0], views, -1), self.offdiag, self.variant)
        return loss + self.weight * reg, {**diag, "view_reg": reg.detach()}


def _num_views(model: nn.Module | None) -> int:
    enc = getattr(model, "image_encoder", None)
    return int(getattr(enc, "views", 1))


def create_view_reg_loss(cfg: LossConfig) -> nn.Module:
    """Wrap the loss `cfg` names (built with the regulariser off) with the regulariser."""
    from vsekit.losses import create_loss

    base = create_loss(dataclasses.replace(cfg, view_reg_weight=0.0))
    return ViewRegularisedLoss(
        base, cfg.view_reg_weight, cfg.view_reg_offdiag, getattr(cfg, "view_reg_variant", "paper")
    )
