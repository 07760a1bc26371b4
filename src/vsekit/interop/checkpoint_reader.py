"""Read checkpoint files as the released VSE∞ / VSE+2AD / AVSE training scripts wrote them — safely.

Those scripts `torch.save` a dict holding state dicts, numbers and a pickled `argparse.Namespace` (VSE+2AD's
also a `torch.device`), with tensors tagged as CUDA storages, in torch's zip format or, for old files, the
legacy one. We load with torch's weights-only unpickler and allow `argparse.Namespace` on top of its
defaults (tensors, containers, numbers, `torch.device`): a pickle naming anything else — a class of the
research repositories, `os.system` — is refused, never executed.
"""

from __future__ import annotations

import argparse
import pickle
import re
from pathlib import Path
from typing import Any

import torch

from vsekit.errors import VseInputError

ALLOWED_GLOBALS = [argparse.Namespace]


class ReleasedCheckpointError(VseInputError):
    """A file that is not a released checkpoint we can import (one line, names the file and the problem)."""


def read_released_checkpoint(path: str | Path) -> dict[str, Any]:
    """The checkpoint dict (`model`, options, counters) with every tensor on the CPU."""
    path = Path(path)
    if not path.is_file():
        raise ReleasedCheckpointError(f"{path}: no such checkpoint file")
    if path.stat().st_size == 0:
        raise ReleasedCheckpointError(f"{path}: empty file, not a checkpoint")
    try:
        with torch.serialization.safe_globals(ALLOWED_GLOBALS):
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        found = re.search(r"GLOBAL (\S+)", str(e))
        if found is None:  # not a pickle torch writes (e.g. a text file read by the legacy loader)
            op = re.search(r"Unsupported operand \d+", str(e))
            raise ReleasedCheckpointError(f"{path}: not a readable PyTorch checkpoint ({op.group(0) if op else 'bad pickle'} "
                                          "in its pickle stream); the file is truncated, corrupt or of another kind") from None
        what = found.group(1)
        raise ReleasedCheckpointError(
            f"{path}: refused: the pickle names {what}; a released checkpoint holds only tensors, numbers and "
            "argparse.Namespace, and vsekit never unpickles anything else"
        ) from None
    except Exception as e:  # torch raises OSError/RuntimeError/KeyError/EOFError for damaged files
        raise ReleasedCheckpointError(
            f"{path}: not a readable PyTorch checkpoint ({type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'no detail'}); "
            "the file is truncated, corrupt or of another kind"
        ) from None
    if not isinstance(obj, dict) or "model" not in obj:
        found = sorted(map(str, obj)) if isinstance(obj, dict) else type(obj).__name__
        raise ReleasedCheckpointError(
            f"{path}: not a released training checkpoint: expected a dict with a 'model' entry, found {found}"
        )
    return obj


def options_dict(ckpt: dict[str, Any], key: str, path: str | Path) -> dict[str, Any]:
    """The training options the script pickled (`opt` or `args`) as a plain dict."""
    opt = ckpt.get(key)
    if isinstance(opt, argparse.Namespace):
        return dict(vars(opt))
    if isinstance(opt, dict):
        return dict(opt)
    raise ReleasedCheckpointError(f"{path}: checkpoint has no '{key}' options (found keys {sorted(map(str, ckpt))})")


def json_safe(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON values (a `torch.device` becomes its string) for the run's record."""
    out: dict[str, Any] = {}
    for k, v in options.items():
        out[k] = v if isinstance(v, (str, int, float, bool, type(None), list)) else str(v)
    return out
