"""What `encode_image`, `encode_text`, `similarity`, `tokenize` and `preprocess` of a `VSEModel` take: each
input is checked (dtype, range, size, finiteness, shape) or converted where the intent is unambiguous, with
one-line errors naming the argument. The model's methods call these; `vsekit.api` re-exports them.
What each method takes (anything else is a `ModelInputError`, a `VseInputError` whose one-line message names
the argument and what is wrong; a value of a type the API never takes is a `ModelInputTypeError`, which is
also a TypeError). Valid input is used exactly as given: the checks never change an embedding.

- `encode_image`, runs on precomputed features: a floating-point tensor or numpy array [B, R, D] with D the
  run's feature width, B >= 1, R >= 1, every value finite (integer dtypes are refused: uint8 is pixels); `lengths` [B] integers in 1..R (default R). A 2-D
  array is refused rather than guessed: one picture's R regions is `x[None]`, one vector per picture `x[:, None]`.
- `encode_image`, pixel runs (CNN backbone, ViT): pictures (PIL images or paths, alone or in a list), which
  go through the run's own transform (`preprocess`, any size); or a pixel tensor [B, 3, S, S] ([3, S, S]: one
  picture) at exactly the run's size S. uint8 pixels (0-255) are scaled as the transform scales pictures
  (/255, then the run's mean/std); float pixels must already be normalised that way, finite, and within a
  few times the normalised range (0-255 floats are refused: give them as uint8).
- `encode_text`: a string or a non-empty list of strings (valid Unicode: no lone surrogates), or integer
  token ids [B, L] (B, L >= 1) within the run's vocabulary and, for transformers, its position table; `lengths`
  [B] integers in 1..L (default: up to the first pad id 0).
- `similarity`: image embeddings [n_images, W] and caption embeddings [n_captions, D] as the encoders give
  them (W = D, or views x D for AVSE runs; for late-interaction runs (CHAN) sets [n, set size, D] whose zero
  rows are padding), every value finite (checked in eval mode, the mode `vsekit.load`
  gives; the train step's calls stay free of host syncs).
- `preprocess`: a PIL image or a path to a picture, of any size and mode.

In eval mode (what `vsekit.load` gives) `encode_text` and `encode_image` encode in chunks of `ENCODE_CHUNK`
items without autograd (`torch.no_grad`) and concatenate them, so memory grows with the chunk, not with the
list, and the result carries no graph (unless `encode_image` is given features or pixels that require grad:
then gradients reach them); its rows equal one batch's (every encoder is row-independent in eval mode). `torch.no_grad` rather than `inference_mode`: the result stays an ordinary tensor, which a caller may
change in place or use in a later graph. In train mode a call stays one batch with gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from vsekit import registry
from vsekit.errors import VseInputError
from vsekit.models.image_parts import reads_pixels

VSEModel = nn.Module  # the model these rules serve (`vsekit.models.vse.VSEModel`, which calls them)


ENCODE_CHUNK = 256
"""Items `encode_text` / `encode_image` put through the encoder at once in eval mode: memory grows with the
chunk, not with the list (10^5 captions at once held +2.27 GB of activations before an allocator error)."""


class ModelInputError(VseInputError):
    """A value the run's model cannot take (one line naming the argument and the problem)."""


class ModelInputTypeError(ModelInputError, TypeError):
    """A value of a type the API never takes (also a TypeError)."""


def _as_tensor(x: Any, what: str) -> torch.Tensor:
    """`x` as a tensor, its dtype kept (numpy arrays shared, not copied where possible)."""
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, np.ndarray):
        if x.dtype.kind not in "biufc":
            raise ModelInputTypeError(f"{what}: a numpy array of dtype {x.dtype} is not numbers")
        return torch.from_numpy(np.ascontiguousarray(x))
    raise ModelInputTypeError(f"{what}: expected a torch.Tensor or numpy array, got {type(x).__name__}")


