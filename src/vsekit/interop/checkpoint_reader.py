"""Read checkpoint files as the released VSE∞ / VSE+2AD / AVSE training scripts wrote them — safely.

Those scripts `torch.save` a dict holding state dicts, numbers and a pickled `argparse.Namespace` (VSE+2AD's
also a `torch.device`), with tensors tagged as CUDA storages, in torch's zip format or, for old files, the
legacy one. We load with torch's weights-only unpickler and allow `argparse.Namespace` on top of its
defaults (tensors, containers, numbers, `torch.device`): a pickle naming anything else — a class of the
research repositories, `os.system` — is refused, never executed.
"""

from __future__ import annotations

import _compat_pickle
import argparse
import io
import math
import pickle
import pickletools
import re
import warnings
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

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
        with torch.serialization.safe_globals(ALLOWED_GLOBALS), warnings.catch_warnings():
            # torch warns about pickle protocols above 2 before refusing them itself; the refusal says it all
            warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        # name the global the pickle asks for (torch's own message does not, for protocols 3-5, and spells it
        # as the pickle does: Python 2 names such as commands.Popen for subprocess.Popen)
        what, protocol = scan_pickles(path)
        if what is None:
            found = re.search(r"GLOBAL (\S+) was not an allowed global", str(e))
            what = found and display_global(*found.group(1).rpartition(".")[::2], protocol=2)
        op = re.search(r"Unsupported operand \d+", str(e))
        if what is None and op and protocol > 2:
            raise ReleasedCheckpointError(
                f"{path}: written with pickle protocol {protocol}, which torch's safe "
                "(weights-only) loader cannot read, and vsekit loads no other way; save it "
                "again with torch.save's default protocol (2)"
            ) from None
        if what is None:  # not a pickle torch writes (e.g. a text file read by the legacy loader)
            raise ReleasedCheckpointError(
                f"{path}: not a readable PyTorch checkpoint ({op.group(0) if op else 'bad pickle'} "
                "in its pickle stream); the file is truncated, corrupt or of another kind"
            ) from None
        raise ReleasedCheckpointError(
            f"{path}: refused, an unsafe pickle: it names {what}, which a checkpoint never needs; a released "
            "checkpoint holds only tensors, numbers and argparse.Namespace, and vsekit never unpickles anything else"
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


# ---------------------------------------------------------------------------------------------- naming a refused global

# os functions live in posix (nt on Windows): a pickle of os.system names posix.system
OS_MODULES = {"posix": "os", "nt": "os"}
STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
}
MAX_PICKLES = 8  # a legacy file: magic number, protocol, sys info, the object, storage keys


def display_global(module: str, name: str, protocol: int) -> str:
    """`module.name` as Python would import it: protocol 0-2 pickles use Python 2 names, which the unpickler
    maps (`commands.Popen` is subprocess.Popen, `__builtin__.eval` is builtins.eval); `posix.system` is os.system."""
    if protocol < 3:
        if (module, name) in _compat_pickle.NAME_MAPPING:
            module, name = _compat_pickle.NAME_MAPPING[(module, name)]
        elif module in _compat_pickle.IMPORT_MAPPING:
            module = _compat_pickle.IMPORT_MAPPING[module]
    return f"{OS_MODULES.get(module, module)}.{name}"


def allowed_global_names() -> set[str]:
    """Globals torch's weights-only unpickler accepts (its allow-list, torch.* types) and ours."""
    try:
        from torch._weights_only_unpickler import _get_allowed_globals

        names = set(_get_allowed_globals())
    except Exception:  # noqa: BLE001 - a private helper: without it, torch's own types are still known below
        names = set()
    return names | {f"{g.__module__}.{g.__qualname__}" for g in ALLOWED_GLOBALS}


