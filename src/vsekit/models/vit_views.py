"""AVSE's image side on raw pixels: ViT patch tokens -> multi-view token sampling -> fc -> GPO (AVSE §3.1).

Why a module of its own: the released AVSE model (liuyyy111/AVSE, `VisionTransEncoder`) does not run
the Hugging Face ViT end to end. It takes the ViT *embeddings* (patch conv + CLS + position table,
bicubically resized to the actual patch grid), cuts each image into `views` token subsets — a random
centre patch per image and view, the patches nearest to it kept (top-k of `exp(-alpha * distance)`),
CLS always kept — and runs the ViT layers on every subset separately, with **no final layernorm and no
pooler**. Each view then goes through the same `fc` (hidden -> E) and GPO pooling (the model adds the L2
norm of each view, `VSEModel`), and the view embeddings are concatenated: `[B, views * E]`, view k at `[:, k*E:(k+1)*E]`.

Token count per view (released rule): `n = int(keep * (1 + num_patches))` patches plus CLS, with keep
0.8 in training and 0.9 at test in the released code (the paper says 75 % / 90 %).

Reproducibility: the released code re-draws the view centres on every call, in eval mode too, so its
test embeddings change from run to run. Here `view_indices` replays a recorded sampling exactly; without
it, eval mode draws the centres from a generator seeded with a fixed seed on every call (same batch ->
same views), and training draws from `generator` (or torch's global generator).

Checkpoint import: the released keys are mapped to this module's by `vsekit.interop.avse` (with every
other importer's mappings in `vsekit.interop`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from vsekit.config import PoolingConfig
from vsekit.models.image import grid_size_augment, xavier_linear
from vsekit.pooling import GPO, create_pooling
from vsekit.utils.runtime import derived_seed

EVAL_VIEW_SEED = 0xA75E_0417
# ViTConfig fields the released model's config dict may carry that are not model hyper-parameters
_CONFIG_SKIP = {
    "transformers_version",
    "_attn_implementation",
    "attn_implementation",
    "architectures",
    "model_type",
}


def build_vit_config(vit_config: Mapping[str, Any], attn_implementation: str | None = None) -> Any:
    """A transformers `ViTConfig` from a plain dict (e.g. `meta.json/vit_config` or a hub config.json)."""
    from transformers import ViTConfig

    kwargs = {k: v for k, v in vit_config.items() if k not in _CONFIG_SKIP}
    attn = (
        attn_implementation or vit_config.get("attn_implementation") or vit_config.get("_attn_implementation")
    )
    if attn:
        kwargs["attn_implementation"] = attn
    return ViTConfig(**kwargs)


def kept_patches(num_patches: int, keep: float) -> int:
    """Patches a view keeps (CLS not counted): the released `int(keep * (1 + num_patches))`, within [1, N]."""
    return max(1, min(num_patches, int((1 + num_patches) * keep)))


def nearest_patches(centres: torch.Tensor, grid: tuple[int, int], n_keep: int) -> torch.Tensor:
    """[..., n_keep] patch indices nearest to each centre patch index on a (rows, cols) grid.

    The released top-k of `exp(-alpha * distance)` keeps, for any alpha > 0, the nearest patches; ranking
    by the integer squared distance gives the same set without the weight underflowing to 0 on large
    grids. Ties break towards the lower patch index (the released top-k breaks them arbitrarily, so only
    which of several equidistant patches at the boundary is kept can differ).
    """
    rows, cols = grid
    n = rows * cols
    centres = centres.to("cpu", torch.long)
    ys, xs = torch.arange(n) // cols, torch.arange(n) % cols
    d2 = (ys[centres].unsqueeze(-1) - ys) ** 2 + (xs[centres].unsqueeze(-1) - xs) ** 2  # [..., N]
    return torch.sort(d2, dim=-1, stable=True).indices[..., :n_keep]


def radial_view_indices(
    grid: tuple[int, int],
    batch: int,
    views: int,
    n_keep: int,
    generator: torch.Generator | None = None,
    device: torch.device | str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Released-style views: (centres [B, V], patch indices [B, V, n_keep]); centres uniform per image and view."""
    gen_device = generator.device if generator is not None else "cpu"
    centres = torch.randint(
        0, grid[0] * grid[1], (batch, views), generator=generator, device=gen_device
    ).cpu()
    return centres.to(device), nearest_patches(centres, grid, n_keep).to(device)


