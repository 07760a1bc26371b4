"""IN2R's loss as a vsekit loss (`loss.name: in2r`, on NCR's co-divide `train.sample_policy.name: ncr`): the terms of one
network's step and the state they carry between steps, per network of the pair: its memory queue of
confidently clean pairs and its two attention refiners (`vsekit.losses.noisy_in2r`). The co-teaching trainer
(`vsekit.training.in2r_step`) runs the passes and calls these; the queues and refiners are the loss's buffers
and parameters, so they are trained by the run's optimizer and saved with its `last` checkpoint.

Embeddings arrive centred and normalised (the model's `model.centre: batch`).
"""

from __future__ import annotations

import torch
from torch import nn

from vsekit.losses.base import InBatchLoss, StepContext, warmup_of
from vsekit.losses.noisy_in2r import (
    GraphRefiner,
    MemoryQueue,
    confident_rows,
    infonce,
    labeled_loss,
    refined_partners,
    warmup_terms,
)
from vsekit.losses.noisy_split import hardest_hinge

DIRECTIONS = ("both", "i2t", "t2i")
MEMBERS = 2


class IN2RLoss(InBatchLoss):
    """The terms (module docstring). `neighbours`: the k queue rows a refiner reads; `directions`: which
    unlabeled terms train (both = the image-to-text and the text-to-image one)."""

    def __init__(
        self,
        margin: float,
        embed_dim: int,
        queue_size: int,
        neighbours: int,
        directions: str = "both",
        unlabeled_weight: float = 0.5,
        intra_margin: float = 0.3,
        tau: float = 0.05,
        refiner_dropout: float = 0.1,
        refiner_heads: int = 4,
    ) -> None:
        super().__init__()
        if directions not in DIRECTIONS:
            raise ValueError(f"directions {directions!r} is not one of {', '.join(DIRECTIONS)}")
        self.margin, self.intra_margin, self.tau = margin, intra_margin, tau
        self.neighbours, self.unlabeled_weight = neighbours, unlabeled_weight
        self.directions = ("i2t", "t2i") if directions == "both" else (directions,)
        self.queues = nn.ModuleList([MemoryQueue(queue_size, embed_dim) for _ in range(MEMBERS)])
        self.refiners = nn.ModuleList(
            [
                nn.ModuleDict(
                    {d: GraphRefiner(embed_dim, refiner_heads, refiner_dropout) for d in ("i2t", "t2i")}
                )
                for _ in range(MEMBERS)
            ]
        )

    def forward(
        self,
        sims: torch.Tensor,
        image_ids: torch.Tensor | None = None,
        *,
        warmup: bool = False,
        context: StepContext | None = None,
        **_: object,
    ) -> tuple[torch.Tensor, dict]:
        """One pass's share, for a caller with one similarity matrix: the cross-modal InfoNCE in the warm-up,
        else the cross-modal hardest-negative hinge (IN2R's `loss_1`)."""
        if warmup_of(context, warmup):
            return infonce(sims, self.tau), {}
        return hardest_hinge(sims, self.margin), {}

    def warmup(self, img1, img2, txt1, txt2) -> torch.Tensor:
        """The warm-up loss of two passes of a batch."""
        return warmup_terms(img1, img2, txt1, txt2, self.tau)

    def labeled(self, img1, img2, txt1, txt2) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cross-modal hinge, image hinge, caption hinge) of a labeled batch's two passes."""
        return labeled_loss(img1, img2, txt1, txt2, self.margin, self.intra_margin)

    def enqueue(self, k: int, img: torch.Tensor, txt: torch.Tensor, prob: torch.Tensor, avg: float) -> int:
        """Network k's queue takes the pairs of its labeled batch whose (peer's) clean probability exceeds
        the network's own mean over its predicted-clean set; how many it took."""
        rows = confident_rows(prob.detach(), avg)
        self.queues[k].enqueue(img[rows], txt[rows])
        return int(rows.sum())

    def unlabeled(
        self, k: int, img: torch.Tensor, txt: torch.Tensor, generator: torch.Generator | None = None
    ) -> dict[str, torch.Tensor]:
        """Network k's weighted unlabeled terms of a batch: each image's partner rebuilt by k's refiner from
        the k nearest rows of the **peer's** queue, and each caption's likewise; empty while the peer's queue
        holds fewer rows than `neighbours` (the release skips the terms then)."""
        peer_img, peer_txt = self.queues[1 - k].used()
        if peer_img.shape[0] < self.neighbours:
            return {}
        out = {}
        for d in self.directions:
            query, keys, values = (img, peer_img, peer_txt) if d == "i2t" else (txt, peer_txt, peer_img)
            _, partner = refined_partners(
                query, keys, values, self.neighbours, self.refiners[k][d], generator
            )
            out[d] = self.unlabeled_weight * infonce(query @ partner.t(), self.tau)
        return out
