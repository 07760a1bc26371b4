"""A two-network run (co-teaching: `train.sample_policy` whose part declares `members: 2`, e.g. NCR) as one
model: `ModelPair` holds networks A and B, built alike from the recipe, and is scored as the mean of their
similarity matrices, the number NCR's and IN2R's papers report.

The mean is one matrix product: each network's (L2-normalised) embedding is scaled by 1/sqrt(2) and the two
are concatenated, so the inner product of a pair's embeddings is (s_A + s_B) / 2. Every consumer of a model
(evaluation, `vsekit.load`, `vse index`, the server) therefore handles a pair unchanged; an index of a pair
stores [n, 2 x embed_dim] vectors. `member("A")` / `member("B")` is one network alone (`vse eval --member`).
Only an inner-product similarity (the fact `inner_product`) can be averaged this way.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from vsekit import registry
from vsekit.config import ConfigError, Recipe
from vsekit.models.inputs import ModelInputError
from vsekit.models.vse import DataSpec, VSEModel

MEMBERS = ("A", "B")
SCALE = 1.0 / math.sqrt(2.0)


def members_of(recipe: Recipe) -> int:
    """How many networks a run of `recipe` trains: its sample policy's fact `members` (1 without one)."""
    return int(registry.fact("sample_policy", recipe.train.sample_policy.name, "members", 1))


def build_model(recipe: Recipe, spec: DataSpec) -> nn.Module:
    """The model a run of `recipe` trains and loads: a `VSEModel`, or a `ModelPair` for a two-network policy."""
    if members_of(recipe) == 2:
        return ModelPair(recipe, spec)
    return VSEModel(recipe, spec)


class ModelPair(nn.Module):
    """Networks A and B (`members`), scored together (module docstring); anything else a consumer reads of a
    model (recipe, spec, encoders' facts) is network A's, which B shares."""

    def __init__(self, recipe: Recipe, spec: DataSpec) -> None:
        super().__init__()
        sim = recipe.model.similarity.name
        if not registry.has_fact("similarity", sim, "inner_product") or recipe.model.image.views != 1:
            raise ConfigError(
                f"train.sample_policy.name={recipe.train.sample_policy.name} trains two networks scored as the "
                f"mean of their similarities, which needs an inner-product similarity and one view; "
                f"model.similarity.name={sim}, model.image.views={recipe.model.image.views}"
            )
        self.members = nn.ModuleList([VSEModel(recipe, spec), VSEModel(recipe, spec)])
        self.recipe, self.spec = recipe, spec
        self.sim = self.members[0].sim

    def member(self, which: str) -> VSEModel:
        """Network "A" or "B"."""
        if which not in MEMBERS:
            raise ValueError(f"member must be one of {', '.join(MEMBERS)}, got {which!r}")
        return self.members[MEMBERS.index(which)]

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name.startswith("_") or name == "members":
                raise
            return getattr(self._modules["members"][0], name)

    def encode_images(
        self,
        images: torch.Tensor,
        lengths: torch.Tensor,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.Tensor:
        return torch.cat(
            [m.encode_images(images, lengths, generator, **kwargs) * SCALE for m in self.members], dim=1
        )

    def encode_texts(
        self, tokens: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        return torch.cat([m.encode_texts(tokens, lengths, generator) * SCALE for m in self.members], dim=1)

    def similarity(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """[n_images, n_captions]: the mean of both networks' similarities, from the pair's embeddings
        ([n, 2 x embed_dim] each, as `encode_images` / `encode_texts` give them)."""
        d = int(self.recipe.model.embed_dim)
        image_emb, text_emb = torch.as_tensor(image_emb), torch.as_tensor(text_emb)
        if image_emb.ndim != 2 or text_emb.ndim != 2 or {image_emb.shape[1], text_emb.shape[1]} != {2 * d}:
            raise ModelInputError(
                f"similarity: a pair's embeddings are [n, {2 * d}] (both networks'), got "
                f"{tuple(image_emb.shape)} and {tuple(text_emb.shape)}"
            )
        a, b = (
            m.similarity(image_emb[:, k * d : (k + 1) * d] / SCALE, text_emb[:, k * d : (k + 1) * d] / SCALE)
            for k, m in enumerate(self.members)
        )
        return (a + b) / 2

    def encode_image(self, images, lengths=None, **kwargs) -> torch.Tensor:
        from vsekit.models.inputs import encode_image

        return encode_image(self, images, lengths, **kwargs)

    def encode_text(self, text, lengths=None) -> torch.Tensor:
        from vsekit.models.inputs import encode_text

        return encode_text(self, text, lengths)

    def parameter_groups(self, lr: float) -> list[dict]:
        """Both networks' AdamW groups (one optimizer: a step on one network leaves the other's parameters,
        whose gradients are None, untouched, weight decay included)."""
        return [g for m in self.members for g in m.parameter_groups(lr)]
