"""The Python face of a run, in the open_clip habit: `vsekit.load(run)` -> a model with `encode_image`,
`encode_text`, `similarity`, plus the `tokenize` and `preprocess` that run needs.

    import vsekit
    model = vsekit.load("runs/x")
    img = model.encode_image(features, lengths)       # precomp [B, R, D] (+ lengths), or pixels [B, 3, S, S]
    txt = model.encode_text(["a dog on a beach"])      # strings, or token ids [B, L] + lengths
    sims = model.similarity(img, txt)                  # [n_images, n_captions]

The CLI, evaluation and search use the same run loading (`vsekit.training.checkpoint.load_run`).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vsekit.errors import VseInputError

if TYPE_CHECKING:
    from vsekit.models.vse import VSEModel


def load(run: str | Path, device: str | torch.device = "cpu", checkpoint: str = "best") -> VSEModel:
    """A trained or imported run as a model in eval mode on `device` (`checkpoint`: best | last)."""
    from vsekit.training.checkpoint import load_run
    from vsekit.utils.runtime import resolve_device

    model, cfg = load_run(run, checkpoint, resolve_device(str(device)))
    model.run_config = cfg
    return model


def _as_tensor(x: Any, dtype: torch.dtype, device: torch.device, what: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.to(device=device, dtype=dtype)
    if isinstance(x, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(x)).to(device=device, dtype=dtype)
    raise TypeError(f"{what}: expected a torch.Tensor or numpy array, got {type(x).__name__}")


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def tokenize(model: VSEModel, texts: str | list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B, L] padded, lengths [B]) with the run's own vocabulary or tokenizer."""
    from vsekit.data.datasets import pad_tokens
    from vsekit.evaluation import pad_id_for, text_processor_for

    if isinstance(texts, str):
        texts = [texts]
    if not texts or not all(isinstance(t, str) for t in texts):
        raise VseInputError("tokenize: expected a non-empty list of strings")
    processor = getattr(model, "_text_processor", None)
    if processor is None:
        processor = text_processor_for(model)
        model._text_processor = processor
    ids = [torch.tensor(processor.encode(t), dtype=torch.long) for t in texts]
    return pad_tokens(ids, pad_id_for(processor))


def encode_text(model: VSEModel, text: Any, lengths: Any = None) -> torch.Tensor:
    """Caption embeddings [B, D] from strings or from token ids [B, L] (lengths default: up to the first pad)."""
    device = model_device(model)
    if isinstance(text, str) or (isinstance(text, (list, tuple)) and text and isinstance(text[0], str)):
        tokens, lengths = tokenize(model, text)
    else:
        tokens = _as_tensor(text, torch.long, device, "encode_text")
        if tokens.ndim != 2:
            raise VseInputError(f"encode_text: token ids must be [batch, length], got {tuple(tokens.shape)}")
        if lengths is None:
            lengths = (tokens != 0).sum(1).clamp(min=1)
    lengths = _as_tensor(lengths, torch.long, device, "encode_text lengths")
    if lengths.shape != tokens.shape[:1] or int(lengths.min()) < 1 or int(lengths.max()) > tokens.shape[1]:
        raise VseInputError(f"encode_text: lengths must be [batch]={tokens.shape[0]} values in 1..{tokens.shape[1]}")
    return model.encode_texts(tokens.to(device), lengths)


def encode_image(model: VSEModel, images: Any, lengths: Any = None, **kwargs: Any) -> torch.Tensor:
    """Image embeddings from precomputed features [B, R, D] (+ lengths) or pixels [B, 3, S, S]."""
    device = model_device(model)
    x = _as_tensor(images, torch.float32, device, "encode_image")
    kind = model.recipe.model.image.kind
    if kind == "precomp":
        if x.ndim == 2:
            x = x.unsqueeze(0)
        if x.ndim != 3 or x.shape[-1] != model.spec.img_dim:
            raise VseInputError(f"encode_image: this run takes features [batch, regions, {model.spec.img_dim}], "
                             f"got {tuple(x.shape)}")  # fmt: skip
    elif x.ndim != 4 or x.shape[1] != 3:
        raise VseInputError(f"encode_image: this run takes pixels [batch, 3, height, width], got {tuple(x.shape)}")
    if lengths is None:
        lengths = torch.full((x.shape[0],), x.shape[1] if kind == "precomp" else -1, dtype=torch.long)
    lengths = _as_tensor(lengths, torch.long, device, "encode_image lengths")
    if kind == "precomp" and (lengths.shape != x.shape[:1] or int(lengths.min()) < 1 or int(lengths.max()) > x.shape[1]):
        raise VseInputError(f"encode_image: lengths must be [batch]={x.shape[0]} values in 1..{x.shape[1]}")
    return model.image_encoder(x, lengths, **kwargs)


def preprocess(model: VSEModel, image: Any) -> torch.Tensor:
    """A picture (path or PIL image) -> the pixel tensor [3, S, S] a pixel run expects at evaluation."""
    from vsekit.search.encode import backbone_pixels, open_image

    if model.recipe.model.image.kind == "precomp":
        raise VseInputError("this run takes precomputed features, not pictures: extract them with the run's "
                         "feature extractor (see docs/data.md)")  # fmt: skip
    img = open_image(image) if isinstance(image, (str, Path)) else image
    from vsekit.features.backbones import pixel_transform_of

    return backbone_pixels(img, model.recipe.model.image.image_size, pixel_transform_of(model))
