"""One network's step of IN2R's co-teaching (`loss.name: in2r`, the loss fact `peer_queues`), as its release
(IN2R/co_train.py `train` at 909e532) runs it, on the network's own `TrainStep` parts:

- warm-up: two forward passes of the batch (they differ by the encoders' dropout, `model.image.input_dropout`
  and `model.text.word_dropout`), InfoNCE between the images and captions of the first and between the two
  passes of each side;
- later: on a labeled batch of the peer's split, two passes, the hardest-negative hinge of the first and the
  intra-modal hinges between the passes (backward); the pairs whose peer-given clean probability exceeds the
  network's own mean over its predicted-clean set join the network's memory queue; then one pass over a batch
  of the peer's unlabeled pairs, each image's partner rebuilt by the network's refiner from its nearest rows
  in the **peer's** queue (and each caption's), InfoNCE to those partners (backward); one optimizer step,
  the encoders' gradients clipped (not the refiners', as released).

Every draw (dropout in the encoders and refiners) comes from the step's generator, seeded from (seed, epoch,
step), so a resumed run trains the same.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from vsekit.data.batch import Batch
from vsekit.losses.noisy_in2r import average_clean_prob
from vsekit.training.step import TrainStep, tf32_matmul

if TYPE_CHECKING:
    from vsekit.training.co_teaching import CoTeaching


class PeerQueueStep:
    """Network k's steps (module docstring) for the co-teaching trainer `co`."""

    def __init__(self, co: CoTeaching) -> None:
        self.co = co
        self._thresholds: tuple[list, list[float]] | None = None  # (the splits, each network's)

    def queue_threshold(self, k: int) -> float:
        """Network k's own mean clean probability over its predicted-clean set, computed once per split."""
        splits = self.co.splits
        if self._thresholds is None or self._thresholds[0] is not splits:
            self._thresholds = (splits, [average_clean_prob(s.prob, s.labeled) for s in splits])
        return self._thresholds[1][k]

    def _passes(self, step: TrainStep, batch: Batch, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        parts = step.parts
        out = []
        for _ in range(n):
            img, txt = parts.encode(batch, step.generator)
            out.append((img.float(), txt.float()))
        return out

    def __call__(
        self, k: int, batch: Batch, u_batch: Batch | None, epoch: int, it: int, total: int, warm: bool
    ) -> dict:
        t = self.co.t
        step: TrainStep = t.member_steps[k]
        parts, loss_fn = step.parts, t.loss_fn
        _, seed = step.begin(epoch, it, total, t.state.global_step)
        step.generator.manual_seed(seed)
        out: dict = {}
        with tf32_matmul(step.tf32):
            batch = parts.to_device(batch)
            parts.zero_grad()
            (i1, c1), (i2, c2) = self._passes(step, batch, 2)
            if warm or self.co.splits is None:
                loss = loss_fn.warmup(i1, i2, c1, c2)
                loss.backward()
            else:
                hinge, intra_img, intra_txt = loss_fn.labeled(i1, i2, c1, c2)
                loss = hinge + intra_img + intra_txt
                loss.backward()
                prob = self.co.peer_prob(k)[batch.caption_index.to(t.device)]
                out["queued"] = loss_fn.enqueue(k, i1.detach(), c1.detach(), prob, self.queue_threshold(k))
                out["loss_labeled"] = loss.detach()
                if u_batch is not None:
                    ((iu, cu),) = self._passes(step, parts.to_device(u_batch), 1)
                    terms = loss_fn.unlabeled(k, iu, cu, step.generator)
                    if terms:
                        loss_u = sum(terms.values())
                        loss_u.backward()
                        out["loss_unlabeled"] = loss_u.detach()
                        loss = loss + loss_u
            parts.update(clip_loss_parameters=False)
        return {**parts.report(loss, {}, i1, c1), **out}
