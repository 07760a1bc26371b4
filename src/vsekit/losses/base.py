"""What the trainer may ask of a loss, declared once: the base class of every loss on an in-batch matrix.

A loss is called as `loss_fn(sims, image_ids=…, caption_ids=…, context=…, weights=…, image_emb=…, text_emb=…)`
and returns `(scalar, diagnostics)`. `context` is the `StepContext` of the step (epoch, step, warm-up, ramp: what
the loss may read of where training is; a direct call may still pass `warmup=` instead); `weights` [B] are the
batch's per-sample weights (`Batch.weights`, ones by default), which a loss that declares `takes_weights` applies
in its reduction (the others ignore them). Besides that, the trainer uses five optional hooks; the defaults here are
what a loss that needs none of them does (nothing), so the trainer calls them on any loss without asking
whether it has them:

- `host_diag`: whether the loss may turn its diagnostics into Python numbers (a host read per call); the
  training step sets it False, so they stay device tensors (ADOPT's K and gammas), read when it logs;
- `step_log_keys`: diagnostics recorded at every step, whatever `train.log_every` is (ADOPT's K curve);
- `needs_caption_embeddings` / `set_caption_embeddings`: the train captions' sentence embeddings, which
  the trainer computes (a sentence model, cached) only for a loss that reads them (the ladder losses);
- `threshold_share` (+ `set_derived_threshold`): a share rule from which the trainer derives θ_1 from the
  train split's caption relevance (None: no threshold to derive);
- `derived_thresholds`: the thresholds so derived, which the run's config.json records (None: none);
- `needs_sets`: the loss is also given `image_set=` / `text_set=`, the (local features [B, N, D], lengths)
  each encoder handed its pooling in the same forward pass (HREM's region–word relation);
- `needs_generator`: the loss is also given `generator=`, the step's generator (seeded from the seed, epoch
  and step), for its own random draws (HREM's sampled negatives): a resumed run draws the same.

A loss's own parameters and buffers (its `state_dict`) are trained by the trainer's optimizer, clipped with
the model's, and saved in and restored from the run's `last` checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class StepContext:
    """Where training is when the loss is called: handed to the loss instead of a bare warm-up flag, so a loss
    (or a per-sample strategy) may depend on the epoch and step without another argument per need.

    `warmup`: the loss's warm-up form (all negatives, `loss.warmup_epochs`); `ramp` = (step + 1, steps in the
    epoch) when the loss is ramped in (first unfrozen-backbone epoch), else None. Under a CUDA graph only
    `warmup` is part of the graph's key (a ramp is refused there); the counters are those of the captured step."""

    epoch: int = 0
    step: int = 0
    steps_in_epoch: int = 1
    global_step: int = 0
    warmup: bool = False
    ramp: tuple[int, int] | None = None

    @property
    def ramp_scale(self) -> float:
        """The factor the loss is scaled by this step: (step + 1) / steps in the epoch while ramping, else 1."""
        return 1.0 if self.ramp is None else self.ramp[0] / self.ramp[1]


def warmup_of(context: StepContext | None, warmup: bool = False) -> bool:
    """The warm-up flag of a loss call: the context's when the step hands one, else the `warmup=` of a direct
    call (tests, benches, losses written against the earlier signature)."""
    return context.warmup if context is not None else warmup


class InBatchLoss(nn.Module):
    """Base class of the losses (module docstring): the optional hooks with their do-nothing defaults."""

    host_diag: bool = True
    step_log_keys: tuple[str, ...] = ()
    needs_caption_embeddings: bool = False
    threshold_share: float | None = None
    derived_thresholds: list[float] | None = None
    needs_sets: bool = False
    needs_generator: bool = False
    # the loss applies `weights=` (per-sample weights [B]) in its reduction; False: it ignores them, so a
    # sample policy that weights pairs must refuse such a loss
    takes_weights: bool = False

    def set_caption_embeddings(self, emb: torch.Tensor) -> None:
        """[captions, dim] sentence embeddings of the train split's captions (unused by default)."""

    def set_derived_threshold(self, theta: float) -> None:
        """θ_1 derived from `threshold_share`; only a loss that declares a share is given one."""
        raise RuntimeError(f"{type(self).__name__} has no threshold share to derive a threshold from")
