"""File I/O: crash-safe writes (a reader sees the old file or the new one, never half of one) and .npy reads
that never unpickle and name the file when it cannot be read."""

from __future__ import annotations

import io
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write to a temp file in the same directory, fsync, then rename over the target."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_save_npy(path: str | Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


def open_npy(path: Path, error: type[Exception] = ValueError) -> np.ndarray:
    """Memory-map a .npy without unpickling; an unreadable or non-array file raises `error` naming it.

    Existence is the caller's check, so each can say what the missing file should have held.
    """
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        raise error(f"{path}: not a plain numeric .npy array ({e})") from e
    except OSError as e:
        raise error(f"{path}: cannot be read as .npy ({e})") from e
