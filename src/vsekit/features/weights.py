"""Reading a local weights file for a CNN backbone (`--backbone-weights`, `model.image.backbone_weights`, the
packaged EfficientNet-Lite0 file): the one reader, so that any file that is not a checkpoint (a text file, a
picture, a pickle of objects, a truncated or empty file, a folder) is one line naming it, never a library's
KeyError or IndexError and never unpickled code.
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch
from torch import nn

from vsekit.errors import VseInputError

log = logging.getLogger(__name__)


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    line = text[0] if text else ""
    return f"{type(e).__name__}: {line[:160]}" if line else type(e).__name__


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a local weights file; safetensors (by its `.safetensors` suffix) or a plain state dict read with
    `weights_only=True` (a `{"state_dict": …}` wrapper is unwrapped). Anything else is a `VseInputError` naming
    the file."""
    path = Path(path)
    if not path.is_file():
        if path.exists():
            raise VseInputError(
                f"{path}: not a weights file ({'a folder' if path.is_dir() else 'not a regular file'})"
            )
        raise FileNotFoundError(f"{path}: backbone weights file not found")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        try:
            return load_file(str(path))
        except Exception as e:  # noqa: BLE001 - SafetensorError and friends: a file that is no safetensors
            raise VseInputError(f"{path}: not a readable safetensors file ({_first_line(e)})") from e
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (
        pickle.UnpicklingError
    ) as e:  # not a torch.save file, or one holding objects that are never unpickled
        log.debug("%s: torch.load refused it: %s", path, e)
        raise VseInputError(
            f"{path}: not a plain state dict of tensors: not a torch.save or safetensors file, "
            "or one holding Python objects (never unpickled)"
        ) from e
    except Exception as e:  # noqa: BLE001 - any other corruption (EOFError, KeyError, IndexError, RuntimeError…)
        raise VseInputError(
            f"{path}: not a plain state dict of tensors: it cannot be read as a torch.save file "
            f"({_first_line(e)})"
        ) from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if (
        not isinstance(state, dict)
        or not state
        or not all(isinstance(v, torch.Tensor) for v in state.values())
    ):
        if not isinstance(state, dict):
            found = f"a {type(state).__name__}"
        else:
            found = "an empty dict" if not state else "a dict of other values than tensors"
        raise VseInputError(f"{path}: not a plain state dict of tensors: it holds {found}")
    return state


def load_weights_strict(model: nn.Module, weights: str | Path, name: str) -> None:
    """Load `weights` (`load_state_dict_file`; a `module.` prefix of DataParallel is dropped) into `model`, every
    key and shape matching; else one line naming the file and what does not fit `name`."""
    state = {k.removeprefix("module."): v for k, v in load_state_dict_file(weights).items()}
    own = model.state_dict()
    shapes = [
        f"{k} {list(v.shape)} (the model's: {list(own[k].shape)})"
        for k, v in state.items()
        if k in own and tuple(v.shape) != tuple(own[k].shape)
    ]
    if shapes:
        raise VseInputError(f"{weights}: does not fit {name}: tensor shapes differ: {', '.join(shapes[:3])}")
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise VseInputError(
            f"{weights}: does not fit {name}: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )
