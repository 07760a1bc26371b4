"""Image encoders: a set of vectors in, one embedding (or several views) out.

- `PrecompImageEncoder`: precomputed region/grid features. Regions: linear + 2-layer residual MLP (VSE∞
  `EncoderImageAggr` 'basic'); grid: one linear layer (VSE∞ supp.). Unlike the reference, the MLP's
  BatchNorm sees only real rows, never the zero padding.
- `BackboneImageEncoder`: a CNN on pixels (EfficientNet-Lite0 by default) whose grid cells are the set,
  with VSE∞'s grid size augmentation and staged unfreezing.
"""

from __future__ import annotations

import torch
from torch import nn

from vsekit.config import ImageEncoderConfig
from vsekit.models.norm import MaskedBatchNorm1d
from vsekit.pooling import AvgPool, create_pooling, length_mask
from vsekit.utils.dropout import seeded_dropout


class ResidualMLP(nn.Module):
    """Linear -> BatchNorm -> ReLU -> Linear whose output and BatchNorm statistics come from the valid rows only.

    It runs on the whole padded set (fixed shapes, no boolean indexing, no host sync) with a masked BatchNorm
    (`MaskedBatchNorm1d`: the statistics `nn.BatchNorm1d` would compute on `x[mask]`), and padded rows come
    out as zeros: the same outputs, gradients and running statistics as running it on `x[mask]`.
    """

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.bn = MaskedBatchNorm1d(d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: torch.Tensor, mask: torch.Tensor, keep_padding: bool = False) -> torch.Tensor:
        """`keep_padding`: padded rows keep what the MLP computes for them (normalised with the valid rows'
        statistics), as the released code's do, instead of 0."""
        out = self.fc2(torch.relu(self.bn(self.fc1(x), mask)))
        if keep_padding:
            return out
        # masked_fill (not a product): a padded row is 0 even when its content was inf/NaN
        return out.masked_fill(~mask.unsqueeze(-1), 0.0)


def xavier_linear(d_in: int, d_out: int) -> nn.Linear:
    layer = nn.Linear(d_in, d_out)
    nn.init.xavier_uniform_(layer.weight)
    nn.init.zeros_(layer.bias)
    return layer


def grid_size_augment(
    feats: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None, drop_max: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor]:
    """VSE∞ grid augmentation, vectorised: 80% of images drop each cell with prob drop_max*U(0.2,1).

    Returns (features [b, n, D] with each set's kept cells packed to the front and zeros after, lengths [b]).
    The width stays n whatever was dropped (fixed shapes, no host sync); the random numbers are drawn from
    `generator` on its device (the trainer's is on the run's device: no copy; a CPU generator's draws, or the
    global CPU generator's, are copied to the device asynchronously).
    """
    b, n, _ = feats.shape
    dev = feats.device
    # the same draws as always (uniform [b, 1] then [b, n]): a CPU generator gives the numbers it always gave
    gen_dev = generator_device(generator)
    r = to_device_async(torch.rand(b, 1, generator=generator, device=gen_dev), dev)
    cell = to_device_async(torch.rand(b, n, generator=generator, device=gen_dev), dev)
    keep = (r <= 0.2) | (cell >= drop_max * r)
    keep = keep & length_mask(lengths.to(dev, non_blocking=True), n)
    # a set that lost every cell keeps its first one (a tensor op, no host read of the counts)
    first = torch.arange(n, device=dev) == 0
    keep = keep | (first & ~keep.any(1, keepdim=True))
    # pack kept cells to the front with a stable sort on the keep flag
    order = torch.sort((~keep).to(torch.int8), dim=1, stable=True).indices
    packed = torch.gather(feats, 1, order.unsqueeze(-1).expand_as(feats))
    new_len = keep.sum(1)
    packed = packed.masked_fill(~length_mask(new_len, n).unsqueeze(-1), 0.0)
    # the full width n, not the longest kept set: a fixed shape (poolings ignore the zero padding)
    return packed, new_len


