"""Data-parallel training over torch.distributed, launched with `torchrun --nproc_per_node N vse train …`.

VSE losses compare every image of a batch with every caption of it (hardest negatives, ADOPT's top-K,
ladder levels, AEOM block matching), so a rank must not see only its own shard's negatives. The scheme
(open_clip's `gather_with_grad`, without its local-loss shortcut, which hardest negatives do not allow):

1. `train.batch_size` is the *global* batch. Every rank draws the same global batch (same seed) and encodes
   its contiguous shard of it (`shard_sizes`), so the gathered order is the global batch order.
2. Embeddings are all-gathered *with gradients* (`all_gather_with_grad`; its backward sums the gradient
   over ranks, the adjoint of the gather), and so are image/caption ids. Every rank computes the same
   loss on the [global B, global B] similarity, for any loss and any similarity.
3. Gradients are averaged over ranks (`average_gradients`). With the summing backward this makes the update
   equal to a single process on the global batch up to float rounding (tests/test_distributed.py).
4. BatchNorm layers (the region MLP's) use statistics of the global batch (`GlobalBatchNorm1d`), which
   a single process on the global batch also does; per-rank statistics would change the mathematics.

Gradients are averaged with one flat all-reduce after backward rather than by wrapping the model in
`DistributedDataParallel`: the trainer calls `encode_images`/`encode_texts`/`similarity` rather than
`forward`, and staged unfreezing changes `requires_grad` mid-run, both of which DDP's reducer does not allow.
The cost is that communication does not overlap the backward pass.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from vsekit.errors import SetupError


@dataclass(frozen=True)
class DistContext:
    """Where this process sits in the job; `DistContext()` is a plain single-process run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """Only the main rank writes checkpoints, logs and metrics."""
        return self.rank == 0


def env_world_size() -> int:
    """WORLD_SIZE as torchrun sets it (1 when not launched by torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def writes_run_files() -> bool:
    """Whether this process writes the run folder: always, except under torchrun, where only rank 0 does
    (`DistContext.is_main`; RANK as torchrun sets it, read before the group is joined)."""
    return env_world_size() <= 1 or os.environ.get("RANK", "0").strip() in ("", "0")


def init_from_env(device_type: str = "cpu") -> DistContext:
    """Join the process group torchrun describes (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT).

    NCCL for CUDA, gloo otherwise. A single process (no WORLD_SIZE, or 1) gets `DistContext()` and
    touches nothing. Idempotent: an already initialised default group is reused.
    """
    world = env_world_size()
    if world <= 1:
        return DistContext()
    if not dist.is_available():
        raise SetupError("WORLD_SIZE > 1 but this torch build has no torch.distributed")
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    if not dist.is_initialized():
        backend = "nccl" if device_type == "cuda" else "gloo"
        dist.init_process_group(backend=backend, init_method="env://", rank=rank, world_size=world)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local_rank)


def rank_device(device: torch.device, ctx: DistContext) -> torch.device:
    """One GPU per rank: `cuda` becomes `cuda:LOCAL_RANK` under torchrun; CPU stays CPU."""
    if ctx.enabled and device.type == "cuda" and device.index is None:
        device = torch.device("cuda", ctx.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def barrier(ctx: DistContext) -> None:
    if ctx.enabled:
        dist.barrier()


@contextlib.contextmanager
def main_first(ctx: DistContext) -> Iterator[None]:
    """Run the block on the main rank first (e.g. compute and cache a file), then on the others."""
    if ctx.enabled and not ctx.is_main:
        dist.barrier()
    yield
    if ctx.enabled and ctx.is_main:
        dist.barrier()


def shard_sizes(n: int, world_size: int) -> list[int]:
    """Sizes of the contiguous shards of a global batch of n (the first n % world ranks get one more)."""
    base, extra = divmod(n, world_size)
    return [base + (1 if r < extra else 0) for r in range(world_size)]


def shard_slice(n: int, rank: int, world_size: int) -> slice:
    """This rank's contiguous part of a global batch of n samples."""
    sizes = shard_sizes(n, world_size)
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _gather_padded(x: torch.Tensor, sizes: list[int]) -> torch.Tensor:
    """Concatenate every rank's `x` (rank r holds sizes[r] rows) in rank order."""
    width = max(sizes)
    x = x.contiguous()
    if x.shape[0] < width:
        x = torch.cat([x, x.new_zeros(width - x.shape[0], *x.shape[1:])])
    parts = [torch.empty_like(x) for _ in sizes]
    dist.all_gather(parts, x)
    return torch.cat([p[:s] for p, s in zip(parts, sizes)])


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, sizes: list[int], rank: int) -> torch.Tensor:
        ctx.sizes, ctx.rank = sizes, rank
        return _gather_padded(x, sizes)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        # Adjoint of the gather: every rank's loss depends on this rank's rows, so sum over ranks.
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        start = sum(ctx.sizes[: ctx.rank])
        return grad[start : start + ctx.sizes[ctx.rank]], None, None


def all_gather_with_grad(x: torch.Tensor, sizes: list[int], ctx: DistContext) -> torch.Tensor:
    """[sum(sizes), ...] rows of every rank in rank order; gradients flow back to each rank's own rows."""
    if not ctx.enabled:
        return x
    if x.shape[0] != sizes[ctx.rank]:
        raise ValueError(f"rank {ctx.rank} holds {x.shape[0]} rows but the shard sizes say {sizes[ctx.rank]}")
    return _AllGatherWithGrad.apply(x, list(sizes), ctx.rank)


