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

import os
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
from vsekit.models.pair import MEMBERS
from vsekit.models.vse import VSEModel

CHECKPOINTS = ("best", "last")


def load(
    run: str | Path, device: str | torch.device = "cpu", checkpoint: str = "best", member: str | None = None
) -> VSEModel:
    """A trained or imported run as a model in eval mode on `device` (`checkpoint`: best | last). A
    two-network run (NCR) is the pair, scored as the mean of both networks' similarities; `member` "A" or
    "B" is one network alone.

    `run`: the run folder, a str or path; `device`: a device name (cpu, cuda, cuda:N, mps, auto) or a
    torch.device. Anything else is a `ModelInputError` naming the argument (a `ModelInputTypeError`, also a
    TypeError, for a value of the wrong type); a folder that is not a run, a `CheckpointError` naming it."""
    from vsekit.errors import check_device_name
    from vsekit.runs import load_run
    from vsekit.utils.runtime import resolve_device

    if not isinstance(run, (str, os.PathLike)):
        raise ModelInputTypeError(
            f"load: run must be the path of a run folder (str or pathlib.Path), got {type(run).__name__}"
        )
    if not str(run).strip():
        raise ModelInputError("load: run is an empty path; give the run folder (vse train --out)")
    if not isinstance(device, (str, torch.device)):
        raise ModelInputTypeError(
            f"load: device must be a name (cpu, cuda, cuda:N, mps, auto) or a torch.device, got "
            f"{type(device).__name__}"
        )
    if checkpoint not in CHECKPOINTS:
        raise ModelInputError(f"load: checkpoint {checkpoint!r}; choose one of {', '.join(CHECKPOINTS)}")
    check_device_name(str(device), "load: device", ModelInputError)
    if member is not None and member not in MEMBERS:
        raise ModelInputError(
            f"load: member {member!r}; choose one of {', '.join(MEMBERS)} (or None: the pair)"
        )
    model, cfg = load_run(run, checkpoint, resolve_device(str(device)), member)
    model.run_config = cfg
    return model
