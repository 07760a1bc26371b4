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
from vsekit.models.text import BagOfWordsTextEncoder, BiGRUTextEncoder, TransformerTextEncoder
from vsekit.similarity import create_similarity


@dataclass
class DataSpec:
    """What a model needs to know about its data to be built (saved with every checkpoint)."""

    img_dim: int = 0  # feature size of precomputed features (0 for pixel backbones)
    vocab_words: list[str] = field(default_factory=list)  # BiGRU vocabulary
    text_model_path: str = ""  # transformer directory actually used
    vision_config: dict = field(default_factory=dict)  # vit image encoder: the transformers ViTConfig fields


class VSEModel(nn.Module):
    def __init__(self, recipe: Recipe, spec: DataSpec) -> None:
        super().__init__()
        m = recipe.model
        self.recipe = recipe
        self.spec = spec
        views = m.image.views
        form = m.l2_form
        if m.image.kind == "vit":
            from vsekit.models.vit_views import ViTMultiViewImageEncoder

            if not spec.vision_config:
                raise ValueError("a vit image encoder needs the ViT configuration (DataSpec.vision_config)")
            self.image_encoder = ViTMultiViewImageEncoder(
                spec.vision_config, m.embed_dim, views=m.image.views, keep_train=m.image.view_keep_train,
                keep_test=m.image.view_keep_test, pooling=m.image.pooling,
                normalize=m.normalize, l2_eps_outside_sqrt=form == "add_eps", size_augment=recipe.data.size_augment,
                grid_drop_max=recipe.data.grid_drop_max,
            )
        elif m.image.kind == "precomp":
            if spec.img_dim <= 0:
                raise ValueError("a precomp image encoder needs the feature size (DataSpec.img_dim)")
            if views > 1:
                from vsekit.models.multiview import MultiViewImageEncoder

                self.image_encoder = MultiViewImageEncoder(spec.img_dim, m.embed_dim, m.image, m.normalize, form)
            else:
                self.image_encoder = PrecompImageEncoder(spec.img_dim, m.embed_dim, m.image, m.normalize, form)
        else:
            self.image_encoder = BackboneImageEncoder(
                m.embed_dim, m.image, m.normalize, recipe.data.grid_drop_max, recipe.data.size_augment
            )
        if m.text.kind in ("bigru", "bow"):
            if not spec.vocab_words:
                raise ValueError(f"a {m.text.kind} text encoder needs a vocabulary (DataSpec.vocab_words)")
            encoder = BiGRUTextEncoder if m.text.kind == "bigru" else BagOfWordsTextEncoder
            self.text_encoder = encoder(len(spec.vocab_words), m.embed_dim, m.text, m.normalize, form)
        else:
            self.text_encoder = TransformerTextEncoder(m.embed_dim, m.text, m.normalize, spec.text_model_path, form)
            self.spec.text_model_path = self.text_encoder.model_path
        self.sim = create_similarity(m.similarity, m.embed_dim, views)

    def encode_images(self, images: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
        return self.image_encoder(images, lengths, generator=generator)

    def encode_texts(self, tokens: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        return self.text_encoder(tokens, lengths)

    def similarity(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """[n_images, n_captions] under the run's own similarity (cosine, or AEOM for multi-view runs).

        Image embeddings [n_images, views x D] and caption embeddings [n_captions, D], as the encoders give them
        (torch or numpy; different float dtypes are promoted); other shapes are a `ModelInputError` naming the
        side (shape checks only, no host sync)."""
        from vsekit.models.inputs import check_similarity_inputs

        image_emb, text_emb = check_similarity_inputs(self, image_emb, text_emb)
        return self.sim(image_emb, text_emb)

    # the open_clip-style face (`vsekit.load(run)`); input rules in vsekit.models.inputs
    def encode_image(self, images, lengths=None, **kwargs) -> torch.Tensor:
        """Precomputed features [B, R, D] (+ lengths) or pixels [B, 3, S, S] (or pictures: PIL images or paths)
        -> image embeddings; what is accepted, converted and refused: `vsekit.api.encode_image`."""
        from vsekit.models.inputs import encode_image

        return encode_image(self, images, lengths, **kwargs)

    def encode_text(self, text, lengths=None) -> torch.Tensor:
        """A list of strings (tokenised with the run's vocabulary) or token ids [B, L] (+ lengths) -> [B, D];
        what is accepted and refused: `vsekit.api.encode_text`."""
        from vsekit.models.inputs import encode_text

        return encode_text(self, text, lengths)

    def tokenize(self, texts) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids [B, L], lengths [B]) as the run's text encoder expects them."""
        from vsekit.models.inputs import tokenize

        return tokenize(self, texts)

    def preprocess(self, image) -> torch.Tensor:
        """A picture (path or PIL image) -> the pixel tensor [3, S, S] of a pixel run."""
        from vsekit.models.inputs import preprocess

        return preprocess(self, image)

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
