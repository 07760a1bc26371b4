"""AVSE's dimension-wise regulariser between image views (AVSE paper §3.3, Eq. 3–4).

For two views A, B of a batch ([B, d] each), C_ij = Σ_b A_bi B_bj / (‖A_:i‖ ‖B_:j‖) — the cosine, over
the batch, of dimension i of view A and dimension j of view B — and
L_reg = Σ_i (1 − C_ii)² + λ₁ Σ_i Σ_{j≠i} C_ij² (λ₁ = 0.0051). It asks every dimension to mean the same
thing in every view (so AEOM can match a caption block to any view's block) without the dimensions
being redundant.

Variants (`variant`; the recipes' default is `loss.view_reg_variant: reference`):
- "paper": Eq. 3 as written. C_ii = 1 exactly when dimension i of both views is the same batch vector up
  to a positive scale, so the diagonal term can reach 0. Its gradient is ~B times the reference one: at
  d = 1024, B = 128 and weight 1 (Eq. 6) it is 5.5x the hardest-negative ranking loss's gradient on the
  image embedding under AEOM's log-plan readout (40x under the plan readout), so L_reg dominates training.
- "reference": the released code's normalisation, c = Â_ᵀ B̂ / B with batch-normalised columns. The
  extra 1/B bounds |c_ij| ≤ 1/B, so (c_ii − 1)² ≥ (1 − 1/B)² and the diagonal term never approaches 0;
  it acts as a push of every c_ii upwards with a gradient ~1/B of the paper form's (0.04x the ranking
  loss's in the same setting), so weight 1 leaves the ranking loss in charge — the form behind the
  released code's results.
With more than two views the loss is the mean over all view pairs. `vsekit_lab.bench.view_reg`'s
`grad_norm_ratio` / `view_reg_grad_ratio` report ‖∇ weight·L_reg‖ / ‖∇ L_rank‖ on the image embedding (the ablation script
prints it; `vse bench view-reg` gives it on random embeddings).
"""

from __future__ import annotations

from itertools import combinations

import torch

from vsekit.losses.base import InBatchLoss

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


class ViewRegularisedLoss(InBatchLoss):
    """Any similarity loss + `weight` × the view regulariser on the image embedding's views (Eq. 6)."""

    def __init__(
        self,
        base: InBatchLoss,
        weight: float,
        offdiag: float = 0.0051,
        variant: str = "paper",
        views: int = 1,
    ) -> None:
        super().__init__()
        if variant not in VARIANTS:
            raise ValueError(
                f"unknown view regulariser variant {variant!r}; choose one of {', '.join(VARIANTS)}"
            )
        self.base, self.weight, self.offdiag, self.variant = base, weight, offdiag, variant
        self.views = int(views)  # the image encoder's views (recipe: model.image.views)

    # the hooks of `InBatchLoss` are the base loss's (its defaults here would hide them)
    @property
    def step_log_keys(self) -> tuple[str, ...]:
        return tuple(self.base.step_log_keys)

    @property
    def host_diag(self) -> bool:
        return self.base.host_diag

    @host_diag.setter
    def host_diag(self, value: bool) -> None:
        self.base.host_diag = value

    @property
    def needs_caption_embeddings(self) -> bool:
        return self.base.needs_caption_embeddings

    @property
    def takes_weights(self) -> bool:
        """The base loss's: its terms take the per-sample weights (the regulariser is a statistic of the whole
        batch's views, not a sum of per-pair terms, so it is not weighted)."""
        return self.base.takes_weights

    def set_caption_embeddings(self, emb: torch.Tensor) -> None:
        self.base.set_caption_embeddings(emb)

    @property
    def threshold_share(self) -> float | None:
        return self.base.threshold_share

    @property
    def derived_thresholds(self) -> list[float] | None:
        return self.base.derived_thresholds

    def set_derived_threshold(self, theta: float) -> None:
        self.base.set_derived_threshold(theta)

    def __getattr__(self, name: str):
        """The base loss's own interface (a ladder's caption embeddings and thresholds) through the wrapper."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("base"), name)

    def forward(self, sims: torch.Tensor, *args, image_emb: torch.Tensor | None = None, **kwargs):
        loss, diag = self.base(sims, *args, image_emb=image_emb, **kwargs)
        views = self.views
        if image_emb is None or views < 2:
            raise ValueError(
                "the view regulariser (loss.view_reg_weight > 0) needs a multi-view image encoder "
                "(model.image.views >= 2) and the image embeddings"
            )
        reg = view_regulariser(image_emb.reshape(image_emb.shape[0], views, -1), self.offdiag, self.variant)
        return loss + self.weight * reg, {**diag, "view_reg": reg.detach()}