def pickle_streams(path: Path) -> Iterator[IO[bytes]]:
    """The pickle streams of a checkpoint: a zip file's `data.pkl`, or the legacy file itself (read pickle
    after pickle by the caller)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as z:
            for name in z.namelist():
                if name.endswith(".pkl"):
                    yield io.BytesIO(z.read(name))
    else:
        with open(path, "rb") as f:
            yield f


def globals_in(stream: IO[bytes]) -> Iterator[tuple[str, str, int]]:
    """Every global one pickle names, in order, read with `pickletools` (nothing is imported or executed).
    STACK_GLOBAL (protocol 4+) takes its two names from the strings pushed before it (memo reads included)."""
    memo: dict[int, Any] = {}
    recent: list[Any] = []
    protocol = 0
    for op, arg, _ in pickletools.genops(stream):
        name = op.name
        if name == "PROTO":
            protocol = int(arg)
        elif name in STRING_OPS:
            recent.append(arg)
        elif name == "MEMOIZE":
            memo[len(memo)] = recent[-1] if recent else None
        elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
            memo[int(arg)] = recent[-1] if recent else None
        elif name in ("GET", "BINGET", "LONG_BINGET"):
            recent.append(memo.get(int(arg)))
        elif name in ("GLOBAL", "INST"):
            module, _, qual = str(arg).partition(" ")
            yield module, qual, protocol
            recent.append(None)
        elif name == "STACK_GLOBAL":
            module, qual = (recent[-2], recent[-1]) if len(recent) >= 2 else (None, None)
            if isinstance(module, str) and isinstance(qual, str):
                yield module, qual, protocol
            else:
                yield "", "", protocol
            recent.append(None)
        elif name == "STOP":
            return
        elif name != "FRAME":
            recent.append(None)


def scan_pickles(path: Path) -> tuple[str | None, int]:
    """(the first global of the checkpoint's pickles that the allow-list lacks, as Python names it, or None;
    the highest pickle protocol seen, 0 when the file is not a pickle at all)."""
    allowed = allowed_global_names()
    highest = 0
    try:
        for stream in pickle_streams(path):
            for _ in range(MAX_PICKLES):
                start = stream.tell()
                if not stream.read(1):  # end of file
                    break
                stream.seek(start)
                for module, qual, protocol in globals_in(stream):
                    highest = max(highest, protocol)
                    if not module:
                        return "a global whose name it hides", highest
                    if f"{module}.{qual}" not in allowed and not module.startswith("torch"):
                        return display_global(module, qual, protocol), highest
                stream.seek(start)
                highest = max(highest, pickle_protocol(stream))
                for _op in pickletools.genops(stream):  # to the end of this pickle
                    pass
    except Exception:  # noqa: BLE001 - the rest of the file is not pickle (storages, garbage): stop there
        return None, highest
    return None, highest


def pickle_protocol(stream: IO[bytes]) -> int:
    """The protocol a pickle declares (its leading PROTO opcode; 0-1 have none), the stream left where it was."""
    start = stream.tell()
    head = stream.read(2)
    stream.seek(start)
    return head[1] if len(head) == 2 and head[0] == pickle.PROTO[0] else 0


def first_non_finite(obj: Any, where: str) -> tuple[str, torch.Tensor] | None:
    """(name, tensor) of the first floating tensor under `obj` (dicts and lists, walked in order) holding NaN or
    inf; names as the import's messages write them (`model[1].rnn.weight_ih_l0`, `model.img_enc.fc.weight`)."""
    if isinstance(obj, torch.Tensor):
        if (obj.is_floating_point() or obj.is_complex()) and not bool(torch.isfinite(obj).all()):
            return where, obj
        return None
    if isinstance(obj, dict):
        items = ((f"{where}.{k}", v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((f"{where}[{i}]", v) for i, v in enumerate(obj))
    else:
        return None
    for name, value in items:
        found = first_non_finite(value, name)
        if found is not None:
            return found
    return None


def check_finite_weights(ckpt: dict[str, Any], path: Path) -> None:
    """Refuse a checkpoint whose weights hold NaN or inf, naming the first such tensor: its run would score
    every image-caption pair NaN."""
    found = first_non_finite(ckpt.get("model"), "model")
    if found is None:
        return
    name, t = found
    nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
    what = " and ".join(w for w, n in (("NaN", nan), ("inf", inf)) if n)
    raise ReleasedCheckpointError(
        f"{path}: refused: tensor {name} holds {what} ({nan + inf} of {t.numel()} values); "
        "a model with non-finite weights scores every pair NaN (did its training diverge?)"
    )


# ---------------------------------------------------------------------------------------------- options


def options_dict(ckpt: dict[str, Any], key: str, path: str | Path) -> dict[str, Any]:
    """The training options the script pickled (`opt` or `args`) as a plain dict."""
    opt = ckpt.get(key)
    if isinstance(opt, argparse.Namespace):
        return dict(vars(opt))
    if isinstance(opt, dict):
        return dict(opt)
    raise ReleasedCheckpointError(
        f"{path}: checkpoint has no '{key}' options (found keys {sorted(map(str, ckpt))})"
    )


def json_safe(options: dict[str, Any]) -> dict[str, Any]:
    """Options as JSON values (a `torch.device` becomes its string, lists and dicts are converted inside, a
    non-finite float its string) for the run's record."""
    return {str(k): json_value(v) for k, v in options.items()}


def json_value(v: Any) -> Any:
    if isinstance(v, (str, int, bool, type(None))):
        return v
    if isinstance(v, float):
        return v if math.isfinite(v) else str(v)
    if isinstance(v, (list, tuple)):
        return [json_value(x) for x in v]
    if isinstance(v, dict):
        return {str(k): json_value(x) for k, x in v.items()}
    return str(v)


_NOT_GIVEN = object()


def _number(options: dict[str, Any], name: str, path: str | Path, default: Any, kind: type) -> Any:
    value = options.get(name, _NOT_GIVEN)
    if value is _NOT_GIVEN or value is None:  # argparse's None: not set
        if default is _NOT_GIVEN:
            raise ReleasedCheckpointError(f"{path}: the pickled options have no {name!r}")
        return default
    try:
        if isinstance(value, (bool, list, tuple, dict, set, bytes)):
            raise TypeError
        number = float(value)  # numbers, numeric strings (an option argparse left untyped), 0-d tensors
    except (TypeError, ValueError, RuntimeError):
        number = None
    if number is None or not math.isfinite(number) or (kind is int and number != int(number)):
        want = "an integer" if kind is int else "a finite number"
        raise ReleasedCheckpointError(
            f"{path}: the pickled option {name!r} is {value!r} ({type(value).__name__}), expected {want}"
        )
    return int(number) if kind is int else number


def int_option(options: dict[str, Any], name: str, path: str | Path, default: Any = _NOT_GIVEN) -> Any:
    """An integer option (also from a whole float or a numeric string), `default` when absent or None; any other
    value is one line naming the checkpoint and the key. Without a default the option is required."""
    return _number(options, name, path, default, int)


def float_option(options: dict[str, Any], name: str, path: str | Path, default: Any = _NOT_GIVEN) -> Any:
    """A finite float option, as `int_option`."""
    return _number(options, name, path, default, float)


def flag_option(options: dict[str, Any], name: str, path: str | Path) -> bool:
    """A true/false option (argparse's store_true): bool, 0/1 or None, else one line naming the key."""
    value = options.get(name)
    if value is None or isinstance(value, bool):
        return bool(value)
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    raise ReleasedCheckpointError(
        f"{path}: the pickled option {name!r} is {value!r} ({type(value).__name__}), expected true or false"
    )