def all_gather_rows(x: torch.Tensor, sizes: list[int], ctx: DistContext) -> torch.Tensor:
    """All-gather without gradient (ids, lengths)."""
    if not ctx.enabled:
        return x
    return _gather_padded(x, list(sizes))


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad)
        return grad


def all_reduce_sum_with_grad(x: torch.Tensor, ctx: DistContext) -> torch.Tensor:
    """Sum over ranks, differentiable (backward sums the gradient over ranks)."""
    return _AllReduceSum.apply(x) if ctx.enabled else x


def row_sizes(sizes: list[int], rows: torch.Tensor, samples: int) -> list[int]:
    """Every rank's row count of `rows` from its sample counts `sizes`: encoders that give each sample g
    consecutive rows (ESA's two views) gather g x the samples, in the same rank order, so the global matrix
    keeps each sample's views together."""
    if samples < 1 or rows.shape[0] % samples:
        raise ValueError(
            f"{rows.shape[0]} embedding rows are not a whole number of views of {samples} samples"
        )
    per_sample = rows.shape[0] // samples
    return [s * per_sample for s in sizes]


def local_shard_sizes(n_local: int, ctx: DistContext, device: torch.device) -> list[int]:
    """Every rank's shard size by asking them (one tiny collective); the trainer knows them without it."""
    if not ctx.enabled:
        return [n_local]
    t = torch.tensor([n_local], dtype=torch.long, device=device)
    parts = [torch.empty_like(t) for _ in range(ctx.world_size)]
    dist.all_gather(parts, t)
    return [int(p) for p in parts]


@torch.no_grad()
def average_gradients(params: Iterable[nn.Parameter], ctx: DistContext) -> None:
    """Mean of each gradient over ranks: one flat all-reduce per (device, dtype)."""
    if not ctx.enabled:
        return
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        if p.grad is not None:
            groups.setdefault((p.grad.device, p.grad.dtype), []).append(p.grad)
    for _, grads in sorted(groups.items(), key=lambda kv: str(kv[0])):
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= ctx.world_size
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()


@torch.no_grad()
def broadcast_module(module: nn.Module, ctx: DistContext) -> None:
    """Copy the main rank's parameters and buffers to every rank (identical start, whatever the seeds)."""
    if not ctx.enabled:
        return
    for t in list(module.parameters()) + list(module.buffers()):
        dist.broadcast(t.data, src=0)


class GlobalBatchNorm1d(nn.BatchNorm1d):
    """BatchNorm1d whose training statistics are those of the global batch across ranks.

    Same parameters and buffers as `nn.BatchNorm1d` (checkpoints load either way); outside distributed
    training or in eval mode it is exactly `nn.BatchNorm1d`. torch's `SyncBatchNorm` is CUDA-only and needs
    equal counts per rank; this one runs on gloo and NCCL and allows different row counts (the region MLP
    normalises only the real rows of each rank's shard). Two-pass mean/variance, computed in float32.
    """

    ctx: DistContext = DistContext()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not (self.training and self.ctx.enabled):
            return super().forward(x)
        if x.dim() not in (2, 3):
            raise ValueError(f"expected a 2-D or 3-D input, got {x.dim()}-D")
        xt = x.float() if x.dim() == 2 else x.float().transpose(1, 2).reshape(-1, x.shape[1])
        c = xt.shape[1]
        count = xt.new_tensor([float(xt.shape[0])])
        first = all_reduce_sum_with_grad(torch.cat([xt.sum(0), count]), self.ctx)
        n = first[c].detach()
        mean = first[:c] / n
        var = all_reduce_sum_with_grad(((xt - mean) ** 2).sum(0), self.ctx) / n
        y = (xt - mean) * torch.rsqrt(var + self.eps)
        if self.affine:
            y = y * self.weight + self.bias
        if self.track_running_stats:
            with torch.no_grad():
                self.num_batches_tracked += 1
                m = self.momentum if self.momentum is not None else 1.0 / float(self.num_batches_tracked)
                unbiased = var.detach() * n / (n - 1).clamp_min(1.0)
                self.running_mean.mul_(1 - m).add_(mean.detach().to(self.running_mean.dtype), alpha=m)
                self.running_var.mul_(1 - m).add_(unbiased.to(self.running_var.dtype), alpha=m)
        if x.dim() == 3:
            y = y.reshape(x.shape[0], x.shape[2], c).transpose(1, 2)
        return y.to(x.dtype)


def convert_batchnorm(module: nn.Module, ctx: DistContext) -> nn.Module:
    """Replace every `nn.BatchNorm1d` by a `GlobalBatchNorm1d` sharing its parameters and buffers.

    Call before building the optimiser (the parameters are the same objects, so it would not matter, but
    the replaced module must be the one the model calls). A no-op for a single process.
    """
    if not ctx.enabled:
        return module
    for name, child in module.named_children():
        if type(child) is nn.BatchNorm1d:
            new = GlobalBatchNorm1d(
                child.num_features, child.eps, child.momentum, child.affine, child.track_running_stats
            )
            new.ctx = ctx
            if child.affine:
                new.weight, new.bias = child.weight, child.bias
            if child.track_running_stats:
                new.running_mean, new.running_var = child.running_mean, child.running_var
                new.num_batches_tracked = child.num_batches_tracked
            new.train(child.training)
            setattr(module, name, new)
        elif isinstance(child, nn.BatchNorm1d) and hasattr(child, "reduce_sum"):
            # a masked BatchNorm (vsekit.models.norm) sums its statistics through `reduce_sum`: make it global
            child.reduce_sum = functools.partial(all_reduce_sum_with_grad, ctx=ctx)
        else:
            convert_batchnorm(child, ctx)
    return module