@dataclass
class MultiViewOutput:
    """Everything the forward pass computes, for parity checks and inspection (views first: [V, B, ...])."""

    emb: torch.Tensor  # [B, V*E], each view's pooled vector (the model L2-normalises it: VSEModel)
    embeddings: torch.Tensor  # [B, 1+N, H] ViT embeddings (CLS first)
    view_indices: torch.Tensor  # [B, V, n] patch indices (CLS excluded)
    view_tokens: torch.Tensor  # [V, B, 1+n, H] ViT layer output per view
    local: torch.Tensor  # [V, B, T, E] fc output fed to pooling (after size augmentation in training)
    lengths: torch.Tensor  # [V, B] pooled set sizes
    pooled: torch.Tensor  # [V, B, E] before normalisation
    weights: torch.Tensor | None  # [V, B, T] GPO weights (None for other poolings)


class ViTMultiViewImageEncoder(nn.Module):
    """ViT patch tokens -> `views` radial token subsets -> ViT layers -> fc -> pooling -> concat (the model
    L2-normalises each view)."""

    def __init__(
        self,
        vit_config: Mapping[str, Any],
        embed_dim: int,
        views: int = 2,
        keep_train: float = 0.8,
        keep_test: float = 0.9,
        pooling: PoolingConfig | None = None,
        size_augment: bool = True,
        grid_drop_max: float = 0.2,
        attn_implementation: str | None = None,
        eval_seed: int = EVAL_VIEW_SEED,
    ) -> None:
        super().__init__()
        from transformers import ViTModel

        for name, keep in (("keep_train", keep_train), ("keep_test", keep_test)):
            if not 0.0 < keep <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {keep}")
        if views < 1:
            raise ValueError(f"views must be >= 1, got {views}")
        # the full body (final layernorm and pooler included) so the released checkpoint loads strictly;
        # only its embeddings' parameters and its layers are used in forward
        self.vit = ViTModel(build_vit_config(vit_config, attn_implementation), add_pooling_layer=True)
        hidden = self.vit.config.hidden_size
        self.hidden_size = hidden
        self.patch_size = _pair(self.vit.config.patch_size)
        self.embed_dim = embed_dim
        self.views = views
        self.keep_train, self.keep_test = keep_train, keep_test
        self.fc = xavier_linear(hidden, embed_dim)
        self.pool = create_pooling(pooling or PoolingConfig(name="gpo"), embed_dim)
        self.size_augment = size_augment
        self.grid_drop_max = grid_drop_max
        self.eval_seed = eval_seed

    # ---- pieces -------------------------------------------------------------------------------------
    def vit_layers(self) -> nn.ModuleList:
        """The transformer blocks: `layers` (transformers >= 5) or `encoder.layer` (4.x)."""
        layers = getattr(self.vit, "layers", None)
        if layers is None:
            layers = self.vit.encoder.layer
        return layers

    def position_table(self, grid: tuple[int, int]) -> torch.Tensor:
        """[1, 1+rows*cols, H]: CLS entry kept, the patch part resized bicubically (align_corners=False)."""
        table = self.vit.embeddings.position_embeddings
        cls_pos, patch_pos = table[:, :1], table[:, 1:]
        side = math.isqrt(patch_pos.shape[1])
        if side * side != patch_pos.shape[1]:
            raise ValueError(f"position table of {patch_pos.shape[1]} patches is not a square grid")
        if (side, side) == tuple(grid):
            return table
        img = patch_pos.reshape(1, side, side, -1).permute(0, 3, 1, 2)
        img = nn.functional.interpolate(img, size=tuple(grid), mode="bicubic", align_corners=False)
        return torch.cat([cls_pos, img.permute(0, 2, 3, 1).reshape(1, grid[0] * grid[1], -1)], dim=1)

    def embed_pixels(self, pixels: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """ViT embeddings [B, 1+N, H] (patch conv, row-major, CLS first, position table) and the grid."""
        emb = self.vit.embeddings
        proj = emb.patch_embeddings.projection
        x = proj(pixels.to(proj.weight.dtype))  # [B, H, rows, cols]
        grid = (x.shape[-2], x.shape[-1])
        x = x.flatten(2).transpose(1, 2)
        x = torch.cat([emb.cls_token.expand(x.shape[0], -1, -1).to(x.dtype), x], dim=1)
        x = x + self.position_table(grid).to(x.dtype)
        return emb.dropout(x), grid

    def run_layers(self, tokens: torch.Tensor) -> torch.Tensor:
        """The ViT blocks only (no final layernorm, no pooler), full attention (no mask)."""
        x = tokens
        for layer in self.vit_layers():
            out = layer(x)
            x = out[0] if isinstance(out, tuple) else out
        return x

    def sample_views(
        self,
        batch: int,
        grid: tuple[int, int],
        device: torch.device,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """[B, V, n] patch indices: `generator` when given; eval mode otherwise a fixed-seed generator."""
        n_keep = kept_patches(grid[0] * grid[1], self.keep_train if self.training else self.keep_test)
        if generator is None and not self.training:
            generator = torch.Generator().manual_seed(derived_seed(self.eval_seed, grid[0], grid[1]))
        return radial_view_indices(grid, batch, self.views, n_keep, generator, device)[1]

    # ---- forward ------------------------------------------------------------------------------------
    def encode(
        self,
        pixels: torch.Tensor,
        generator: torch.Generator | None = None,
        view_indices: torch.Tensor | None = None,
    ) -> MultiViewOutput:
        """The full pass with its intermediates (see `MultiViewOutput`)."""
        x, grid = self.embed_pixels(pixels)  # [B, 1+N, H]
        b, _, h = x.shape
        if view_indices is None:
            view_indices = self.sample_views(b, grid, x.device, generator)
        view_indices = view_indices.to(x.device, torch.long)
        if view_indices.dim() != 3 or view_indices.shape[:2] != (b, self.views):
            raise ValueError(
                f"view_indices must be [B={b}, V={self.views}, n], got {tuple(view_indices.shape)}"
            )
        n = view_indices.shape[-1]
        # [B, V, n, H] gathered patches, CLS prepended, all views batched through the blocks at once
        patches = x[:, 1:].unsqueeze(1).expand(-1, self.views, -1, -1)
        picked = torch.gather(patches, 2, view_indices.unsqueeze(-1).expand(-1, -1, -1, h))
        cls = x[:, :1].unsqueeze(1).expand(-1, self.views, -1, -1)
        tokens = torch.cat([cls, picked], dim=2).transpose(0, 1).reshape(self.views * b, n + 1, h)
        out = self.run_layers(tokens)  # [V*B, 1+n, H]
        lengths = torch.full((self.views * b,), n + 1, dtype=torch.long, device=x.device)
        feats = out
        if self.training and self.size_augment:
            # released: in training each view's set randomly loses tokens (CLS included) before fc/GPO
            feats, lengths = grid_size_augment(feats, lengths, generator, self.grid_drop_max)
        local = self.fc(feats)
        if isinstance(self.pool, GPO):
            pooled, weights = self.pool(local, lengths, return_weights=True)
        else:
            pooled, weights = self.pool(local, lengths), None
        emb = (
            pooled.reshape(self.views, b, self.embed_dim)
            .transpose(0, 1)
            .reshape(b, self.views * self.embed_dim)
        )
        v = self.views
        return MultiViewOutput(
            emb=emb,
            embeddings=x,
            view_indices=view_indices,
            view_tokens=out.reshape(v, b, n + 1, h),
            local=local.reshape(v, b, *local.shape[1:]),
            lengths=lengths.reshape(v, b),
            pooled=pooled.reshape(v, b, -1),
            weights=None if weights is None else weights.reshape(v, b, -1),
        )

    def forward(
        self,
        pixels: torch.Tensor,
        lengths: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
        view_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """[B, 3, H, W] pixels -> [B, views * E]. `lengths` is ignored (the patch grid is the set)."""
        del lengths
        return self.encode(pixels, generator, view_indices).emb

    def split_views(self, emb: torch.Tensor) -> torch.Tensor:
        """[B, views*E] -> [B, views, E]."""
        return emb.reshape(emb.shape[0], self.views, self.embed_dim)


def _pair(v: Any) -> tuple[int, int]:
    return (int(v[0]), int(v[1])) if isinstance(v, (tuple, list)) else (int(v), int(v))
