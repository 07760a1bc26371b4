"""The whole training step as one CUDA graph per batch shape (`train.cuda_graph`).

A step of a small model at batch 128 is a few hundred short kernels; launching them one by one from Python
takes longer than running them. A CUDA graph records them once and replays them with one launch
(PyTorch's "CUDA Graphs" notes, whole-network capture). What that needs, and where it is here:

- **Static inputs.** A graph reads the memory it was captured with. `StepGraphs` keeps one set of input
  buffers per batch shape key (image width, caption width, batch size; with the loss's warm-up flag), copies
  each batch into them (device to device, asynchronous) and replays that shape's graph; a new shape is
  captured once. The data path gives few shapes: feature sets padded to the set's largest, captions to a few
  bucket widths (`train.caption_buckets`), and a shorter last batch per epoch.
- **No host syncs, no data-dependent shapes** in forward, loss, backward, clipping and the optimizer
  (tests/test_fixed_shape.py compiles the models and losses whole); ADOPT's logged K and gammas stay
  device tensors (`host_diag=False`), read by the trainer when it logs.
- **A capturable optimizer.** AdamW with `fused=True, capturable=True` (its step counts live on the device)
  and a device tensor learning rate per parameter group (`LrTensors`): the group's float `lr` stays what the
  trainer sets, logs and checkpoints; before each replay its value is written into the tensor the graph reads
  (`fill_`, no host read). Checkpoints record the optimizer as it was built (the flags are restored in its
  state dict), so a run trained with graphs resumes without them and the other way round.
- **Warm-up before capture, on a side stream** (`CudaCapture`): three eager steps on the batch (they create
  the optimizer state, the gradients and every cache, e.g. GPO's positional encodings, outside the graph's
  memory pool), then the model, its buffers and the optimizer state are put back as they were, so the step
  that the captured graph then replays is the only one applied. Gradients are zeroed inside the graph (not set
  to None) and accumulated into the same tensors every replay.
- **Randomness.** The step's generator (AVSE's random views) is a CUDA generator registered with every
  graph (`register_generator_state`) and re-seeded from (seed, epoch, step) before each replay: a graph-safe
  generator reads its seed and offset at replay time, so each replay draws what the eager step would.
- **Autocast** (bf16) runs with `cache_enabled=False` under capture, as the notes require.

What cannot be captured is listed by `cuda_graph_blockers` and refused before any training, with every other
setting the step cannot run, by `vsekit.training.step_setup.check_step_setup` (one `ConfigError` naming each
part). The step recorded is the eager step of `vsekit.training.step.TrainStep` (its encode / score / update
parts), on the static buffers: a strategy over the same parts, not a copy. NOT YET RUN ON A GPU: the capture
(`CudaCapture`) is exercised only by tests that need CUDA (tests/test_cuda_graph.py, skipped here); the shape
keying, static buffers, learning-rate tensors and the optimizer conversion are tested on the CPU with the
capture replaced by eager execution (`EagerCapture`).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from vsekit.config import ConfigError, Recipe
from vsekit.data.batch import Batch
from vsekit.distributed import DistContext
from vsekit.errors import SetupError
from vsekit.registry import fact, has_fact, names_with

logger = logging.getLogger(__name__)

WARMUP_STEPS = 3  # eager steps before a capture (the notes' example uses 3; DDP needs 11, not supported here)
# the optimizer flags the conversion sets; a checkpoint records the values the optimizer was built with
_FLAGS = ("fused", "capturable", "foreach")


def cuda_graph_blockers(recipe: Recipe, device: torch.device, dist: DistContext | None = None) -> list[str]:
    """Why the recipe's step cannot run as a CUDA graph on `device` (empty: it can). Each entry names the
    setting and why; `check_step_setup` refuses them all in one message. A new refusal is one more entry here."""
    r, out = recipe, []
    if device.type != "cuda":
        out.append(f"the run is on {device} (CUDA graphs need a CUDA device; train.device=cuda)")
    if dist is not None and dist.enabled:
        out.append(
            "torchrun (the all-gather of embeddings and the gradient all-reduce across ranks are not captured)"
        )
    if r.train.compile:
        out.append("train.compile=true (choose one of the two: the graph replays eager kernels)")
    if not has_fact("image_encoder", r.model.image.kind, "cuda_graph"):
        out.append(
            f"model.image.kind={r.model.image.kind} (pixel encoders: the backbone unfreezes and its loss or lr "
            "warm-up changes the step from one step to the next)"
        )
    if not has_fact("text_encoder", r.model.text.kind, "cuda_graph"):
        out.append(
            f"model.text.kind={r.model.text.kind} (only {' and '.join(names_with('text_encoder', 'cuda_graph'))} "
            "text encoders are checked free of host "
            "syncs; the transformer's length-sorted chunks and frozen-state cache read lengths back)"
        )
    # the losses whose forward was checked free of host syncs and data-dependent shapes (tests/test_fixed_shape.py)
    if not has_fact("loss", r.loss.name, "cuda_graph"):
        capturable = ", ".join(names_with("loss", "cuda_graph"))
        out.append(f"loss.name={r.loss.name} (only {capturable} are checked free of host syncs)")
    out += fact("loss", r.loss.name, "cuda_graph_blockers", lambda cfg: [])(r.loss)
    if r.model.image.views > 1 and not hasattr(torch.cuda.CUDAGraph, "register_generator_state"):
        out.append(
            f"model.image.views={r.model.image.views} (random views need graph-safe generators, "
            f"torch >= 2.4; this is {torch.__version__})"
        )
    # the data path's settings a graph cannot run with: one entry each, here
    if r.data.num_workers > 0 and r.train.data_on_device is not True:
        on_device = str(r.train.data_on_device).lower()
        out.append(
            f"data.num_workers={r.data.num_workers} with train.data_on_device={on_device} "
            "(when the DataLoader makes the batches, its pin-memory thread calls CUDA while a step is "
            "being captured, which the capture's global mode forbids; set data.num_workers=0, or "
            "train.data_on_device=true to keep the set on the GPU)"
        )
    return out


# ------------------------------------------------------------------------------------ the optimizer
class LrTensors:
    """A device tensor per parameter group holding its learning rate, for a captured optimizer step.

    The groups keep float `lr`s (what the trainer's schedule sets, its logs read and checkpoints save);
    `sync()` writes each into its tensor when it changed (one `fill_`, no host read), and inside `swapped()`
    the groups hold the tensors, so a step run or captured there reads the learning rate from device memory."""

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device) -> None:
        self.optimizer = optimizer
        self.values = [float(g["lr"]) for g in optimizer.param_groups]
        self.tensors = [torch.tensor(v, dtype=torch.float32, device=device) for v in self.values]

    def sync(self) -> None:
        for i, g in enumerate(self.optimizer.param_groups):
            lr = g["lr"]
            if torch.is_tensor(lr):  # left swapped in (an interrupted capture): nothing to copy
                continue
            if float(lr) != self.values[i]:
                self.values[i] = float(lr)
                self.tensors[i].fill_(float(lr))

    @contextlib.contextmanager
    def swapped(self) -> Iterator[None]:
        self.sync()
        groups = self.optimizer.param_groups
        saved = [g["lr"] for g in groups]
        for g, t in zip(groups, self.tensors):
            g["lr"] = t
        try:
            yield
        finally:
            for g, lr in zip(groups, saved):
                g["lr"] = lr


def make_capturable(optimizer: torch.optim.Optimizer, device: torch.device) -> LrTensors:
    """Turn an AdamW built by the trainer into the fused, capturable one a graph can record, in place.

    Step counts move to the device (float32, as the fused step keeps them); the optimizer's state dict reports
    the flags it was built with, so checkpoints are the same with or without graphs. Returns the learning-rate
    tensors the captured step reads."""
    if not isinstance(optimizer, torch.optim.AdamW):
        raise ConfigError(f"train.cuda_graph needs the trainer's AdamW, got {type(optimizer).__name__}")
    built = [{k: g.get(k) for k in _FLAGS} for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g["fused"], g["capturable"], g["foreach"] = True, True, None
        for p in g["params"]:
            state = optimizer.state.get(p, {})
            if "step" in state:
                state["step"] = torch.as_tensor(state["step"], dtype=torch.float32).to(p.device)

    def as_built(_opt: torch.optim.Optimizer, state_dict: dict) -> dict:
        for g, flags in zip(state_dict["param_groups"], built):
            g.update(flags)
        return state_dict

    optimizer.register_state_dict_post_hook(as_built)
    return LrTensors(optimizer, device)


# --------------------------------------------------------------------------------- graphs per shape
Body = Callable[[Batch, tuple], dict]
Replay = Callable[[], dict]


def shape_key(batch: Batch | Mapping[str, torch.Tensor]) -> tuple:
    """(shape, dtype) of every input the step reads: batches with the same key share one graph."""
    return tuple((k, tuple(t.shape), t.dtype) for k, t in Batch.of(batch).items())


class CudaGraphCaptureError(SetupError):
    """Capturing the step failed on this device (an operation the capture forbids, e.g. in a kernel library):
    the message names the batch shape and the setting that runs the step eagerly instead."""


@dataclass
class _Entry:
    inputs: Batch  # the static buffers the graph reads
    replay: Replay


class StepGraphs:
    """One captured step per (batch shape, flags): static input buffers and the replay of the step on them.

    `body(inputs, flags)` is the eager step on the buffers, a `Batch` (forward, loss, backward, clipping,
    optimizer step; it returns device tensors); `capture(fn)` turns `fn` (the body on a shape's buffers) into
    a replay (`CudaCapture`, or `EagerCapture` that runs it as it is: CPU tests); `before_run(seed)` runs right
    before every replay (re-seeds the step's generator, writes the learning rates). A call copies the batch into its
    shape's buffers (capturing on first sight), replays, and returns copies of the outputs (a replay
    overwrites them)."""

    def __init__(
        self,
        body: Body,
        capture: Callable[[Callable[[], dict]], Replay],
        device: torch.device,
        before_run: Callable[[int], None] | None = None,
    ) -> None:
        self.body, self.capture, self.device = body, capture, device
        self.before_run = before_run
        self.entries: dict[tuple, _Entry] = {}

    def __call__(self, batch: Batch | Mapping[str, torch.Tensor], flags: tuple = (), seed: int = 0) -> dict:
        batch = Batch.of(batch)
        key = (shape_key(batch), flags)
        entry = self.entries.get(key)
        if entry is None:
            inputs = batch.map(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device))
            self._copy(inputs, batch)
            logger.info(
                "capturing the training step for batch shape %s (graph %d)",
                {k: tuple(v.shape) for k, v in inputs.items()},
                len(self.entries) + 1,
            )
            try:
                replay = self.capture(lambda: self.body(inputs, flags))
            except RuntimeError as e:  # torch reports capture failures as RuntimeError (CUDA errors included)
                shapes = {k: tuple(v.shape) for k, v in inputs.items()}
                first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise CudaGraphCaptureError(
                    f"train.cuda_graph=true: capturing the training step for batch shape {shapes} failed on "
                    f"{self.device} ({first}); run the step eagerly instead: the run keeps its last "
                    "checkpoint, and vse train --resume RUN --set train.cuda_graph=false continues it"
                ) from e
            entry = _Entry(inputs, replay)
            self.entries[key] = entry
        else:
            self._copy(entry.inputs, batch)
        if self.before_run is not None:
            self.before_run(seed)
        out = entry.replay()
        return {k: v.clone() for k, v in out.items()}

    @staticmethod
    def _copy(inputs: Batch, batch: Batch) -> None:
        """The batch into the static buffers (device to device, asynchronous): every tensor field, the per-sample
        `weights` too (a fixed-shape input: [B] like the ids, so the shape key need not name it)."""
        for name in batch.tensor_names():
            getattr(inputs, name).copy_(getattr(batch, name), non_blocking=True)


class EagerCapture:
    """The capture replaced by running the step as it is, with the learning rates read from their tensors as a
    captured step reads them: `StepGraphs` and the optimizer conversion without a GPU (tests)."""

    def __init__(self, lrs: LrTensors) -> None:
        self.lrs = lrs
        self.captured = 0

    def __call__(self, fn: Callable[[], dict]) -> Replay:
        self.captured += 1

        def run() -> dict:
            with self.lrs.swapped():
                return fn()

        return run


class CudaCapture:
    """Capture `fn` as a CUDA graph (PyTorch's whole-network recipe): warm-up steps on a side stream, the
    model's and optimizer's state put back, then `torch.cuda.graph`. Every graph shares one memory pool
    (they never run at the same time). NOT YET RUN ON A GPU (tests/test_cuda_graph.py)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        optimizer: torch.optim.Optimizer,
        lrs: LrTensors,
        generator: torch.Generator | None,
        device: torch.device,
        warmup: int = WARMUP_STEPS,
    ) -> None:
        self.modules, self.optimizer, self.lrs = list(modules), optimizer, lrs
        self.generator, self.device, self.warmup = generator, device, warmup
        self.pool = None
        self.captured = 0

    def _tensors(self) -> list[torch.Tensor]:
        """Everything a step changes: parameters, buffers (BatchNorm statistics), optimizer state."""
        out: list[torch.Tensor] = []
        for m in self.modules:
            out += [p.data for p in m.parameters()] + [b for b in m.buffers()]
        for state in self.optimizer.state.values():
            out += [v for v in state.values() if torch.is_tensor(v)]
        return out

    def __call__(self, fn: Callable[[], dict]) -> Replay:
        before = {id(p) for p in self.optimizer.state}
        saved = [t.clone() for t in self._tensors()]
        count = len(saved)
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream), self.lrs.swapped():
            for _ in range(self.warmup):
                fn()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        with torch.no_grad():
            # the state as it was: tensors that existed are copied back; optimizer state the warm-up created
            # (a first step) is zeroed, which is what a fresh AdamW state holds (step 0, zero moments)
            now = self._tensors()
            for t, s in zip(now[:count], saved):
                t.copy_(s)
            for p, state in self.optimizer.state.items():
                if id(p) not in before:
                    for v in state.values():
                        if torch.is_tensor(v):
                            v.zero_()
        graph = torch.cuda.CUDAGraph()
        if self.generator is not None and self.generator.device.type == "cuda":
            graph.register_generator_state(self.generator)
        with self.lrs.swapped(), torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()
        self.captured += 1

        def replay() -> dict:
            graph.replay()
            return out

        return replay
