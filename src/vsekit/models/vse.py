"""A VSE model = image encoder + text encoder + similarity, assembled from a recipe.

The trainer, evaluation and search only talk to this interface: `encode_images`, `encode_texts`,
`similarity`. Methods differ only in the parts the recipe names. The encoders return pooled vectors; the
model owns what follows them, once for every encoder: the L2 normalisation (`model.normalize`,
`model.l2_form`) and IN2R's centring (`model.centre`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from vsekit import registry
from vsekit.config import Recipe
from vsekit.models.centring import EmbeddingCentring
from vsekit.models.image import BackboneImageEncoder
from vsekit.models.norm import l2_normalize_views
from vsekit.models.text import TransformerTextEncoder
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
        # the encoders the recipe names (vsekit.models.image_parts, text_parts), built by their registered builders
        self.image_encoder = registry.get("image_encoder", m.image.kind).build(recipe, spec)
        self.text_encoder = registry.get("text_encoder", m.text.kind).build(recipe, spec)
        self.sim = create_similarity(m.similarity, m.embed_dim, m.image.views)
        # IN2R's batch-mean centring before a last L2 normalisation (vsekit.models.centring); None: off
        # (one embedding per image: validate_recipe refuses it with several views)
        self.centring = EmbeddingCentring(m.embed_dim) if m.centre == "batch" else None

    def _output(self, x: torch.Tensor, side: str, encoder: nn.Module) -> torch.Tensor:
        """An encoder's pooled output as the model's embedding: L2-normalised (`model.normalize`, in the form
        `model.l2_form`; each view on its own, each vector of a set), unless the encoder ends in a norm of its
        own (`own_output_norm`: AVSE's caption LayerNorm); then centred (`model.centre: batch`)."""
        m = self.recipe.model
        if m.normalize and not getattr(encoder, "own_output_norm", False):
            x = l2_normalize_views(x, m.l2_form, m.image.views if side == "image" else 1)
        return x if self.centring is None else self.centring(x, side)

    def encode_images(
        self,
        images: torch.Tensor,
        lengths: torch.Tensor,
        generator: torch.Generator | None = None,
        **kwargs,
    ) -> torch.Tensor:
        """[B, views x D] image embeddings; `kwargs` go to the encoder (a ViT's `view_indices`)."""
        x = self.image_encoder(images, lengths, generator=generator, **kwargs)
        return self._output(x, "image", self.image_encoder)

    def encode_texts(
        self, tokens: torch.Tensor, lengths: torch.Tensor, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        # an encoder with random draws of its own in training (ESA's caption copies) takes the step's generator
        if getattr(self.text_encoder, "draws_in_training", False):
            x = self.text_encoder(tokens, lengths, generator=generator)
        else:
            x = self.text_encoder(tokens, lengths)
        return self._output(x, "text", self.text_encoder)

    def uncentred(self) -> contextlib.AbstractContextManager:
        """While inside, `encode_images` / `encode_texts` return the encoders' own outputs, before the
        centring of `model.centre: batch` (IN2R's split pass centres each of its batches itself)."""
        return self.centring.bypass() if self.centring is not None else contextlib.nullcontext()

    @contextlib.contextmanager
    def capture_sets(self) -> Iterator[dict[str, tuple[torch.Tensor, torch.Tensor]]]:
        """While inside, `sets["image"]` / `sets["text"]` hold the (local features [B, N, D], lengths) each
        encoder hands its pooling, from the last forward pass: what a loss that reads the sets is given."""
        sets: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        hooks = []
        for side, encoder in (("image", self.image_encoder), ("text", self.text_encoder)):
            pool = getattr(encoder, "pool", None)
            if not isinstance(pool, nn.Module):
                raise ValueError(
                    f"the {side} encoder {type(encoder).__name__} has no pooling whose set a loss could read"
                )

            def keep(module: nn.Module, args: tuple, output: torch.Tensor, side: str = side) -> None:
                sets[side] = (args[0], args[1])

            hooks.append(pool.register_forward_hook(keep))
        try:
            yield sets
        finally:
            for hook in hooks:
                hook.remove()

    def similarity(self, image_emb: torch.Tensor, text_emb: torch.Tensor) -> torch.Tensor:
        """[n_images, n_captions] under the run's own similarity (cosine, AEOM for multi-view runs, or a late
        interaction of sets such as CHAN's).

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
        return [
            {"params": ps, "lr": lr * mult, "lr_mult": mult}
            for mult, ps in sorted(groups.items(), reverse=True)
        ]
