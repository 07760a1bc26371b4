"""File I/O: crash-safe writes (a reader sees the old file or the new one, never half of one), file digests,
and .npy reads that never unpickle and name the file when it cannot be read.

Every write in vsekit that replaces a file goes through `atomic_path` (or the `atomic_write_*` helpers built
on it): the data goes to a temp file in the target's directory, is fsynced, and is renamed over the target.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from vsekit.errors import VseInputError

NPY_MAGIC = b"\x93NUMPY"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    """Hex sha256 of a file's bytes, read in `chunk`-byte blocks (constant memory for any size)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _default_file_mode() -> int:
    """0o666 minus the umask: what open() would give (mkstemp's 0o600 would hide files from other users)."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


def _fsync_dir(directory: Path) -> None:
    try:
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


@contextmanager
def atomic_path(path: str | Path, fsync: bool = True) -> Iterator[Path]:
    """A temp path beside `path` for the block to write (by any means: numpy memmaps, FAISS, …); when the
    block ends without an error the temp file is fsynced (`fsync`) and renamed over `path`, else removed.

        with atomic_path(out / "index.faiss") as tmp:
            faiss.write_index(index, str(tmp))
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, _default_file_mode())
        os.close(fd)
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    if fsync:
        _fsync_dir(path.parent)


def atomic_write_bytes(path: str | Path, data: bytes, fsync: bool = True) -> None:
    """Write `data` to a temp file in the same directory, fsync (unless `fsync=False`: a cache file whose loss
    on a power cut only costs a recomputation), then rename over the target."""
    with atomic_path(path, fsync) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, ensure_ascii: bool = True) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False, ensure_ascii=ensure_ascii) + "\n")


def atomic_save_npy(path: str | Path, array: np.ndarray) -> None:
    buf = io.BytesIO()
    np.save(buf, np.asarray(array), allow_pickle=False)
    atomic_write_bytes(path, buf.getvalue())


def open_npy(path: Path, error: type[Exception] = VseInputError) -> np.ndarray:
    """Memory-map a .npy without unpickling; an unreadable or non-array file raises `error` naming it and
    saying what it is instead (a text file, an empty file, Python objects, a truncated array).

    Existence is the caller's check, so each can say what the missing file should have held.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(64)
    except OSError as e:
        raise error(f"{path}: cannot be read ({e})") from e
    if not head.startswith(NPY_MAGIC):
        if not head:
            what = "it is empty"
        elif all(32 <= c < 127 or c in b"\t\r\n" for c in head):
            what = "it looks like a text file"
        else:
            what = "it does not start with the .npy header"
        raise error(f"{path}: not a .npy matrix ({what}); write arrays with numpy.save")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except ValueError as e:
        if "pickled" in str(e) or "Python objects" in str(e):
            raise error(f"{path}: not a plain numeric .npy array: it holds Python objects (dtype=object), not "
                        "numbers") from e  # fmt: skip
        raise error(f"{path}: not a plain numeric .npy array ({e})") from e
    except (OSError, EOFError) as e:
        raise error(f"{path}: cannot be read as .npy ({e or type(e).__name__}; truncated?)") from e


def prepare_dataset_dir(out: Path, overwrite: bool, splits: tuple[str, ...], split_files: tuple[str, ...],
                        extra_files: tuple[str, ...] = (), extra_dirs: tuple[str, ...] = ()) -> None:  # fmt: skip
    """Refuse a non-empty dataset folder unless `overwrite`; with it, remove only the files a builder writes
    (`{split}{suffix}` for every split and suffix, `extra_files`, `extra_dirs`): a stale cap2img or picture
    list of an earlier dataset would otherwise be read with the new features, and anything else stays."""
    import shutil

    if out.exists() and not out.is_dir():
        raise VseInputError(f"{out}: exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise VseInputError(f"{out}: exists and is not empty; nothing was written: choose a new or empty --out, "
                                "or pass --overwrite to replace the dataset there")  # fmt: skip
        for split in splits:
            for suffix in split_files:
                (out / f"{split}{suffix}").unlink(missing_ok=True)
        for name in extra_files:
            (out / name).unlink(missing_ok=True)
        for name in extra_dirs:
            shutil.rmtree(out / name, ignore_errors=True)
