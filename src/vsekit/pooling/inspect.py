"""What a trained GPO learned: its weights over sorted positions, and how far they are from average pooling.

VSE∞'s claim is that GPO finds a better pooling than the hand-picked ones; whether a given run did is visible
in the weights themselves. The *effective number of positions* (perplexity, exp of the weights' entropy)
says it in one number: it equals N for average pooling over N items and 1 for max pooling.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
from torch import nn

from vsekit.pooling.gpo import GPO


@dataclass
class PoolingProfile:
    """One GPO's weights for a set of `length` items (position 0 = the largest value of each dimension)."""

    encoder: str
    length: int
    weights: list[float]

    @property
    def effective_positions(self) -> float:
        """exp(entropy): N for average pooling over N items, 1 for max pooling."""
        return math.exp(-sum(w * math.log(w) for w in self.weights if w > 0))

    @property
    def distance_from_average(self) -> float:
        """Total-variation distance to uniform weights 1/N: 0 = average pooling, → 1 = one position."""
        u = 1.0 / self.length
        return 0.5 * sum(abs(w - u) for w in self.weights)

    def as_dict(self) -> dict:
        return {
            "encoder": self.encoder,
            "length": self.length,
            "effective_positions": self.effective_positions,
            "distance_from_average": self.distance_from_average,
            "weights": self.weights,
        }


def gpo_profiles(model: nn.Module, lengths: dict[str, int]) -> list[PoolingProfile]:
    """Weights of every GPO in `model`; `lengths` maps an encoder prefix ("image", "text") to the set size.

    Encoders whose pooling has no learned weights (avg, max, k-max, ADPOOL) are left out.
    """
    out = []
    for name, module in model.named_modules():
        if not isinstance(module, GPO):
            continue
        encoder = (
            name.removesuffix(".pool") or "pool"
        )  # e.g. image_encoder, text_encoder, image_encoder.views.1
        member = re.match(r"members\.(\d+)\.(.*)", encoder)  # a two-network run: members.0.image_encoder
        if member:
            encoder = f"{member.group(2)} (network {chr(ord('A') + int(member.group(1)))})"
        n = next((v for k, v in lengths.items() if encoder.startswith(k)), None)
        if n is None:
            raise ValueError(f"no set size given for the GPO in {name!r} (have {sorted(lengths)})")
        if n < 1:
            raise ValueError(f"set size for {encoder} must be >= 1, got {n}")
        was_training = module.training
        module.eval()
        with torch.no_grad():
            w = module.weights_for_lengths(torch.tensor([n]), n)[0].double().cpu().tolist()
        module.train(was_training)
        out.append(PoolingProfile(encoder, n, w))
    return out
