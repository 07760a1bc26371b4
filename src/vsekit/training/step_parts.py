"""The three parts one optimisation step is made of, shared by every way of running it.

- **encode**: the batch to the device, the image and caption encoders (under bf16 autocast with
  `train.amp=bf16`; `train.compile` wraps the two encoders in `torch.compile`, the modules themselves are
  untouched, so checkpoints keep their keys);
- **score**: the similarity matrix (cast to float32), the loss on it with the ids, embeddings, per-sample
  weights and the step's `StepContext`, and the loss ramp of the first unfrozen-backbone epoch;
- **update**: gradients averaged across ranks, clipped (`optim.grad_clip`), and the optimizer's step — the
  only place in training where the weights change.

`vsekit.training.step.TrainStep` runs them once per batch (eager), `GradCache` chunk by chunk
(`vsekit.training.grad_cache`), and `StepGraphs` records the eager step per batch shape
(`vsekit.training.cuda_graph`): strategies over these parts, not copies of them.
"""

from __future__ import annotations

import contextlib

import torch

from vsekit.config import ConfigError
from vsekit.data.batch import Batch
from vsekit.distributed import DistContext, average_gradients
from vsekit.losses.base import InBatchLoss, StepContext
from vsekit.models.vse import VSEModel
from vsekit.training.collapse import embedding_spread


class StepParts:
    """encode / score / update of one step over `model`, `loss_fn` and `optimizer` (module docstring).

    `graph=True` (a step a CUDA graph records): autocast without its cast cache, gradients zeroed rather
    than set to None (every replay accumulates into the same tensors), tensor outputs only."""

    def __init__(
        self,
        model: VSEModel,
        loss_fn: InBatchLoss,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        *,
        amp: bool = False,
        grad_clip: float = 0.0,
        compile: bool = False,
        dist: DistContext | None = None,
    ) -> None:
        self.model, self.loss_fn, self.optimizer, self.device = model, loss_fn, optimizer, device
        self.amp, self.grad_clip = amp, grad_clip
        self.dist = dist or DistContext()
        if self.dist.enabled and loss_fn.needs_sets:
            raise ConfigError(
                f"{type(loss_fn).__name__} reads the encoders' local sets, which are not gathered "
                "across ranks: train it in one process"
            )
        # what a loss asks for besides the embeddings (its `needs_sets`, `needs_generator`), from `encode`
        self.loss_inputs: dict = {}
        # what the caller hands the loss with this step's batch (the co-teaching trainer's targets), from
        # `TrainStep(..., loss_inputs=)`: merged into `loss_inputs` by `encode`
        self.batch_inputs: dict = {}
        self._image_encoder, self._text_encoder = model.encode_images, model.encode_texts
        if compile:
            self._image_encoder = torch.compile(model.encode_images)
            self._text_encoder = torch.compile(model.encode_texts)

    def autocast(self, graph: bool = False) -> contextlib.AbstractContextManager:
        return torch.autocast(
            device_type=self.device.type, dtype=torch.bfloat16, enabled=self.amp, cache_enabled=not graph
        )

    # ------------------------------------------------------------------------------------ encode
    def to_device(self, batch: Batch) -> Batch:
        """The batch on the step's device (a no-op for the data paths' batches, already there)."""
        return batch.to(self.device, non_blocking=True)

    def encode_images(
        self, batch: Batch, generator: torch.Generator | None, graph: bool = False
    ) -> torch.Tensor:
        with self.autocast(graph):
            return self._image_encoder(batch.images, batch.image_lengths, generator=generator)

    def encode_texts(
        self, batch: Batch, graph: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        with self.autocast(graph):
            return self._text_encoder(batch.tokens, batch.token_lengths, generator=generator)

    def encode(
        self, batch: Batch, generator: torch.Generator | None, graph: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """[B, D] image and caption embeddings of `batch` (on the device already), in one autocast region; the
        sets and the generator the loss asks for (`needs_sets`, `needs_generator`) are kept for `score`."""
        self.loss_inputs = dict(self.batch_inputs)
        if self.loss_fn.needs_generator:
            self.loss_inputs["generator"] = generator
        if not self.loss_fn.needs_sets:
            with self.autocast(graph):
                return self.encode_images(batch, generator, graph), self.encode_texts(batch, graph, generator)
        with self.autocast(graph), self.model.capture_sets() as sets:
            img, txt = self.encode_images(batch, generator, graph), self.encode_texts(batch, graph, generator)
        self.loss_inputs.update(image_set=sets["image"], text_set=sets["text"])
        return img, txt

    # ------------------------------------------------------------------------------------- score
    def score(
        self,
        img: torch.Tensor,
        txt: torch.Tensor,
        image_ids: torch.Tensor,
        caption_ids: torch.Tensor,
        *,
        warmup: bool = False,
        ramp: tuple[int, int] | None = None,
        graph: bool = False,
        context: StepContext | None = None,
        weights: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict]:
        """The loss of the embeddings and its diagnostics. `context`: the step's `StepContext`, handed to the
        loss (its warm-up form, all negatives) and whose `ramp` = (step + 1, steps in the epoch) scales the loss
        by their ratio (first unfrozen-backbone epoch); without one, it is built from `warmup` and `ramp`.
        `weights` [B]: the batch's per-sample weights, handed to the loss's reduction (`Batch.weights`)."""
        if context is None:
            context = StepContext(warmup=warmup, ramp=ramp)
        with self.autocast(graph):
            sims = self.model.similarity(img, txt).float()
        extra, self.loss_inputs = self.loss_inputs, {}
        if weights is not None:
            extra["weights"] = weights
        loss, diag = self.loss_fn(
            sims,
            image_ids=image_ids,
            caption_ids=caption_ids,
            context=context,
            image_emb=img,
            text_emb=txt,
            **extra,
        )
        if context.ramp is not None:
            loss = loss * context.ramp[0] / context.ramp[1]
        return loss, diag

    # ------------------------------------------------------------------------------------ update
    def zero_grad(self, graph: bool = False) -> None:
        self.optimizer.zero_grad(set_to_none=not graph)

    def update(self, clip_loss_parameters: bool = True) -> None:
        """Apply the gradients the step accumulated: averaged over ranks, clipped (the model's and the loss's own
        parameters together; the model's alone with `clip_loss_parameters=False`, as IN2R's release clips its
        encoders but not its refiners), one optimizer step."""
        params = [*self.model.parameters(), *self.loss_fn.parameters()]
        average_gradients(params, self.dist)
        if self.grad_clip > 0:
            clipped = params if clip_loss_parameters else list(self.model.parameters())
            torch.nn.utils.clip_grad_norm_(clipped, self.grad_clip)
        self.optimizer.step()

    @staticmethod
    def report(
        loss: torch.Tensor, diag: dict, img: torch.Tensor, txt: torch.Tensor, graph: bool = False
    ) -> dict:
        """The step's outputs, device tensors (no host read): the loss, the embeddings' spread (the collapse
        alarm's second sign) and the loss's diagnostics. Under a graph only tensors (a Python number would be
        the capture's value at every replay)."""
        if graph:
            return {
                "loss": loss.detach(),
                "spread": embedding_spread(img, txt),
                **{k: v.detach() for k, v in diag.items() if torch.is_tensor(v)},
            }
        return {
            "loss": loss.detach(),
            "spread": embedding_spread(img, txt),
            **{k: v for k, v in diag.items() if torch.is_tensor(v) or isinstance(v, (int, float))},
        }
