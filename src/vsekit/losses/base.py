"""What the trainer may ask of a loss, declared once: the base class of every loss on an in-batch matrix.

A loss is called as `loss_fn(sims, image_ids=…, caption_ids=…, warmup=…, image_emb=…, text_emb=…)` and
returns `(scalar, diagnostics)`. Besides that, the trainer uses five optional hooks; the defaults here are
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

import torch
from torch import nn


class InBatchLoss(nn.Module):
    """Base class of the losses (module docstring): the optional hooks with their do-nothing defaults."""

    host_diag: bool = True
    step_log_keys: tuple[str, ...] = ()
    needs_caption_embeddings: bool = False
    threshold_share: float | None = None
    derived_thresholds: list[float] | None = None
    needs_sets: bool = False
    needs_generator: bool = False

    def set_caption_embeddings(self, emb: torch.Tensor) -> None:
        """[captions, dim] sentence embeddings of the train split's captions (unused by default)."""

    def set_derived_threshold(self, theta: float) -> None:
        """θ_1 derived from `threshold_share`; only a loss that declares a share is given one."""
        raise RuntimeError(f"{type(self).__name__} has no threshold share to derive a threshold from")