def generator_device(generator: torch.Generator | None) -> torch.device:
    """Where `generator` draws (the CPU for torch's global generator, None)."""
    return generator.device if generator is not None else torch.device("cpu")


def to_device_async(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A CPU tensor on `device` without a host sync: a CUDA copy goes from pinned memory, asynchronously."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


class PrecompImageEncoder(nn.Module):
    def __init__(
        self,
        img_dim: int,
        embed_dim: int,
        cfg: ImageEncoderConfig,
    ) -> None:
        super().__init__()
        self.feature_type = cfg.feature_type
        self.fc = xavier_linear(img_dim, embed_dim)
        self.mlp = ResidualMLP(img_dim, cfg.mlp_hidden, embed_dim) if cfg.feature_type == "region" else None
        self.mlp_on_padding = cfg.mlp_on_padding
        self.pool = create_pooling(cfg.pooling, embed_dim)
        self.input_dropout = float(getattr(cfg, "input_dropout", 0.0))

    def embed_set(self, feats: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = length_mask(lengths.to(feats.device, non_blocking=True), feats.shape[1])
        x = self.fc(feats)
        if self.mlp is not None:
            x = x + self.mlp(feats, mask, self.mlp_on_padding)
        return x

    def forward(
        self, feats: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        lengths = lengths.to(feats.device, non_blocking=True)  # free when already there (the trainer's case)
        feats = seeded_dropout(feats, self.input_dropout, self.training, generator)
        if self.mlp is None and isinstance(self.pool, AvgPool):
            # mean(W x_i + b) = W mean(x_i) + b: pooling first runs the linear layer on one row per image,
            # not on all N (grid VSE++: ~20x less image-side work, the same embedding up to float rounding)
            x = self.fc(self.pool(feats, lengths))
        else:
            x = self.pool(self.embed_set(feats, lengths), lengths)
        return x


class BackboneImageEncoder(nn.Module):
    """CNN grid features -> linear -> pooling, trainable end to end."""

    def __init__(
        self,
        embed_dim: int,
        cfg: ImageEncoderConfig,
        grid_drop_max: float = 0.2,
        size_augment: bool = True,
    ) -> None:
        super().__init__()
        from vsekit.features.backbones import build_backbone

        self.cnn = build_backbone(cfg.backbone, cfg.backbone_weights or None)
        self.cnn_dim = self.cnn.out_dim
        self.fc = xavier_linear(self.cnn_dim, embed_dim)
        self.pool = create_pooling(cfg.pooling, embed_dim)
        self.grid_drop_max = grid_drop_max
        self.size_augment = size_augment
        self.trainable_blocks = cfg.backbone_trainable_blocks
        self.set_backbone_trainable(False)

    def backbone_parameters(self) -> list[nn.Parameter]:
        return list(self.cnn.parameters())

    def set_backbone_trainable(self, trainable: bool) -> None:
        """Freeze all, or unfreeze the last `trainable_blocks` stages (all when < 0); BatchNorm stays frozen."""
        for p in self.cnn.parameters():
            p.requires_grad = False
        if not trainable:
            return
        stages = self.cnn.stages
        chosen = (
            stages if self.trainable_blocks < 0 else stages[max(0, len(stages) - self.trainable_blocks) :]
        )
        for m in chosen:
            for p in m.parameters():
                p.requires_grad = True

    def train(self, mode: bool = True):
        super().train(mode)
        for m in self.cnn.modules():  # frozen BN statistics, as VSE∞ does for its backbones
            if isinstance(m, nn.BatchNorm2d):
                m.eval()
        return self

    def forward(
        self,
        pixels: torch.Tensor,
        lengths: torch.Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        grid = self.cnn(pixels)  # [B, C, H, W]
        feats = grid.flatten(2).transpose(1, 2)
        lengths = torch.full((feats.shape[0],), feats.shape[1], dtype=torch.long, device=feats.device)
        if self.training and self.size_augment:
            feats, lengths = grid_size_augment(feats, lengths, generator, self.grid_drop_max)
        return self.pool(self.fc(feats), lengths)
