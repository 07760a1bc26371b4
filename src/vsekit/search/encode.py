"""Pictures and queries -> model embeddings, through exactly the inputs the model was trained on.

A model trained on precomputed features never saw pixels: its run records the dataset's feature extractor
(`extractor` in RUN/config.json, copied from the dataset manifest), and raw pictures go through that
extractor first, made again from that spec by `vsekit.features.extractor.extractor_from_spec` (for openclipart:
EfficientNet-Lite0 grid at 224 px, alpha on white, ImageNet mean/std, stored as float16 — the same prepare and
run the builder used, so the features match the training ones bit for bit). A model with a pixel backbone
takes the pictures directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from vsekit.data.manifest import read_manifest_extractor
from vsekit.data.pictures import (  # noqa: F401  (public here too: the search page and tests use them)
    MAX_IMAGE_PIXELS,
    PICTURE_SUFFIXES,
    backbone_pixels,
    open_bounded,
    open_image,
)
from vsekit.errors import VseInputError
from vsekit.models.vse import VSEModel
from vsekit.registry import has_fact

IMAGE_SUFFIXES = PICTURE_SUFFIXES  # what `vse index FOLDER` takes as pictures
SUPPORTED_EXTRACTORS = ("efficientnet_lite0_grid",)


def needs_rerank(model: VSEModel) -> bool:
    """True when the model's similarity is not a plain inner product (AEOM, CHAN: it does not declare the fact
    `inner_product`), so an index can only shortlist."""
    return not has_fact("similarity", model.recipe.model.similarity.name, "inner_product")


def scores_sets(model: VSEModel) -> bool:
    """True when the model embeds a picture as a set of region vectors and a caption as a set of word vectors
    (late interaction, e.g. CHAN): its similarity declares the fact `takes_sets`."""
    return has_fact("similarity", model.recipe.model.similarity.name, "takes_sets")


def pad_set_width(sets: torch.Tensor, width: int) -> torch.Tensor:
    """Sets [N, S, D] padded with zero rows (the sets' padding) to [N, width, D]; wider sets are an error."""
    if sets.shape[1] > width:
        raise ValueError(f"a set of {sets.shape[1]} elements does not fit a width of {width}")
    return torch.nn.functional.pad(sets, (0, 0, 0, width - sets.shape[1]))


def proxy_vectors(model: VSEModel, image_emb: torch.Tensor) -> torch.Tensor:
    """[N, D] vectors for the inner-product index.

    Cosine models: the embedding itself (the index is then exact). AEOM: the mean of the image's views,
    L2-normalised — a shortlist key only; the engine re-scores the shortlist with `model.similarity`
    (`vsekit.search.proxies.picture_proxies`, the one rule; float32 on the CPU).
    """
    from vsekit.search.proxies import picture_proxies

    views_of = model.recipe.model.embed_dim if needs_rerank(model) else None
    return torch.from_numpy(picture_proxies(image_emb, views_of))


def run_extractor_spec(run_cfg: dict) -> dict | None:
    """Extractor recorded by the run, else the one in its training dataset's manifest (if still there)."""
    spec = run_cfg.get("extractor")
    if isinstance(spec, dict) and spec.get("name"):
        return spec
    data_dir = run_cfg.get("data_dir")
    if data_dir and Path(data_dir).is_dir():
        return read_manifest_extractor(data_dir)
    return None


def same_extractor(a: dict | None, b: dict | None) -> bool:
    """Two specs make interchangeable features (same net, weights, input size, layer)."""
    if not a or not b:
        return False
    keys = ("name", "weights_sha256", "image_size", "layer", "dim")
    return all(a.get(k) == b.get(k) for k in keys)


class ImageEmbedder:
    """Raw pictures -> image embeddings [B, F] (F = flattened image embedding) of one model."""

    def __init__(self, model: VSEModel, run_cfg: dict, device: str | torch.device = "cpu") -> None:
        self.model = model
        self.device = torch.device(device)
        img_cfg = model.recipe.model.image
        self.extractor = None
        self.spec: dict[str, Any] | None = None
        if has_fact("image_encoder", img_cfg.kind, "reads_pixels"):  # pixels in: a backbone, or AVSE's ViT
            from vsekit.features.backbones import pixel_transform_of

            self.mode = "backbone"
            self.image_size = img_cfg.image_size
            self.transform = pixel_transform_of(model)
        else:
            spec = run_extractor_spec(run_cfg)
            if spec is None:
                raise VseInputError(
                    "this run was trained on precomputed features and records no feature extractor (no 'extractor' "
                    "in its config.json nor in its dataset's manifest.json), so it cannot embed raw pictures; "
                    "index a dataset split with features instead (DATASET_DIR:SPLIT)"
                )
            if spec.get("name") not in SUPPORTED_EXTRACTORS:
                raise VseInputError(
                    f"feature extractor {spec.get('name')!r} is not supported for raw pictures "
                    f"(supported: {', '.join(SUPPORTED_EXTRACTORS)})"
                )
            from vsekit.features.extractor import extractor_from_spec

            self.extractor = extractor_from_spec(
                spec, device=self.device
            )  # refuses other weights in one line
            self.image_size = self.extractor.image_size
            local = self.extractor.spec
            if model.spec.img_dim != local["dim"]:
                raise VseInputError(
                    f"the extractor makes {local['dim']}-d features but the model expects {model.spec.img_dim}"
                )
            self.mode = "extractor"
            self.spec = spec

    def describe(self) -> dict:
        if self.mode == "backbone":
            return {"mode": "backbone", "image_size": self.image_size, "transform": self.transform.describe()}
        return {"mode": "extractor", "extractor": self.spec}

    def load(self, path: str | Path) -> torch.Tensor:
        """[3, S, S] input of one picture; DataFormatError naming the file when it cannot be read."""
        return self.prepare(open_image(path))

    def prepare(self, img: Image.Image) -> torch.Tensor:
        """The model's evaluation-time input: the extractor's preprocessing, or `load_pixels` for backbones."""
        if self.mode == "backbone":
            return backbone_pixels(img, self.image_size, self.transform)
        return self.extractor.prepare(img)

    @torch.no_grad()
    def embed(self, pixels: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] -> the model's image embeddings ([B, D], or [B, views, D]) as float32 on the CPU."""
        pixels = pixels.to(self.device)
        if self.mode == "backbone":
            lengths = torch.full((pixels.shape[0],), -1, dtype=torch.long, device=self.device)
            out = self.model.encode_images(pixels, lengths)
        else:
            stored = self.extractor.run(
                pixels
            )  # float16, exactly as the dataset's builder stored its features
            feats = torch.from_numpy(stored).to(self.device).float()
            lengths = torch.full((feats.shape[0],), feats.shape[1], dtype=torch.long, device=self.device)
            out = self.model.encode_images(feats, lengths)
        return out.float().cpu()


@torch.no_grad()
def embed_features(
    model: VSEModel, feats: list[np.ndarray], device: str | torch.device = "cpu"
) -> torch.Tensor:
    """Precomputed feature sets [(R_i, D)] -> image embeddings as float32 on the CPU."""
    from vsekit.data.datasets import pad_sets

    x, lengths = pad_sets([torch.from_numpy(np.array(f, dtype=np.float32)) for f in feats])  # a writable copy
    return model.encode_images(x.to(device), lengths.to(device)).float().cpu()


class TextEmbedder:
    """Queries or captions -> text embeddings [N, D], with the model's own tokeniser."""

    def __init__(self, model: VSEModel, device: str | torch.device = "cpu") -> None:
        from vsekit.evaluation import pad_id_for, text_processor_for

        self.model = model
        self.device = torch.device(device)
        self.text = text_processor_for(model)
        self.pad_id = pad_id_for(self.text)

    @torch.no_grad()
    def embed(self, texts: list[str], batch_size: int = 256) -> torch.Tensor:
        """[N, D] (or word-vector sets [N, S, D], padded to the widest) through evaluation's one caption
        encoder (`vsekit.evaluation.encode_captions`: tokenise, pad, encode in batches)."""
        from vsekit.evaluation import encode_captions

        if not texts:
            return torch.zeros((0, self.model.recipe.model.embed_dim))
        return encode_captions(self.model, list(texts), self.text, batch_size, self.device)

    def embed_keys(self, texts: list[str], batch_size: int = 256) -> np.ndarray:
        """One float32 vector [N, D] per text, what an index stores and searches captions by: the embedding, or
        for a model of sets the normalised mean of its word vectors (`vsekit.search.proxies.query_proxies`)."""
        from vsekit.search.proxies import query_proxies

        keys = [
            query_proxies(
                self.embed(texts[start : start + batch_size], batch_size),
                self.model.recipe.model.embed_dim,
                scores_sets(self.model),
            )
            for start in range(0, len(texts), batch_size)
        ]
        if not keys:
            return np.zeros((0, self.model.recipe.model.embed_dim), dtype=np.float32)
        return np.ascontiguousarray(np.concatenate(keys), dtype=np.float32)

    def unknown_words(self, text: str) -> list[str]:
        """Words a BiGRU vocabulary maps to <unk> (they carry no meaning for the model)."""
        from vsekit.data.text import Vocabulary, tokenize_words

        if not isinstance(self.text, Vocabulary):
            return []
        return [
            w
            for w in tokenize_words(text, self.text.tokenizer)
            if w.isalnum() and w not in self.text.word2idx
        ]
