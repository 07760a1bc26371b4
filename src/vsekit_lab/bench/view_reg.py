"""How strongly AVSE's view regulariser pulls against the ranking loss: ‖∇ w·L_reg‖ / ‖∇ L_rank‖ on the image
embedding (`vse bench view-reg`, the AVSE ablation). Analysis over `vsekit.losses`, never used in training."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from vsekit.config import LossConfig
from vsekit.data.batch import Batch
from vsekit.losses import create_loss
from vsekit.losses.view_reg import VARIANTS, view_regulariser


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
    model: nn.Module, batch: Batch, cfg: LossConfig, warmup: bool = False
) -> dict[str, float]:
    """`grad_norm_ratio` of the view regulariser (× `cfg.view_reg_weight`) against the ranking loss `cfg`
    names, on one collated training batch, w.r.t. the image embedding (the only input L_reg sees).

    The model encodes in eval mode without gradients (no BatchNorm statistics or other state change; the
    test-time views), the gradients start at the embeddings; `warmup` selects the all-negatives sum."""
    views = _num_views(model)
    if views < 2:
        raise ValueError("the view regulariser needs a multi-view image encoder (model.image.views >= 2)")
    batch = Batch.of(batch)
    was_training = model.training
    model.eval()
    dev = next(model.parameters()).device
    try:
        with torch.no_grad():
            img = model.encode_images(batch.images.to(dev), batch.image_lengths.to(dev))
            txt = model.encode_texts(batch.tokens.to(dev), batch.token_lengths)
    finally:
        model.train(was_training)
    img = img.float().detach().requires_grad_(True)
    txt = txt.float().detach().requires_grad_(True)
    base = create_loss(dataclasses.replace(cfg, view_reg_weight=0.0)).to(dev)
    rank, _ = base(
        model.similarity(img, txt),
        image_ids=batch.image_index.to(dev),
        warmup=warmup,
        image_emb=img,
        text_emb=txt,
    )
    reg = view_regulariser(img.reshape(img.shape[0], views, -1), cfg.view_reg_offdiag, cfg.view_reg_variant)
    return grad_norm_ratio(rank, cfg.view_reg_weight * reg, img)


def random_grad_ratios(
    dim: int = 1024,
    batch: int = 128,
    views: int = 2,
    block_dim: int = 512,
    readout: str = "log_plan",
    weight: float = 1.0,
    seed: int = 0,
) -> list[dict]:
    """The ratio on random unit view/caption embeddings under AEOM, for both normalisations and both hinge
    forms (hardest negative; sum over negatives = the warm-up epoch)."""
    from vsekit.config import SimilarityConfig
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
            rows.append(
                {
                    "variant": variant,
                    "hinge": "hardest" if hardest else "sum",
                    "readout": readout,
                    **grad_norm_ratio(rank, weight * reg, img),
                }
            )
    return rows


def _num_views(model: nn.Module | None) -> int:
    enc = getattr(model, "image_encoder", None)
    return int(getattr(enc, "views", 1))


def format_table(rows: list[dict]) -> str:
    """Markdown table of `random_grad_ratios` rows."""
    lines = [
        "| L_reg form | hinge | AEOM readout | ‖∇ L_rank‖ | ‖∇ w·L_reg‖ | ratio |",
        "|---|---|---|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['hinge']} | {r['readout']} | {r['rank_grad_norm']:.3g} | "
            f"{r['reg_grad_norm']:.3g} | {r['ratio']:.3g} |"
        )
    return "\n".join(lines)
