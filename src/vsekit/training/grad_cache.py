"""Gradient caching (`train.grad_cache_chunk`): the gradients of one big contrastive batch at the activation
memory of a chunk (Gao et al. 2021, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup",
the GradCache method).

An in-batch loss couples every image to every caption, so a batch cannot simply be split into
micro-batches whose gradients are summed: each micro-batch would lose the others as negatives. The
loss, though, depends on the encoders only through the embeddings. So, for a batch of B pairs in chunks of C:

1. embed every chunk without a graph (`torch.no_grad`): [B, D] image and caption embeddings, cheap to keep;
2. score the full batch on leaf copies of them (similarity + loss, with the graph of that part only) and
   back-propagate: d loss / d embedding for all B rows, and the gradients of any similarity or loss
   parameters (AEOM's dustbin);
3. re-encode each chunk with its graph and back-propagate the cached embedding gradients
   (`emb.backward(grad[chunk])`): the encoders' gradients accumulate chunk by chunk;
4. clip and step as usual.

`GradCache` is a strategy over the step's parts (`vsekit.training.step_parts.StepParts`): it calls the same encode,
score and update the eager step calls, only chunk by chunk and in this order.

The loss sees exactly the full batch's similarity matrix, ids and embeddings, so every loss works unchanged:
hardest-negative and all-negatives triplet, InfoNCE, ADOPT (whose K is computed from that same matrix), the
ladder losses (relevance looked up by the full batch's caption ids) and AVSE's view regulariser (computed on
the leaf image embeddings, its gradient flows back with the rest).

Two things would make the re-encoded chunk differ from the chunk that was scored:
- randomness inside the model (grid-size augmentation, AVSE's random views drawn from the step's generator;
  dropout from torch's global generators): the generator's, the CPU's and the device's random states are saved
  before each chunk's first encoding and restored before every later one (GradCache's `RandContext`), and
  after the step they are left where one pass would leave them. Within the step a chunk therefore draws the
  same numbers in every pass, but not necessarily the numbers the unchunked step would have drawn for those
  rows: the draws are made per call, and a [C, ...] draw is not always the C rows of a [B, ...] draw (grid-size
  augmentation draws [C, 1] then [C, N]). The distribution is the same. Steps that draw nothing in the model
  (precomp recipes: their augmentation is made with the batch) match the unchunked step, and so do AVSE's
  [C, views, N] view draws from a CPU generator (row-major: the C rows of the [B, views, N] draw).
- BatchNorm with batch statistics (the region encoder's masked BatchNorm, `models/norm.py`): a chunk's own
  statistics are not the batch's, and the gradient through the statistics couples every row of the batch.
  `MaskedBatchNorm1d` sums its statistics through `reduce_sum` (the hook that makes them global under
  torchrun); here it makes them the full batch's: a first no-grad pass collects each chunk's sums and
  centred sums of squares (combined exactly, Chan et al.'s pairwise formula), the embedding and re-encoding
  passes normalise with the full batch's mean and variance, the re-encoding pass also collects
  d loss / d (the batch sums), and a last partial pass (each chunk up to its last BatchNorm only) sends that
  gradient into each chunk's rows. The result is the unchunked step's gradient up to float rounding, at
  2 extra no-grad/partial passes. The running statistics are updated once, with the full batch's statistics,
  exactly as the unchunked step updates them (the passes' own updates are undone).
  Any other BatchNorm that uses batch statistics is refused (`GradCacheError`).

Not supported (refused before any training, by `vsekit.training.step_setup.check_step_setup`, with a message
naming the setting): several processes (torchrun, `grad_cache_blockers`), `train.compile` and `train.cuda_graph`
(`config.validate_recipe`). Under `train.amp=bf16` the cached step agrees with the unchunked one to bf16's
precision only.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from vsekit.config import ConfigError, Recipe
from vsekit.data.batch import Batch
from vsekit.distributed import DistContext
from vsekit.losses.base import StepContext
from vsekit.models.norm import MaskedBatchNorm1d
from vsekit.training.step_parts import StepParts

logger = logging.getLogger(__name__)


class GradCacheError(ConfigError):
    """A recipe setting that gradient caching cannot reproduce exactly."""


def grad_cache_blockers(recipe: Recipe, dist: DistContext | None = None) -> list[str]:
    """Why the cached step cannot run here (empty: it can, or it is off); refused by `check_step_setup`.
    (With train.compile or train.cuda_graph: `config.validate_recipe`, a fact of the recipe alone.)"""
    out = []
    if recipe.train.grad_cache_chunk > 0 and dist is not None and dist.enabled:
        out.append(
            "train.grad_cache_chunk under torchrun (several processes) is not supported yet: the cached "
            "embeddings would have to be gathered across ranks; train on one process or set "
            "train.grad_cache_chunk=0"
        )
    return out


# ------------------------------------------------------------------------------------------ randomness
@dataclass
class RandomState:
    """The random states a chunk's encoding may draw from: the step's generator, the CPU's and the device's."""

    cpu: torch.Tensor
    device: torch.Tensor | None
    generator: torch.Tensor | None

    @classmethod
    def capture(cls, device: torch.device, generator: torch.Generator | None) -> RandomState:
        dev_state = None
        if device.type == "cuda":
            dev_state = torch.cuda.get_rng_state(device)
        elif device.type == "mps":
            dev_state = torch.mps.get_rng_state()
        return cls(torch.get_rng_state(), dev_state, generator.get_state() if generator is not None else None)

    def restore(self, device: torch.device, generator: torch.Generator | None) -> None:
        torch.set_rng_state(self.cpu)
        if self.device is not None:
            if device.type == "cuda":
                torch.cuda.set_rng_state(self.device, device)
            elif device.type == "mps":
                torch.mps.set_rng_state(self.device)
        if generator is not None and self.generator is not None:
            generator.set_state(self.generator)


# ------------------------------------------------------------------------------------------- BatchNorm
class _StopForward(Exception):
    """Raised from the last BatchNorm hook of a partial pass: the rest of the forward is not needed."""


def _uses_batch_stats(m: nn.modules.batchnorm._BatchNorm) -> bool:
    return m.training or m.running_mean is None or m.running_var is None


class FullBatchNorm:
    """Full-batch statistics and gradients for every `MaskedBatchNorm1d` of a model run in chunks.

    Each forward of such a module calls `reduce_sum` twice: first on [sums of the valid rows, their count]
    (C + 1 values), then on the valid rows' squared deviations from the mean that the first call gave (C
    values). An occurrence is one such pair; a module may run several times per encoder call (its
    occurrences are counted per chunk). The modes of `hooked` replace what those calls return:

    - "collect": the chunk's own sums (recorded); `combine` then gives the full batch's, exactly;
    - "apply": the full batch's (constants): the chunk's rows come out as in the unchunked forward;
    - "leaf": the full batch's as leaf tensors that require grad: after the chunk's backward their grads
      are d loss_chunk / d (batch sums), summed over chunks by `take_leaf_grads`;
    - "inject": the full batch's (constants), while the chunk's own sums, with their graph, are recorded;
      `inject_loss` is sum_k <summed grad_k, chunk sums_k>, whose backward is the part of the gradient that
      runs through the statistics (the mean's effect on the squared deviations sums to zero over the batch).
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules: list[MaskedBatchNorm1d] = []
        for name, m in model.named_modules():
            if not isinstance(m, nn.modules.batchnorm._BatchNorm) or not _uses_batch_stats(m):
                continue
            if not isinstance(m, MaskedBatchNorm1d):
                raise GradCacheError(
                    f"train.grad_cache_chunk: module {name or type(model).__name__} "
                    f"({type(m).__name__}) uses batch statistics, which chunks would change; "
                    "only the masked BatchNorm of vsekit's encoders is supported"
                )
            self.modules.append(m)
        self._mode = "off"
        self._calls: dict[int, int] = {}
        self._collected: dict[int, list[list[torch.Tensor]]] = {}  # per module: per occurrence, per chunk
        self.first: dict[int, list[torch.Tensor]] = {}  # full batch [sums, count] per module, occurrence
        self.second: dict[int, list[torch.Tensor]] = {}  # full batch sum of squared deviations
        self._leaves: dict[int, list[torch.Tensor]] = {}
        self.grads: dict[int, list[torch.Tensor | None]] = {}
        self._recorded: list[tuple[torch.Tensor, torch.Tensor]] = []  # (chunk sums with graph, their grad)
        self._stop_after = 0
        self._buffers: list[tuple[torch.Tensor, ...]] = []

    def __bool__(self) -> bool:
        return bool(self.modules)

    def in_module(self, module: nn.Module) -> bool:
        """Whether `module` holds one of the BatchNorms (the encoders without one skip the extra passes)."""
        ids = {id(m) for m in self.modules}
        return any(id(m) in ids for m in module.modules())

    # -- hooks
    @contextlib.contextmanager
    def hooked(self, mode: str, stop_after: int = 0) -> Iterator[None]:
        """Install the `reduce_sum` hooks (and a check that every call passes a mask) for one pass."""
        saved, handles = [], []
        self._mode, self._stop_after = mode, stop_after
        try:
            for m in self.modules:
                saved.append((m, m.__dict__.get("reduce_sum")))
                m.reduce_sum = self._hook_for(m)  # an instance attribute: shadows the class's static method
                handles.append(m.register_forward_pre_hook(_require_mask))
            yield
        finally:
            for handle in handles:
                handle.remove()
            for m, before in saved:
                if before is None:
                    del m.reduce_sum
                else:
                    m.reduce_sum = before
            self._mode = "off"

    def start_chunk(self) -> None:
        self._calls = {id(m): 0 for m in self.modules}
        self._recorded = []

    def _hook_for(self, m: MaskedBatchNorm1d) -> Callable[[torch.Tensor], torch.Tensor]:
        key = id(m)

        def hook(t: torch.Tensor) -> torch.Tensor:
            k = self._calls[key]
            self._calls[key] = k + 1
            occurrence, second = divmod(k, 2)
            width = m.num_features + (0 if second else 1)
            if t.shape != (width,):
                raise RuntimeError(
                    f"grad caching: {type(m).__name__}.reduce_sum got shape {tuple(t.shape)}, "
                    f"expected ({width},): the module no longer sums its statistics as "
                    "vsekit.training.grad_cache expects"
                )
            mode = self._mode
            if mode == "collect":
                per_occ = self._collected.setdefault(key, [])
                if len(per_occ) <= k:
                    per_occ.append([])
                per_occ[k].append(t.detach().clone())
                return t
            full = (self.second if second else self.first)[key][occurrence]
            if mode == "apply":
                return full
            if mode == "leaf":
                leaf = full.detach().clone().requires_grad_(True)
                self._leaves.setdefault(key, []).append(leaf)
                return leaf
            if mode == "inject":
                grads = self.grads.get(key, [])
                grad = grads[k] if k < len(grads) else None
                if grad is not None:
                    self._recorded.append((t, grad))
                if sum(self._calls.values()) >= self._stop_after:
                    raise _StopForward
                return full
            raise RuntimeError(f"grad caching: BatchNorm hook in unknown mode {mode!r}")

        return hook

    # -- statistics
    def combine(self) -> None:
        """The full batch's [sums, count] and sum of squared deviations from the chunks' own (Chan et al.):
        M2 = sum_c M2_c + sum_c n_c (mean_c - mean)^2, exact in real arithmetic."""
        self.first, self.second = {}, {}
        for m in self.modules:
            key, c = id(m), m.num_features
            per_call = self._collected.get(key, [])
            if len(per_call) % 2:
                raise RuntimeError(
                    "grad caching: a masked BatchNorm summed its statistics an odd number of times"
                )
            firsts, seconds = [], []
            for occ in range(len(per_call) // 2):
                sums = torch.stack(per_call[2 * occ])  # [chunks, C + 1]
                m2 = torch.stack(per_call[2 * occ + 1])  # [chunks, C]
                counts = sums[:, c:]  # [chunks, 1]
                total = sums.sum(0)
                mean = total[:c] / total[c].clamp_min(1.0)
                chunk_mean = sums[:, :c] / counts.clamp_min(1.0)
                firsts.append(total)
                seconds.append(m2.sum(0) + (counts * (chunk_mean - mean).square()).sum(0))
            self.first[key], self.second[key] = firsts, seconds
        self._collected = {}

    def take_leaf_grads(self) -> None:
        """Add the grads of this chunk's leaves to the running sums (first chunk: start them)."""
        for key, leaves in self._leaves.items():
            acc = self.grads.setdefault(key, [None] * len(leaves))
            for k, leaf in enumerate(leaves):
                if leaf.grad is not None:
                    acc[k] = leaf.grad if acc[k] is None else acc[k] + leaf.grad
        self._leaves = {}

    def inject_loss(self) -> torch.Tensor | None:
        terms = [(t.float() * g.float()).sum() for t, g in self._recorded]
        self._recorded = []
        return torch.stack(terms).sum() if terms else None

    # -- running statistics
    def save_buffers(self) -> None:
        self._buffers = [tuple(b.clone() for b in _stat_buffers(m)) for m in self.modules]

    def restore_buffers(self) -> None:
        for m, saved in zip(self.modules, self._buffers, strict=True):
            for b, s in zip(_stat_buffers(m), saved, strict=True):
                b.copy_(s)

    @torch.no_grad()
    def update_running_stats(self) -> None:
        """One update per occurrence with the full batch's statistics: what the unchunked forward does."""
        for m in self.modules:
            if not (m.training and m.track_running_stats and m.running_mean is not None):
                continue
            c = m.num_features
            for first, second in zip(self.first[id(m)], self.second[id(m)], strict=True):
                count = first[c]
                m._update_running_stats(first[:c] / count.clamp_min(1.0), second / (count - 1).clamp_min(1.0))


def _stat_buffers(m: nn.modules.batchnorm._BatchNorm) -> tuple[torch.Tensor, ...]:
    return tuple(b for b in (m.running_mean, m.running_var, m.num_batches_tracked) if b is not None)


def _require_mask(module: nn.Module, args: tuple) -> None:
    if len(args) < 2 or args[1] is None:
        raise GradCacheError(
            f"train.grad_cache_chunk: a {type(module).__name__} was called without a mask (plain "
            "batch statistics of each chunk); grad caching cannot make them the batch's"
        )


# ------------------------------------------------------------------------------------------- the step
class GradCache:
    """One optimisation step in chunks of `chunk` pairs with the gradients of the whole batch (module docstring),
    a strategy over the step's `parts`: their encoders per chunk, their score on the whole batch's embeddings,
    their update once at the end.

    Called by `TrainStep` when `train.grad_cache_chunk > 0`. Returns (loss, diagnostics, image embeddings,
    caption embeddings), all on the device, without reading anything back to the host.
    """

    def __init__(self, parts: StepParts, chunk: int) -> None:
        if chunk < 1:
            raise GradCacheError(f"train.grad_cache_chunk={chunk}: a chunk holds at least 1 pair")
        self.parts, self.chunk = parts, chunk
        self.passes = 0  # encoder calls of the last step (tests count them)

    def __call__(
        self,
        batch: Batch | Mapping[str, torch.Tensor],
        generator: torch.Generator | None,
        *,
        warmup: bool = False,
        ramp: tuple[int, int] | None = None,
        context: StepContext | None = None,
    ) -> tuple[torch.Tensor, dict, torch.Tensor, torch.Tensor]:
        """`context`: the step's `StepContext` (the loss's warm-up form, the ramp), handed to the loss by
        `StepParts.score`; without one it is built from `warmup` (all negatives) and `ramp` = (step + 1, steps in
        the epoch), the loss scaled by their ratio as in the first unfrozen-backbone epoch. The batch's
        `weights` reach the loss's reduction over the whole batch, as in the eager step."""
        if context is None:
            context = StepContext(warmup=warmup, ramp=ramp)
        step = _ChunkedStep(self, Batch.of(batch), generator)
        self.passes = 0
        if step.bn:
            step.bn.save_buffers()
            step.collect_statistics()  # 1. the chunks' BatchNorm sums -> the full batch's statistics
        after = step.embed()  # 2. every chunk's embeddings, without a graph
        loss, diag = step.full_batch_loss(context)  # 3. d loss / d embeddings (+ similarity/loss parameters)
        step.backprop_chunks()  # 4. each chunk again, with its graph: the cached embedding gradients
        if step.bn and step.bn.grads:
            step.backprop_statistics()  # 5. through the BatchNorm statistics: each chunk to its last BatchNorm
        if step.bn:
            step.bn.restore_buffers()
            step.bn.update_running_stats()
        after.restore(step.device, generator)
        self.parts.update()
        return loss.detach(), diag, step.img.detach(), step.txt.detach()


class _ChunkedStep:
    """One call of `GradCache`: the batch cut into chunks, each chunk's random state (saved at its first
    encoding, restored at every later one, so each pass draws the same masks), and the stages of the call."""

    def __init__(self, cache: GradCache, batch: Batch, generator: torch.Generator | None) -> None:
        self.cache, self.parts, self.generator = cache, cache.parts, generator
        self.model, self.device = self.parts.model, self.parts.device
        self.batch = self.parts.to_device(batch)
        b = self.batch.images.shape[0]
        self.spans = [(s, min(s + cache.chunk, b)) for s in range(0, b, cache.chunk)]
        self.bn = FullBatchNorm(self.model)
        self.image_bn = self.bn.in_module(self.model.image_encoder)
        self.text_bn = self.bn.in_module(self.model.text_encoder)
        self.states: list[RandomState | None] = [None] * len(self.spans)
        self.img = self.txt = torch.empty(0)
        self.grad_img: torch.Tensor | None = None
        self.grad_txt: torch.Tensor | None = None

    def encode(self, side: str, span: tuple[int, int]) -> torch.Tensor:
        self.cache.passes += 1
        rows = self.batch.rows(*span)
        if side == "image":
            return self.parts.encode_images(rows, self.generator)
        return self.parts.encode_texts(rows)

    def enter(self, i: int) -> None:
        """Before chunk i: its saved random state, or save it (its first encoding in this step)."""
        if self.states[i] is None:
            self.states[i] = RandomState.capture(self.device, self.generator)
        else:
            self.states[i].restore(self.device, self.generator)  # type: ignore[union-attr]

    def collect_statistics(self) -> None:
        with torch.no_grad(), self.bn.hooked("collect"):
            for i, span in enumerate(self.spans):
                self.enter(i)
                self.bn.start_chunk()
                if self.image_bn:
                    self.encode("image", span)
                if self.text_bn:
                    self.encode("text", span)
        self.bn.combine()

    def embed(self) -> RandomState:
        """Every chunk's embeddings as leaves (normalised with the full batch's statistics); returns where one
        pass leaves the random states."""
        imgs, txts = [], []
        with torch.no_grad(), self.bn.hooked("apply") if self.bn else contextlib.nullcontext():
            for i, span in enumerate(self.spans):
                self.enter(i)
                self.bn.start_chunk()
                imgs.append(self.encode("image", span))
                txts.append(self.encode("text", span))
        after = RandomState.capture(self.device, self.generator)
        self.img = torch.cat(imgs).detach().requires_grad_(True)
        self.txt = torch.cat(txts).detach().requires_grad_(True)
        return after

    def full_batch_loss(self, context: StepContext) -> tuple[torch.Tensor, dict]:
        parts, batch = self.parts, self.batch
        parts.zero_grad()
        loss, diag = parts.score(
            self.img, self.txt, batch.image_index, batch.caption_index, context=context, weights=batch.weights
        )
        loss.backward()
        self.grad_img, self.grad_txt = self.img.grad, self.txt.grad
        return loss, diag

    def backprop_chunks(self) -> None:
        bn = self.bn
        with bn.hooked("leaf") if bn else contextlib.nullcontext():
            for i, span in enumerate(self.spans):
                self.enter(i)
                bn.start_chunk()
                outs, grads = [], []
                for side, g in (("image", self.grad_img), ("text", self.grad_txt)):
                    emb = self.encode(side, span)
                    if g is not None and emb.requires_grad:
                        outs.append(emb)
                        grads.append(g[span[0] : span[1]].to(emb.dtype))
                if outs:
                    torch.autograd.backward(outs, grads)
                if bn:
                    bn.take_leaf_grads()

    def backprop_statistics(self) -> None:
        bn, model = self.bn, self.model
        for i, span in enumerate(self.spans):
            self.enter(i)
            for side, has_bn in (("image", self.image_bn), ("text", self.text_bn)):
                if not has_bn:
                    continue
                bn.start_chunk()
                expected = _calls_in(bn, model.image_encoder if side == "image" else model.text_encoder)
                with bn.hooked("inject", stop_after=expected), contextlib.suppress(_StopForward):
                    self.encode(side, span)
                part = bn.inject_loss()
                if part is not None and part.requires_grad:
                    part.backward()


def _calls_in(bn: FullBatchNorm, encoder: nn.Module) -> int:
    """`reduce_sum` calls one chunk makes in `encoder` (2 per occurrence of each of its BatchNorms)."""
    inside = {id(m) for m in encoder.modules()}
    return sum(2 * len(bn.first[id(m)]) for m in bn.modules if id(m) in inside)
