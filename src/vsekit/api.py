"""The Python face of a run, in the open_clip habit: `vsekit.load(run)` -> a model with `encode_image`,
`encode_text`, `similarity`, plus the `tokenize` and `preprocess` that run needs.

    import vsekit
    model = vsekit.load("runs/x")
    img = model.encode_image(features, lengths)       # precomp [B, R, D] (+ lengths), or pixels [B, 3, S, S]
    txt = model.encode_text(["a dog on a beach"])      # strings, or token ids [B, L] + lengths
    sims = model.similarity(img, txt)                  # [n_images, n_captions]

The CLI, evaluation and search use the same run loading (`vsekit.runs.load_run`).

What each method takes (anything else is a `ModelInputError`, a `VseInputError` whose one-line message names
the argument and what is wrong; a value of a type the API never takes is a `ModelInputTypeError`, which is
also a TypeError). Valid input is used exactly as given: the checks never change an embedding.

- `encode_image`, runs on precomputed features: a real-valued tensor or numpy array [B, R, D] with D the
  run's feature width, B >= 1, R >= 1, every value finite; `lengths` [B] integers in 1..R (default R). A 2-D
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
  them (W = D, or views x D for AVSE runs).
- `preprocess`: a PIL image or a path to a picture, of any size and mode.
"""

from __future__ import annotations

from pathlib import Path

import torch

from vsekit.models.inputs import (  # noqa: F401  (the API's names; the model's methods use the same functions)
    ModelInputError,
    ModelInputTypeError,
    check_similarity_inputs,
    encode_image,
    encode_text,
    model_device,
    preprocess,
    tokenize,
)
from vsekit.models.vse import VSEModel


def load(run: str | Path, device: str | torch.device = "cpu", checkpoint: str = "best") -> VSEModel:
    """A trained or imported run as a model in eval mode on `device` (`checkpoint`: best | last)."""
    from vsekit.runs import load_run
    from vsekit.utils.runtime import resolve_device

    model, cfg = load_run(run, checkpoint, resolve_device(str(device)))
    model.run_config = cfg
    return model
