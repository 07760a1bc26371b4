"""File I/O: crash-safe writes (a reader sees the old file or the new one, never half of one), file digests,
and .npy reads that never unpickle and name the file when it cannot be read.

Every write in vsekit that replaces a file goes through `atomic_path` (or the `atomic_write_*` helpers built
on it): the data goes to a temp file in the target's directory, is fsynced, and is renamed over the target.
Where a command may write a result file at all is one rule, `check_output_file` (results never overwrite
inputs); where a dataset builder may write its folder, `prepare_dataset_dir`.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterable, Iterator
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


def file_stamp(path: str | Path) -> tuple[int, int] | None:
    """(inode, mtime in ns) of `path`, None when there is none: equal stamps before and after a step mean the
    step did not replace the file (every write here is a rename, which gives a new inode)."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def utf8_text(text: str) -> str:
    """`text` as valid UTF-8, for JSON, text files and the terminal: the bytes of a file name that is not UTF-8
    (Python's surrogate escapes) become `\\xNN`, any other lone surrogate `\\uDNNN` (text that is valid is
    returned as it is)."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        pass
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


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
    """`array` in .npy format at exactly `path` (whatever its suffix: numpy's own `np.save(name)` would add
    `.npy` to a name without it), streamed to the temp file: no second copy of the array in memory."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            np.save(f, np.asarray(array), allow_pickle=False)


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
            raise error(
                f"{path}: not a plain numeric .npy array: it holds Python objects (dtype=object), not numbers"
            ) from e
        raise error(f"{path}: not a plain numeric .npy array ({e})") from e
    except (OSError, EOFError) as e:
        raise error(f"{path}: cannot be read as .npy ({e or type(e).__name__}; truncated?)") from e


def check_output_file(path: str | Path, option: str, inputs: Iterable[str | Path] = ()) -> Path:
    """`path` as a place a command may write a result file (`--json-out`, `--save-sims`, a montage), else a
    `VseInputError` naming `option`, raised before any work so that nothing is lost:
    - the folder it goes in must already exist (no folder is created for a result file, so a typo in the
      folder is an error, not a new tree), and `path` must not be a folder;
    - results never overwrite inputs: `path` may not lie inside any folder in `inputs` (a run, an index, a
      dataset the command reads) nor be one of the files in `inputs`, through symbolic or hard links too.
    Writes nothing."""
    out = Path(path)
    where = f"{option} {path}"
    if not out.name or out.name in (".", ".."):
        raise VseInputError(f"{where}: name a file")
    if out.is_dir():
        raise VseInputError(f"{where}: is a folder; name a file")
    parent = out.parent
    if not parent.is_dir():
        why = "is not a folder" if parent.exists() else "does not exist"
        raise VseInputError(
            f"{where}: the folder {parent} {why}; nothing is created for a result file: create the "
            "folder first or name another"
        )
    if not os.access(parent, os.W_OK | os.X_OK):
        raise VseInputError(f"{where}: the folder {parent} is not writable")
    written = {parent.resolve() / out.name, out.resolve()}  # the name itself, and where a symlink there leads
    for given in inputs:
        inp = Path(given)
        if not inp.exists():
            continue
        real = inp.resolve()
        if inp.is_dir():
            if any(w == real or w.is_relative_to(real) for w in written):
                raise VseInputError(
                    f"{where}: is inside {given}, which this command reads; nothing was written: a "
                    "result never goes into an input run, index or dataset folder, name a file "
                    "outside it"
                )
        elif real in written or (out.exists() and os.path.samefile(out, inp)):
            raise VseInputError(
                f"{where}: is {given}, which this command reads; nothing was written: name another file"
            )
    return out


def prepare_dataset_dir(
    out: Path,
    overwrite: bool,
    splits: tuple[str, ...],
    split_files: tuple[str, ...],
    extra_files: tuple[str, ...] = (),
    extra_dirs: tuple[str, ...] = (),
) -> None:
    """Refuse a non-empty dataset folder unless `overwrite`; with it, remove only the files a builder writes
    (`{split}{suffix}` for every split and suffix, `extra_files`, `extra_dirs`): a stale cap2img or picture
    list of an earlier dataset would otherwise be read with the new features, and anything else stays."""
    import shutil

    if out.exists() and not out.is_dir():
        raise VseInputError(f"{out}: exists and is not a folder; choose another --out")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise VseInputError(
                f"{out}: exists and is not empty; nothing was written: choose a new or empty --out, "
                "or pass --overwrite to replace the dataset there"
            )
        for split in splits:
            for suffix in split_files:
                (out / f"{split}{suffix}").unlink(missing_ok=True)
        for name in extra_files:
            (out / name).unlink(missing_ok=True)
        for name in extra_dirs:
            shutil.rmtree(out / name, ignore_errors=True)