def _integers(x: Any, what: str) -> torch.Tensor:
    """Integer values as a long tensor: integer dtypes, or floats that hold whole numbers; lists accepted."""
    if isinstance(x, (list, tuple)) and all(
        isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in x
    ):
        x = np.asarray(x, dtype=np.int64)
    t = _as_tensor(x, what)
    if t.dtype == torch.bool or t.is_complex():
        raise ModelInputError(f"{what} must be integers, got dtype {t.dtype}")
    if t.is_floating_point():
        if not bool(((t == t.round()) & torch.isfinite(t)).all()):
            raise ModelInputError(
                f"{what} must be whole numbers, got dtype {t.dtype} with fractional or non-finite values"
            )
    return t.long()


def _check_lengths(lengths: Any, batch: int, longest: int, device: torch.device, what: str) -> torch.Tensor:
    """Set sizes [batch] in 1..longest, as a long tensor on `device`."""
    lengths = _integers(lengths, what)
    host = lengths.detach().cpu()
    if tuple(host.shape) != (batch,) or int(host.min()) < 1 or int(host.max()) > longest:
        shown = (
            tuple(host.shape) if tuple(host.shape) != (batch,) else f"{int(host.min())}..{int(host.max())}"
        )
        raise ModelInputError(f"{what} must be [batch]={batch} values in 1..{longest}, got {shown}")
    return lengths.to(device)


def _count_bad(x: torch.Tensor) -> str:
    """'n of N values' that are NaN or infinite, for a message."""
    return f"{int((~torch.isfinite(x)).sum())} of {x.numel()} values"


