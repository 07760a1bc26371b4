"""A VSE model = image encoder + text encoder + similarity, assembled from a recipe.

The trainer, evaluation and search only talk to this interface: `encode_images`, `encode_texts`,
`similarity`. Methods differ only in the parts the recipe names.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from vsekit.config import Recipe
from vsekit.models.image import BackboneImageEncoder, PrecompImageEncoder
from vsekit.models.text import BiGRUTextEncoder, TransformerTextEncoder
from vsekit.similarity import create_similarity


@dataclass
class DataSpec:
    """What a model needs to know about its data to be built (saved with every checkpoint)."""

    img_dim: int = 0  # feature size of precomputed features (0 for pixel backbones)
    vocab_words: list[str] = field(default_factory=list)  # BiGRU vocabulary
    text_model_path: str = ""  # transformer directory actually used


class VSEModel(nn.Module):
    def __init__(self, recipe: Recipe, spec: DataSpec) -> None:
        super().__init__()
        m = recipe.model
        self.recipe = recipe
        self.spec = spec
        views = m.image.views
        if m.image.kind == "precomp":
            if spec.img_dim <= 0:
                raise ValueError("a precomp image encoder needs the feature size (DataSpec.img_dim)")
            if views > 1:
                from vsekit.models.multiview import MultiViewImageEncoder

                self.image_encoder = MultiViewImageEncoder(spec.img_dim, m.embed_dim, m.image, m.normalize)
            else:
                self.image_encoder = PrecompImageEncoder(spec.img_dim, m.embed_dim, m.image, m.normalize)
        else:
            self.image_encoder = BackboneImageEncoder(
                m.embed_dim, m.image, m.normalize, recipe.data.grid_drop_max, recipe.data.size_augment
            )
        if m.text.kind == "bigru":
            if not spec.vocab_words:
                raise ValueError("a BiGRU text encoder needs a vocabulary (DataSpec.vocab_words)")
            self.text_encoder = BiGRUTextEncoder(len(spec.vocab_words), m.embed_dim, m.text, m.normalize)
        else:
            self.text_encoder = TransformerTextEncoder(m.embed_dim, m.text, m.normalize, spec.text_model_path)
            self.spec.text_model_path = self.text_encoder.model_path
        self.sim = create_similarity(m.similarity, m.embed_dim, views)

    def encode_images(self, images: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.image_encoder(images, lengths, generator=generator)

    def encode_texts(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(tokens, lengths)

    def similarity(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        return self.sim(image_emb, text_emb)

    def parameter_groups(self, lr: float) -> list[dict]:
        """AdamW groups with the recipe's per-part learning-rate multipliers."""
        special: dict[int, float] = {}
        if isinstance(self.text_encoder, TransformerTextEncoder):
            for p in self.text_encoder.body_parameters():
                special[id(p)] = self.recipe.model.text.lr_mult
        if isinstance(self.image_encoder, BackboneImageEncoder):
            for p in self.image_encoder.backbone_parameters():
                special[id(p)] = self.recipe.model.image.backbone_lr_mult
        groups: dict[float, list] = {}
        for p in self.parameters():
            groups.setdefault(special.get(id(p), 1.0), []).append(p)
        return [{"params": ps, "lr": lr * mult, "lr_mult": mult} for mult, ps in sorted(groups.items(), reverse=True)]
