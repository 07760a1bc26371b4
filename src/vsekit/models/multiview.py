"""AVSE's multi-view image embedding (AVSE paper §3.1, §4.2).

The regions (or grid cells) of an image are sampled into `views` random groups, each holding
`view_keep_train` (75%) of the image's set in training and `view_keep_test` (90%) at test time. Every
group goes through the same encoder (one linear layer, plus the residual MLP for regions) and the same
pooling (GPO), and the view embeddings are concatenated: [B, views * embed_dim], view k at
`[:, k*embed_dim:(k+1)*embed_dim]`, each view L2-normalised on its own by the model (VSEModel).

The fractions are of the image's *full* set: the trainer does not apply VSE∞'s size augmentation (region or
grid-cell dropping) to a multi-view image — the random views are that augmentation. Dropping first and then
drawing the views (`model.image.view_size_augment: true`, vsekit's earlier behaviour) leaves each view
~0.8 × 0.75 = 60 % of the regions in training.

Test-time grouping is deterministic and depends only on (view, set size): view k of every image with n
elements keeps the same positions, drawn once from a fixed seed. Evaluation is therefore repeatable and
independent of batch size and batch composition (the released code draws fresh random groups at test
time, so its scores change between runs).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from vsekit.config import ImageEncoderConfig
from vsekit.models.image import PrecompImageEncoder, generator_device, to_device_async
from vsekit.pooling import length_mask
from vsekit.utils.runtime import derived_seed

EVAL_GROUPING_SEED = 0xA75E


def kept_count(lengths: torch.Tensor, keep: float) -> torch.Tensor:
    """Elements a view keeps from a set of `lengths`: round(keep * n), at least 1, at most n."""
    n = lengths.to(torch.long)
    if n.device.type == "mps":  # no float64 there
        return kept_count(n.cpu(), keep).to(n.device)
    return torch.round(n.to(torch.float64) * keep).to(torch.long).clamp_min(1).minimum(n.clamp_min(1))


def eval_priority_table(views: int, max_len: int) -> torch.Tensor:
    """[max_len + 1, views, max_len]: row n holds the test-grouping priorities of a set of size n (CPU).

    Row (n, k) is `max_len` draws from a generator seeded by (view k, size n) alone; size 0 gets size 0's
    draws like any other (it has no valid position to order)."""
    out = torch.empty(max_len + 1, views, max_len)
    for n in range(max_len + 1):
        for k in range(views):
            g = torch.Generator().manual_seed(derived_seed(EVAL_GROUPING_SEED, k, n))
            out[n, k] = torch.rand(max_len, generator=g)
    return out


@functools.lru_cache(maxsize=16)
def _eval_priority_table_on(views: int, max_len: int, device: torch.device) -> torch.Tensor:
    return eval_priority_table(views, max_len).to(device)


def eval_view_priorities(views: int, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, views, max_len] random priorities that depend only on (view, set size) — the test grouping.

    Gathered by length on the lengths' device from a table of every size 0..max_len (built once per
    (views, max_len, device), a few recent ones kept): no host read of the lengths."""
    table = _eval_priority_table_on(views, max_len, lengths.device)
    return table.index_select(0, lengths.detach().to(torch.long).clamp(0, max_len))


def view_groups(
    lengths: torch.Tensor,
    views: int,
    keep: float,
    max_len: int,
    generator: torch.Generator | None = None,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random groups of each set: (indices [B, views, max_len], lengths [B, views]).

    The first `lengths[b, k]` indices of row (b, k) are the positions view k of image b keeps (a sample
    without replacement of the valid positions); the rest point at dropped or padded positions.
    """
    b = len(lengths)
    lengths = lengths.detach()
    if deterministic:
        prio = eval_view_priorities(views, lengths, max_len)
    else:  # drawn on the generator's device (the trainer's: the run's device), copied without a host sync if not
        prio = to_device_async(
            torch.rand(b, views, max_len, generator=generator, device=generator_device(generator)),
            lengths.device,
        )
    valid = length_mask(lengths, max_len).unsqueeze(1)
    prio = prio.masked_fill(~valid, 2.0)  # padding sorts last
    order = prio.argsort(dim=-1, stable=True)
    counts = kept_count(lengths, keep).unsqueeze(1).expand(b, views)
    return order, counts


class MultiViewImageEncoder(nn.Module):
    """`views` random groups of the image's set -> shared encoder + pooling per group -> concatenation."""

    def __init__(
        self,
        img_dim: int,
        embed_dim: int,
        cfg: ImageEncoderConfig,
    ) -> None:
        super().__init__()
        for name in ("view_keep_train", "view_keep_test"):
            keep = getattr(cfg, name)
            if not 0.0 < keep <= 1.0:
                raise ValueError(f"model.image.{name} must be in (0, 1], got {keep}")
        if cfg.views < 1:
            raise ValueError(f"model.image.views must be >= 1, got {cfg.views}")
        self.views = cfg.views
        self.embed_dim = embed_dim
        self.keep_train, self.keep_test = cfg.view_keep_train, cfg.view_keep_test
        # the shared-weight encoder: exactly the single-view encoder, applied once per group
        self.shared = PrecompImageEncoder(img_dim, embed_dim, cfg)

    def forward(
        self, feats: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        b, n, _ = feats.shape
        keep = self.keep_train if self.training else self.keep_test
        lengths = lengths.to(feats.device, non_blocking=True)
        order, counts = view_groups(lengths, self.views, keep, n, generator, deterministic=not self.training)
        # the shared encoder maps each element on its own, so it runs once per element; each view then
        # gathers its embedded elements, packed to the front: [B*views, n, embed_dim]
        x = self.shared.embed_set(feats, lengths)
        idx = order.reshape(b, self.views * n, 1).expand(-1, -1, x.shape[-1])
        grouped = torch.gather(x, 1, idx).reshape(b * self.views, n, x.shape[-1])
        flat_counts = counts.reshape(-1)
        # the full width n (a fixed shape; the pooling gives the masked padding no weight)
        grouped = grouped.masked_fill(~length_mask(flat_counts, grouped.shape[1]).unsqueeze(-1), 0.0)
        x = self.shared.pool(grouped, flat_counts)  # [B*views, embed_dim]
        return x.reshape(b, self.views * self.embed_dim)

    def split_views(self, emb: torch.Tensor) -> torch.Tensor:
        """[B, views*embed_dim] -> [B, views, embed_dim]."""
        return emb.reshape(emb.shape[0], self.views, self.embed_dim)
