"""One optimisation step: `TrainStep`, shared by the trainer and `vse bench train-step` (the benchmark times
exactly the step that trains).

The step is made of three parts (`vsekit.training.step_parts.StepParts`: encode, score, update) and runs them in
one of three ways, chosen and checked once by `vsekit.training.step_setup.check_step_setup`:

- **eager** (default): encode the batch, all-gather the embeddings across ranks under torchrun (every rank
  scores the global batch: its negatives are everyone's), score, backward, update;
- **gradient caching** (`train.grad_cache_chunk`): `GradCache` runs the same parts chunk by chunk with the
  whole batch's gradients (`vsekit.training.grad_cache`);
- **CUDA graphs** (`train.cuda_graph`): `StepGraphs` records the eager step once per batch shape and replays
  it (`vsekit.training.cuda_graph`).

The step never reads a value back to the host itself (the returned loss and diagnostics are device
tensors: ADOPT's logged K and gammas too, `host_diag=False`). In-model randomness (grid size augmentation,
AVSE's views) comes from a generator on the device (the CPU's on the CPU) seeded from (seed, epoch, step).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Mapping

import torch

from vsekit.config import ConfigError, Recipe
from vsekit.data.batch import Batch
from vsekit.distributed import (
    DistContext,
    all_gather_rows,
    all_gather_with_grad,
    local_shard_sizes,
    row_sizes,
)
from vsekit.losses.base import InBatchLoss, StepContext
from vsekit.models.vse import VSEModel
from vsekit.training.cuda_graph import CudaCapture, EagerCapture, StepGraphs, make_capturable
from vsekit.training.grad_cache import GradCache
from vsekit.training.step_parts import StepParts
from vsekit.training.step_setup import StepSetup, check_step_setup
from vsekit.utils.runtime import derived_seed


@contextlib.contextmanager
def tf32_matmul(enabled: bool) -> Iterator[None]:
    """TF32 matmuls inside the block only: torch keeps this as a process-wide flag, so it is restored."""
    if not enabled:
        yield
        return
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


class TrainStep:
    """One optimisation step of `model` on a batch (module docstring).

    `setup`: the checked `StepSetup` (the trainer checks before it reads anything); without it the step checks
    the recipe itself. `graph="eager"` runs the CUDA-graph machinery with the capture replaced by eager
    execution (CPU tests); `graph="cuda"` captures whatever train.cuda_graph says."""

    def __init__(
        self,
        recipe: Recipe,
        model: VSEModel,
        loss_fn: InBatchLoss,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        dist: DistContext | None = None,
        graph: str | None = None,
        setup: StepSetup | None = None,
    ) -> None:
        self.recipe, self.model, self.loss_fn, self.optimizer = recipe, model, loss_fn, optimizer
        self.device = device
        self.dist = dist or DistContext()
        self.setup = setup or check_step_setup(recipe, device, self.dist, graph)
        self.tf32 = recipe.train.tf32 and device.type == "cuda"
        loss_fn.host_diag = False  # no host read in the loss: the trainer reads the values when it logs
        self.generator = torch.Generator(device=device) if device.type == "cuda" else torch.Generator()
        self.parts = StepParts(
            model,
            loss_fn,
            optimizer,
            device,
            amp=recipe.train.amp == "bf16",
            grad_clip=recipe.optim.grad_clip,
            compile=recipe.train.compile,
            dist=self.dist,
        )
        self._context: StepContext | None = None  # the last call's, read by a CUDA graph's capture
        self.graphs: StepGraphs | None = None
        if self.setup.graph is not None:
            self.graphs = self._graph_strategy(self.setup.graph)
        self.grad_cache: GradCache | None = None
        if self.setup.grad_cache_chunk > 0:
            self.grad_cache = GradCache(self.parts, self.setup.grad_cache_chunk)

    def __call__(
        self,
        batch: Batch | Mapping[str, torch.Tensor],
        epoch: int,
        step: int,
        steps_in_epoch: int = 1,
        loss_warmup: bool = False,
        shard_sizes: list[int] | None = None,
        global_step: int | None = None,
        loss_inputs: Mapping[str, torch.Tensor] | None = None,
    ) -> dict:
        """Train on `batch` (this rank's shard; `shard_sizes` = every rank's shard size of the global batch).
        `loss_warmup`: the loss ramps in over the epoch's steps (first unfrozen-backbone epoch). The loss gets
        the step's `StepContext` (`global_step`: steps done before this one; None: unknown, recorded as -1)
        and the batch's `weights`, and `loss_inputs` besides (keyword arguments of this step's loss call:
        the co-teaching trainer's targets; eager steps only)."""
        batch = Batch.of(batch)
        self.parts.batch_inputs = dict(loss_inputs or {})
        if self.parts.batch_inputs and (self.graphs is not None or self.grad_cache is not None):
            raise ConfigError(
                "per-batch loss inputs need the eager step (no train.cuda_graph, no grad cache)"
            )
        context, seed = self.begin(epoch, step, steps_in_epoch, global_step, loss_warmup)
        if self.graphs is not None:
            # only pixel recipes ramp the loss in, and they are refused (cuda_graph_blockers)
            if context.ramp is not None:
                raise ConfigError(
                    "train.cuda_graph: a loss warm-up scales the loss by the step, which a graph cannot"
                )
            self._context = context  # what the body hands the loss when it captures (the graph's key: warmup)
            return self.graphs(batch, (context.warmup,), seed)
        self.generator.manual_seed(seed)
        if self.grad_cache is not None:
            with tf32_matmul(self.tf32):
                loss, diag, img, txt = self.grad_cache(batch, self.generator, context=context)
            return self.parts.report(loss, diag, img, txt)
        return self.eager(batch, context, shard_sizes=shard_sizes)

    def begin(
        self,
        epoch: int,
        step: int,
        steps_in_epoch: int = 1,
        global_step: int | None = None,
        loss_warmup: bool = False,
    ) -> tuple[StepContext, int]:
        """The model in train mode and (the step's `StepContext`, the seed of its generator's draws, from
        (seed, epoch, step, rank)): what every body run on this step's parts starts from."""
        r, ctx = self.recipe, self.dist
        self.model.train()
        rank_part = (ctx.rank,) if ctx.enabled else ()
        seed = derived_seed(r.train.seed, epoch, step, 0x1A6E, *rank_part)
        context = StepContext(
            epoch=epoch,
            step=step,
            steps_in_epoch=steps_in_epoch,
            global_step=-1 if global_step is None else global_step,
            warmup=epoch < r.loss.warmup_epochs,
            ramp=(step + 1, steps_in_epoch) if loss_warmup else None,
        )
        return context, seed

    def eager(
        self,
        batch: Batch,
        warmup: bool | StepContext,
        ramp: tuple[int, int] | None = None,
        shard_sizes: list[int] | None = None,
        graph: bool = False,
    ) -> dict:
        """The step on the whole batch at once: the parts in order. `warmup`: the step's `StepContext` (or, as
        before it existed, the warm-up flag, with `ramp`). `graph`: the step a CUDA graph records."""
        parts, ctx = self.parts, self.dist
        context = warmup if isinstance(warmup, StepContext) else StepContext(warmup=warmup, ramp=ramp)
        with tf32_matmul(self.tf32):
            batch = parts.to_device(batch)
            img, txt = parts.encode(batch, self.generator, graph)
            image_ids, caption_ids, weights = batch.image_index, batch.caption_index, batch.weights
            if ctx.enabled:  # every rank scores the global batch: its negatives are everyone's
                sizes = shard_sizes or local_shard_sizes(image_ids.shape[0], ctx, self.device)
                img = all_gather_with_grad(img, row_sizes(sizes, img, image_ids.shape[0]), ctx)
                txt = all_gather_with_grad(txt, row_sizes(sizes, txt, image_ids.shape[0]), ctx)
                image_ids, caption_ids, weights = (
                    all_gather_rows(image_ids, sizes, ctx),
                    all_gather_rows(caption_ids, sizes, ctx),
                    all_gather_rows(weights, sizes, ctx),
                )
            loss, diag = parts.score(
                img, txt, image_ids, caption_ids, context=context, weights=weights, graph=graph
            )
            parts.zero_grad(graph)
            loss.backward()
            parts.update()
        return parts.report(loss, diag, img, txt, graph)

    def _graph_context(self, flags: tuple) -> StepContext:
        """The context a captured step hands the loss: the capturing call's, with the graph key's warm-up flag."""
        context = self._context or StepContext()
        return dataclasses.replace(context, warmup=bool(flags[0]))

    def _graph_strategy(self, mode: str) -> StepGraphs:
        """The eager step recorded as one CUDA graph per batch shape (`mode="eager"`: run as eager calls)."""
        lrs = make_capturable(self.optimizer, self.device)
        if mode == "eager":
            capture: EagerCapture | CudaCapture = EagerCapture(lrs)
        else:
            capture = CudaCapture(
                [self.model, self.loss_fn], self.optimizer, lrs, self.generator, self.device
            )

        def before_run(seed: int) -> None:
            self.generator.manual_seed(seed)
            lrs.sync()

        return StepGraphs(
            lambda b, flags: self.eager(b, self._graph_context(flags), graph=True),
            capture,
            self.device,
            before_run,
        )
