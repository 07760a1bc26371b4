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
With more than two views the loss is the mean over all view pairs. `grad_norm_ratio` /
`view_reg_grad_ratio` report ‖∇ weight·L_reg‖ / ‖∇ L_rank‖ on the image embedding (the ablation script
prints it; `python -m vsekit.losses.view_reg` gives it on random embeddings).
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


def grad_norm_ratio(rank_loss: torch.Tensor, reg: torch.Tensor, wrt: torch.Tensor) -> dict[str, float]:
    """‖∂reg/∂wrt‖ and ‖∂rank_loss/∂wrt‖ (Frobenius) and reg / rank. `reg` is the *weighted* regulariser; both
    graphs are kept, so the caller can still backpropagate."""
    (g_rank,) = torch.autograd.grad(rank_loss, wrt, retain_graph=True, allow_unused=True)
    (g_reg,) = torch.autograd.grad(reg, wrt, retain_graph=True, allow_unused=True)
    n_rank = 0.0 if g_rank is None else float(g_rank.norm())
    n_reg = 0.0 if g_reg is None else float(g_reg.norm())
    return {
        "rank_grad_norm": n_rank,
        "reg_grad_norm": n_reg,
        "ratio": n_reg / n_rank if n_rank > 0 else float("inf"),
    }


def view_reg_grad_ratio(
    model: nn.Module, batch: dict, cfg: LossConfig, warmup: bool = False
) -> dict[str, float]:
    """`grad_norm_ratio` of the view regulariser (× `cfg.view_reg_weight`) against the ranking loss `cfg`
    names, on one collated training batch, w.r.t. the image embedding (the only input L_reg sees).

    The model encodes in eval mode without gradients (no BatchNorm statistics or other state change; the
    test-time views), the gradients start at the embeddings; `warmup` selects the all-negatives sum."""
    from vsekit.losses import create_loss

    views = _num_views(model)
    if views < 2:
        raise ValueError("the view regulariser needs a multi-view image encoder (model.image.views >= 2)")
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            img = model.encode_images(batch["images"].to(dev), batch["image_lengths"].to(dev))
            txt = model.encode_texts(batch["tokens"].to(dev), batch["token_lengths"])
    finally:
        model.train(was_training)
    img = img.float().detach().requires_grad_(True)
    txt = txt.float().detach().requires_grad_(True)
    base = create_loss(dataclasses.replace(cfg, view_reg_weight=0.0)).to(dev)
    ids = batch.get("image_index")
    rank, _ = base(model.similarity(img, txt), image_ids=None if ids is None else ids.to(dev), warmup=warmup,
                   image_emb=img, text_emb=txt, model=model)  # fmt: skip
    reg = view_regulariser(img.reshape(img.shape[0], views, -1), cfg.view_reg_offdiag, cfg.view_reg_variant)
    return grad_norm_ratio(rank, cfg.view_reg_weight * reg, img)


def random_grad_ratios(dim: int = 1024, batch: int = 128, views: int = 2, block_dim: int = 512,
                       readout: str = "log_plan", weight: float = 1.0, seed: int = 0) -> list[dict]:  # fmt: skip
    """The ratio on random unit view/caption embeddings under AEOM, for both normalisations and both hinge
    forms (hardest negative; sum over negatives = the warm-up epoch)."""
    from vsekit.config import SimilarityConfig
    from vsekit.losses import create_loss
    from vsekit.similarity.aeom import AEOMSimilarity

    g = torch.Generator().manual_seed(seed)
    img0 = nn.functional.normalize(torch.randn(batch, views, dim, generator=g), dim=-1).reshape(batch, -1)
    txt = nn.functional.normalize(torch.randn(batch, dim, generator=g), dim=-1)
    sim = AEOMSimilarity(dim, views, SimilarityConfig(name="aeom", block_dim=block_dim, readout=readout))
    rows = []
    for hardest in (True, False):
        for variant in VARIANTS:
            img = img0.clone().requires_grad_(True)
            rank, _ = create_loss(LossConfig(name="triplet", max_violation=hardest))(
                sim(img, txt), warmup=not hardest
            )
            reg = view_regulariser(img.reshape(batch, views, dim), variant=variant)
            rows.append({"variant": variant, "hinge": "hardest" if hardest else "sum", "readout": readout,
                         **grad_norm_ratio(rank, weight * reg, img)})  # fmt: skip
    return rows


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


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(
        description="gradient-norm ratio of the view regulariser vs the ranking loss"
    )
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--views", type=int, default=2)
    ap.add_argument("--block-dim", type=int, default=512)
    ap.add_argument("--readout", default="log_plan", choices=["log_plan", "plan", "maxsum"])
    ap.add_argument("--weight", type=float, default=1.0)
    args = ap.parse_args(argv)
    print("| L_reg form | hinge | AEOM readout | ‖∇ L_rank‖ | ‖∇ w·L_reg‖ | ratio |")
    print("|---|---|---|---:|---:|---:|")
    for r in random_grad_ratios(args.dim, args.batch, args.views, args.block_dim, args.readout, args.weight):
        print(f"| {r['variant']} | {r['hinge']} | {r['readout']} | {r['rank_grad_norm']:.3g} | "
              f"{r['reg_grad_norm']:.3g} | {r['ratio']:.3g} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
