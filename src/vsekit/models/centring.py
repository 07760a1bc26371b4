"""Centring of the embeddings before the final L2 normalisation (`model.centre: batch`, IN2R's `forward_emb`):
in training each batch's mean is subtracted, then every row is L2-normalised (x / (|x| + 1e-8), the release's
form). In eval mode a batch's own mean would make an embedding depend on what else is in its batch (one query
alone would be the zero vector), so the mean subtracted there is a running mean of the training batches'
means (torch's BatchNorm momentum rule), saved with the model. The released evaluation centres each batch of
128 captions with its images; docs/noisy.md gives the difference this makes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

from vsekit.models.norm import l2_normalize

MOMENTUM = 0.1  # BatchNorm's default: the running mean follows the last ~10 training batches


class EmbeddingCentring(nn.Module):
    """Subtract the mean of a side's embeddings and L2-normalise (module docstring); one running mean per side."""

    def __init__(self, dim: int, momentum: float = MOMENTUM) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("image_mean", torch.zeros(dim))
        self.register_buffer("text_mean", torch.zeros(dim))
        self.bypassed = False

    def forward(self, x: torch.Tensor, side: str) -> torch.Tensor:
        if self.bypassed:
            return x
        running = self.image_mean if side == "image" else self.text_mean
        if self.training:
            mean = x.mean(0)
            with torch.no_grad():
                running.mul_(1 - self.momentum).add_(mean.detach().float(), alpha=self.momentum)
        else:
            mean = running.to(x.dtype)
        return l2_normalize(x - mean, "add_eps")

    @contextlib.contextmanager
    def bypass(self) -> Iterator[None]:
        """While inside, the encoders' own outputs pass unchanged (the split pass centres per batch itself)."""
        was, self.bypassed = self.bypassed, True
        try:
            yield
        finally:
            self.bypassed = was