def _check_strings(texts: Any, what: str) -> list[str]:
    """A non-empty list of valid Unicode strings (a lone surrogate cannot be encoded, so no tokenizer can
    take it), or one line naming the first bad item."""
    if isinstance(texts, str):
        texts = [texts]
    elif isinstance(texts, np.ndarray) and texts.dtype.kind == "U" and texts.ndim == 1:
        texts = texts.tolist()
    if not isinstance(texts, (list, tuple)):
        raise ModelInputTypeError(
            f"{what}: expected a string or a list of strings, got {type(texts).__name__}"
        )
    if not texts:
        raise ModelInputError(f"{what}: the list of texts is empty")
    for i, t in enumerate(texts):
        if not isinstance(t, str):
            raise ModelInputTypeError(f"{what}: text[{i}] is {type(t).__name__}, not a string")
        if not t.isascii():
            try:
                t.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ModelInputError(
                    f"{what}: text[{i}] is not valid Unicode: a lone surrogate {t[e.start]!r} at "
                    f"position {e.start} (decode the bytes as UTF-8 first)"
                ) from None
    return list(texts)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def tokenize(model: VSEModel, texts: str | list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    """(token ids [B, L] padded, lengths [B]) with the run's own vocabulary or tokenizer.

    `texts`: a string or a non-empty list of strings, each valid Unicode (a lone surrogate such as "\\ud800"
    is refused: no tokenizer can encode it)."""
    return _tokenize(model, texts, "tokenize")


def _tokenize(model: VSEModel, texts: Any, what: str) -> tuple[torch.Tensor, torch.Tensor]:
    from vsekit.data.datasets import pad_tokens
    from vsekit.models.tokenizers import pad_id_for, text_processor_for

    texts = _check_strings(texts, what)
    processor = getattr(model, "_text_processor", None)
    if processor is None:
        processor = text_processor_for(model)
        model._text_processor = processor
    ids = [torch.tensor(processor.encode(t), dtype=torch.long) for t in texts]
    return pad_tokens(ids, pad_id_for(processor))


def text_vocab_size(model: VSEModel) -> int:
    """Rows of the text encoder's token embedding table: token ids must be below it."""
    enc = model.text_encoder
    table = getattr(enc, "embed", None)
    if table is None:
        table = enc.body.get_input_embeddings()
    return int(table.num_embeddings)


def text_positions(model: VSEModel) -> int | None:
    """Length of a transformer text body's position table (None: no limit known)."""
    body = getattr(model.text_encoder, "body", None)
    n = getattr(getattr(body, "config", None), "max_position_embeddings", None)
    return int(n) if isinstance(n, int) and n > 0 else None


def _token_ids(model: VSEModel, text: Any) -> torch.Tensor:
    """Token ids [B, L] checked against the run's text encoder (dtype, shape, vocabulary, positions)."""
    if isinstance(text, (list, tuple)):
        kinds = sorted({type(t).__name__ for t in text})
        raise ModelInputTypeError(
            f"encode_text: a list of {', '.join(kinds)} is not text: give strings, or token ids "
            "[batch, length] as a torch.Tensor or numpy array"
        )
    tokens = _as_tensor(text, "encode_text")
    if tokens.dtype == torch.bool or tokens.is_floating_point() or tokens.is_complex():
        raise ModelInputError(f"encode_text: token ids must be integers, got dtype {tokens.dtype}")
    if tokens.ndim != 2:
        hint = " (one caption: ids[None])" if tokens.ndim == 1 else ""
        raise ModelInputError(
            f"encode_text: token ids must be [batch, length], got {tuple(tokens.shape)}{hint}"
        )
    if 0 in tokens.shape:
        raise ModelInputError(
            f"encode_text: token ids {tuple(tokens.shape)} are empty: need at least one caption "
            "of at least one token"
        )
    vocab = text_vocab_size(model)
    lo, hi = (int(v) for v in torch.stack(torch.aminmax(tokens)).tolist())
    if lo < 0 or hi >= vocab:
        raise ModelInputError(
            f"encode_text: token id {lo if lo < 0 else hi} is outside this run's vocabulary "
            f"(ids 0..{vocab - 1})"
        )
    positions = text_positions(model)
    if positions is not None and tokens.shape[1] > positions:
        raise ModelInputError(
            f"encode_text: token ids are {tokens.shape[1]} long, but this run's text model has "
            f"{positions} positions"
        )
    return tokens


def encode_text(model: VSEModel, text: Any, lengths: Any = None) -> torch.Tensor:
    """Caption embeddings [B, D] from strings or from token ids [B, L] (lengths default: up to the first pad).

    `text`: a string, a non-empty list of strings (valid Unicode), or integer token ids [B, L] (torch or numpy;
    B, L >= 1) within the run's vocabulary and, for a transformer, its position table. `lengths`: [B] integers
    in 1..L. Anything else is a `ModelInputError` naming the argument."""
    device = model_device(model)
    if (
        isinstance(text, str)
        or (isinstance(text, (list, tuple)) and any(isinstance(t, str) for t in text))
        or (isinstance(text, np.ndarray) and text.dtype.kind == "U")
    ):
        texts = _check_strings(text, "encode_text")
        if model.training:  # one batch, as before (`_encode_in_chunks`)
            tokens, lengths = _tokenize(model, texts, "encode_text")
        else:  # tokenised chunk by chunk too: the padded ids of 10^5 captions are not built at once

            def strings(rows: slice) -> torch.Tensor:
                ids, sizes = _tokenize(model, texts[rows], "encode_text")
                sizes = _check_lengths(sizes, ids.shape[0], ids.shape[1], device, "encode_text: lengths")
                return model.encode_texts(ids.to(device), sizes)

            return _encode_in_chunks(model, len(texts), strings)
    elif isinstance(text, (list, tuple)) and not text:
        raise ModelInputError("encode_text: the list of texts is empty")
    else:
        tokens = _token_ids(model, text).to(device=device, dtype=torch.long)
        if lengths is None:
            lengths = (tokens != 0).sum(1).clamp(min=1)
    lengths = _check_lengths(lengths, tokens.shape[0], tokens.shape[1], device, "encode_text: lengths")
    tokens = tokens.to(device)
    return _encode_in_chunks(
        model, tokens.shape[0], lambda rows: model.encode_texts(tokens[rows], lengths[rows])
    )


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """The chunks' embeddings as one batch; sets of different sizes ([n, set, D], late-interaction runs) are
    padded with zero rows, the padding such sets already use."""
    if len(parts) == 1:
        return parts[0]
    if parts[0].ndim >= 3 and len({p.shape[1] for p in parts}) > 1:
        longest = max(p.shape[1] for p in parts)
        parts = [torch.nn.functional.pad(p, (0, 0, 0, longest - p.shape[1])) for p in parts]
    return torch.cat(parts)


def _encode_in_chunks(
    model: VSEModel, n: int, encode: Callable[[slice], torch.Tensor], graph: bool = False
) -> torch.Tensor:
    """`encode(rows)` over chunks of `ENCODE_CHUNK` rows, concatenated, without autograd: for a model in eval
    mode (what `vsekit.load` gives), so memory grows with the chunk and the result holds no graph. `graph`
    (an input that requires grad: the caller asks for gradients through the encoder) keeps the graph, still
    in chunks. In train mode the call is one batch with gradients, as before (BatchNorm's batch statistics
    would change with the chunks)."""
    if model.training:
        return encode(slice(0, n))
    with torch.enable_grad() if graph else torch.no_grad():
        return _concat([encode(slice(i, min(i + ENCODE_CHUNK, n))) for i in range(0, n, ENCODE_CHUNK)])


def _pictures(model: VSEModel, images: Any) -> torch.Tensor | None:
    """Pictures (a PIL image or path, or a list of them) as pixels [B, 3, S, S] through the run's own
    transform; None when `images` is not pictures."""
    from PIL import Image

    one = (Image.Image, str, Path)
    if isinstance(images, one):
        images = [images]
    elif not (isinstance(images, (list, tuple)) and images and all(isinstance(im, one) for im in images)):
        return None
    return torch.stack([_preprocess(model, im, "encode_image") for im in images])


def pixel_limit(model: VSEModel) -> float:
    """The largest |value| float pixels may hold: 4x the farthest a picture reaches after the run's
    normalisation ((0 - mean) / std or (1 - mean) / std; 2.64 for ImageNet's, so about 10.6). Pixels in
    0..255 go far past it; normalised pixels, even with augmentation or noise, do not."""
    from vsekit.features.backbones import pixel_transform_of

    t = pixel_transform_of(model)
    return 4.0 * max(max(abs(m / s), abs((1.0 - m) / s)) for m, s in zip(t.mean, t.std))


def _pixels(model: VSEModel, images: Any, device: torch.device) -> torch.Tensor:
    """Pixels [B, 3, S, S] float32 on `device`, checked (size, dtype, finiteness, range) or converted (pictures,
    uint8)."""
    from vsekit.features.backbones import pixel_transform_of

    size = int(model.recipe.model.image.image_size)
    pictures = _pictures(model, images)
    x = pictures if pictures is not None else _as_tensor(images, "encode_image")
    if x.ndim == 3 and x.shape[0] == 3:  # one picture [3, S, S], as `preprocess` returns it
        x = x.unsqueeze(0)
    if x.ndim != 4 or x.shape[1] != 3:
        raise ModelInputError(
            f"encode_image: this run takes pixels [batch, 3, height, width], got {tuple(x.shape)}"
        )
    if x.shape[0] == 0:
        raise ModelInputError("encode_image: the batch is empty (0 pictures)")
    if tuple(x.shape[2:]) != (size, size):
        raise ModelInputError(
            f"encode_image: pixels are {x.shape[2]}x{x.shape[3]} but this run takes {size}x{size}: "
            "give the pictures themselves (PIL images or paths) or model.preprocess(picture), "
            "which resize with the run's own transform"
        )
    if x.dtype == torch.uint8:
        t = pixel_transform_of(model)
        mean = torch.tensor(t.mean, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        std = torch.tensor(t.std, dtype=torch.float32, device=device).view(1, 3, 1, 1)
        return (x.to(device=device, dtype=torch.float32) / 255.0 - mean) / std
    if not x.is_floating_point():
        raise ModelInputError(
            f"encode_image: pixels of dtype {x.dtype}: give float pixels normalised as "
            "model.preprocess makes them, or uint8 pixels in 0..255 (scaled for you)"
        )
    x = x.to(device=device, dtype=torch.float32)
    peak, limit = float(x.detach().abs().amax()), pixel_limit(model)
    if not peak <= limit:  # one host sync: NaN and inf fail this too
        if not math.isfinite(peak):
            raise ModelInputError(f"encode_image: pixels hold NaN or inf ({_count_bad(x)})")
        raise ModelInputError(
            f"encode_image: pixel values reach {peak:.4g}, far outside the run's normalised "
            f"range (|x| <= {limit:.3g}): pixels in 0..255 go in as uint8 (scaled and "
            "normalised for you), pictures through model.preprocess"
        )
    return x


def _features(
    model: VSEModel, images: Any, lengths: Any, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Precomputed features [B, R, D] float32 and lengths [B], checked."""
    from PIL import Image

    if isinstance(images, (Image.Image, str, Path)):
        _preprocess(
            model, images, "encode_image"
        )  # raises: this run takes precomputed features, not pictures
    dim = model.spec.img_dim
    x = _as_tensor(images, "encode_image")
    if x.ndim == 2 and x.shape[-1] == dim:
        raise ModelInputError(
            f"encode_image: features {tuple(x.shape)} are 2-D but this run takes sets [batch, "
            f"regions, {dim}]: one picture's regions are x[None] ([1, {x.shape[0]}, {dim}]), "
            f"one vector per picture x[:, None] ([{x.shape[0]}, 1, {dim}])"
        )
    if x.ndim != 3 or x.shape[-1] != dim:
        raise ModelInputError(
            f"encode_image: this run takes features [batch, regions, {dim}], got {tuple(x.shape)}"
        )
    if x.shape[0] == 0 or x.shape[1] == 0:
        raise ModelInputError(
            f"encode_image: features {tuple(x.shape)} are empty: need at least one picture of "
            "at least one region"
        )
    if x.dtype == torch.bool or x.is_complex():
        raise ModelInputError(f"encode_image: features must be real numbers, got dtype {x.dtype}")
    if (
        not x.is_floating_point()
    ):  # uint8 is pixels, which a feature run cannot take; no extractor writes integers
        raise ModelInputError(
            f"encode_image: features of dtype {x.dtype}: this run takes precomputed float features "
            f"[batch, regions, {dim}] from its feature extractor, not pixels or integers "
            "(docs/data.md)"
        )
    x = x.to(device=device, dtype=torch.float32)
    if not bool(torch.isfinite(x).all()):
        raise ModelInputError(f"encode_image: features hold NaN or inf ({_count_bad(x)})")
    if lengths is None:
        lengths = torch.full((x.shape[0],), x.shape[1], dtype=torch.long)
    return x, _check_lengths(lengths, x.shape[0], x.shape[1], device, "encode_image: lengths")


def encode_image(model: VSEModel, images: Any, lengths: Any = None, **kwargs: Any) -> torch.Tensor:
    """Image embeddings from precomputed features [B, R, D] (+ lengths) or pixels [B, 3, S, S].

    Precomputed-feature runs: finite floats [B, R, D] (B, R >= 1; a 2-D array is refused, not guessed),
    `lengths` [B] integers in 1..R. Pixel runs: pictures (PIL images or paths, alone or in a list) go through the
    run's transform at any size; a pixel tensor must be S x S (the run's size); uint8 pixels are scaled and
    normalised as the transform does (/255, then mean/std); float pixels must already be normalised, finite,
    and within 4x the normalised range. `kwargs`: `generator`, and `view_indices` for ViT runs. Anything else is
    a `ModelInputError` naming the argument."""
    device = model_device(model)
    kind = model.recipe.model.image.kind
    allowed = {"generator", *registry.fact("image_encoder", kind, "encode_kwargs", ())}
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise ModelInputTypeError(
            f"encode_image: unexpected argument {unknown[0]!r} (this run takes {', '.join(sorted(allowed))})"
        )
    if not reads_pixels(kind):
        x, lengths = _features(model, images, lengths, device)
    else:
        from PIL import Image

        if isinstance(images, (list, tuple)) and len(images) > ENCODE_CHUNK and not model.training:
            if all(isinstance(im, (Image.Image, str, Path)) for im in images):
                # pictures: each chunk preprocessed when it is encoded, never all their pixels at once
                return _encode_in_chunks(
                    model,
                    len(images),
                    lambda rows: encode_image(model, list(images[rows]), None, **_rows_of(kwargs, rows)),
                )
        x = _pixels(model, images, device)
        lengths = torch.full((x.shape[0],), -1, dtype=torch.long, device=device)  # the grid is the set
    return _encode_in_chunks(
        model,
        x.shape[0],
        lambda rows: model.encode_images(x[rows], lengths[rows], **_rows_of(kwargs, rows)),
        graph=x.requires_grad and torch.is_grad_enabled(),
    )


def _rows_of(kwargs: dict[str, Any], rows: slice) -> dict[str, Any]:
    """The keyword arguments of one chunk: per-picture tensors (`view_indices` [B, V, n]) cut to its rows."""
    return {
        k: v[rows] if isinstance(v, torch.Tensor) and k == "view_indices" else v for k, v in kwargs.items()
    }


def _preprocess(model: VSEModel, image: Any, what: str) -> torch.Tensor:
    from PIL import Image

    from vsekit.data.pictures import backbone_pixels, open_image
    from vsekit.features.backbones import pixel_transform_of

    if not reads_pixels(model.recipe.model.image.kind):
        raise ModelInputError(
            f"{what}: this run takes precomputed features, not pictures: extract them with the "
            "run's feature extractor (see docs/data.md)"
        )
    if isinstance(image, (str, Path)):
        image = open_image(image)
    if not isinstance(image, Image.Image):
        raise ModelInputTypeError(
            f"{what}: expected a picture (a PIL image or the path to one), got {type(image).__name__}"
        )
    if image.width < 1 or image.height < 1:
        raise ModelInputError(f"{what}: the picture is {image.width}x{image.height} pixels: empty")
    return backbone_pixels(image, model.recipe.model.image.image_size, pixel_transform_of(model))


def preprocess(model: VSEModel, image: Any) -> torch.Tensor:
    """A picture (path or PIL image, any size or mode) -> the pixel tensor [3, S, S] a pixel run expects at
    evaluation: the run's own transform (resize to S x S, scale to 0..1, the backbone's mean/std)."""
    return _preprocess(model, image, "preprocess")


def check_similarity_inputs(
    model: VSEModel, image_emb: Any, text_emb: Any
) -> tuple[torch.Tensor, torch.Tensor]:
    """(image_emb, text_emb) as tensors of one dtype, or a `ModelInputError` naming the side whose shape is not
    what the run's encoders give ([n, views x D] and [n, D]), or, for a model in eval mode (as `vsekit.load`
    returns it), that holds NaN or inf: a NaN score would rank as nothing and silently. In train mode the
    checks are shapes only, without a host sync (the train step's similarity, CUDA-graph capture included)."""
    d = int(model.recipe.model.embed_dim)
    width = d * int(model.recipe.model.image.views)
    img = _as_tensor(image_emb, "similarity: image embeddings")
    txt = _as_tensor(text_emb, "similarity: caption embeddings")
    views = int(model.recipe.model.image.views)
    sets = registry.has_fact("similarity", model.recipe.model.similarity.name, "takes_sets")  # CHAN: sets
    for name, t, w in (("image", img, width), ("caption", txt, d)):
        if sets:
            if t.ndim != 3 or t.shape[2] != d or 0 in t.shape[:2]:
                raise ModelInputError(
                    f"similarity: {name} embeddings of this run are sets [n_{name}s, set size, {d}] "
                    f"as its encoders give them, got {tuple(t.shape)}"
                )
        elif name == "image" and views > 1 and t.ndim == 3 and tuple(t.shape[1:]) == (views, d):
            pass  # multi-view embeddings as [n, views, D] (what an index stores) are the same numbers
        elif t.ndim != 2 or t.shape[1] != w:
            raise ModelInputError(
                f"similarity: {name} embeddings must be [n_{name}s, {w}], got {tuple(t.shape)}"
            )
        if not t.is_floating_point():
            raise ModelInputError(
                f"similarity: {name} embeddings must be floating point, got dtype {t.dtype}"
            )
    if img.device != txt.device:
        raise ModelInputError(
            f"similarity: image embeddings are on {img.device}, caption embeddings on {txt.device}"
        )
    if not model.training:
        for name, t in (("image", img), ("caption", txt)):
            if not bool(torch.isfinite(t).all()):  # one host sync per side, as encode_image's checks
                raise ModelInputError(f"similarity: {name} embeddings hold NaN or inf ({_count_bad(t)})")
    if img.dtype != txt.dtype:
        common = torch.promote_types(img.dtype, txt.dtype)
        img, txt = img.to(common), txt.to(common)
    return img, txt
