"""The Python face of a run, in the open_clip habit: `vsekit.load(run)` -> a model with `encode_image`,
`encode_text`, `similarity`, plus the `tokenize` and `preprocess` that run needs.

    import vsekit
    model = vsekit.load("runs/x")
    img = model.encode_image(features, lengths)       # precomp [B, R, D] (+ lengths), or pixels [B, 3, S, S]
    txt = model.encode_text(["a dog on a beach"])      # strings, or token ids [B, L] + lengths
    sims = model.similarity(img, txt)                  # [n_images, n_captions]

The CLI, evaluation and search use the same run loading (`vsekit.runs.load_run`).

What each method takes, converts and refuses (a `ModelInputError` naming the argument) is written once, in
`vsekit.models.inputs`, whose functions the model's methods call and this module re-exports.
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
