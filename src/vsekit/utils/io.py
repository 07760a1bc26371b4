"""File I/O: crash-safe writes (a reader sees the old file or the new one, never half of one), file digests,
and .npy reads that never unpickle and name the file when it cannot be read.

Every write in vsekit that replaces a file goes through `atomic_path` (or the `atomic_write_*` helpers built
on it): the data goes to a temp file in the target's directory, is fsynced, and is renamed over the target.
Where a command may write a result file at all is one rule, `check_output_file` (results never overwrite
inputs); where a dataset builder may write its folder, `prepare_dataset_dir`.
"""

from __future__ import annotations

import errno
import hashlib
import io
import json
import logging
import os
import shutil
import stat
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from vsekit.errors import VseInputError

NPY_MAGIC = b"\x93NUMPY"

logger = logging.getLogger(__name__)

# the write errors that mean "the storage is full" (a disk, a quota, a file-size limit such as `ulimit -f`), not
# a bug: a command stops with one line naming the file and the free space, and keeps the previous state; the
# values say what the OS's own words (os.strerror) leave out
STORAGE_FULL_ERRNOS = {
    errno.ENOSPC: "",
    errno.EDQUOT: "",
    errno.EFBIG: "past the largest file this process may write (a file-size limit, ulimit -f)",
}


class StorageFullError(VseInputError, OSError):
    """A write stopped by a full disk, a used-up quota or a file-size limit (ENOSPC, EDQUOT, EFBIG; `errno`
    says which): the machine lacks room, so it is reported as one line (exit 2), not as a bug; atomic writes
    keep the previous file. Also an OSError, as these were before, so `except OSError` still catches it."""


def storage_full_errno(e: BaseException) -> int | None:
    """The errno of `e` when it is a full-storage write error, else None. A library that reports the C error in
    words (FAISS: "write error in …: … (No space left on device)") counts too."""
    if isinstance(e, OSError) and e.errno in STORAGE_FULL_ERRNOS:
        return e.errno
    if isinstance(e, (RuntimeError, StorageFullError)):
        text = str(e)
        for number in STORAGE_FULL_ERRNOS:
            if os.strerror(number) in text:
                return number
    return None


def free_space_text(path: str | Path) -> str:
    """How much room the file system holding `path` (or its nearest existing folder) has left, in words."""
    folder = Path(path)
    while not folder.is_dir() and folder != folder.parent:
        folder = folder.parent
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return f"the free space of {folder} cannot be read"
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if free >= size:
            return f"{free / size:.1f} {unit} free in {folder}"
    return f"{free} bytes free in {folder}"


def storage_full_error(path: str | Path, e: BaseException, kept: str = "") -> StorageFullError:
    """The one-line error for a write of `path` that `e` (see `storage_full_errno`) stopped, naming the file,
    why and the free space; `kept` says what was left as it was (e.g. "the previous copy is kept")."""
    if isinstance(e, StorageFullError):  # already names its file: add what the caller kept
        if not kept:
            return e
        error = StorageFullError(f"{e}; {kept}")
        error.errno = e.errno
        return error
    number = storage_full_errno(e) or errno.ENOSPC
    hint = STORAGE_FULL_ERRNOS.get(number, "")
    why = os.strerror(number) + (f": {hint}" if hint else "")
    tail = f"; {kept}" if kept else ""
    error = StorageFullError(f"{path}: cannot be written: {why} ({free_space_text(path)}){tail}")
    error.errno = number
    return error


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
    A full disk, quota or file-size limit is a `StorageFullError` naming `path` and the free space (the
    previous `path` is kept).

        with atomic_path(out / "index.faiss") as tmp:
            faiss.write_index(index, str(tmp))
    """
    path = Path(path)
    kept = "the previous copy is kept" if path.exists() else "nothing was left behind"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as e:
        if storage_full_errno(e) is None:
            raise
        raise storage_full_error(path, e, kept) from e
    try:
        os.fchmod(fd, _default_file_mode())
        os.close(fd)
        yield Path(tmp)
        if fsync:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if storage_full_errno(e) is None:
            raise
        logger.debug("writing %s failed: %r", path, e)
        raise storage_full_error(path, e, kept) from e
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


NPY_MAX_HEADER_BYTES = 65536  # numpy writes headers of ~128 bytes; its own reader refuses past 10,000 chars


def _npy_header(
    path: Path, head: bytes, error: type[Exception]
) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """(shape, fortran_order, dtype, data offset) from the first bytes of a .npy, its header length bounded
    before it is read (numpy's reader would read a 4 GB header a v2 file claims)."""
    if not head.startswith(NPY_MAGIC):
        if not head:
            what = "it is empty"
        elif all(32 <= c < 127 or c in b"\t\r\n" for c in head[:64]):
            what = "it looks like a text file"
        else:
            what = "it does not start with the .npy header"
        raise error(f"{path}: not a .npy matrix ({what}); write arrays with numpy.save")
    bad = f"{path}: not a plain numeric .npy array"
    if len(head) < 10:
        raise error(f"{bad} (its header is cut short; truncated?)")
    major = head[6]
    if major not in (1, 2):
        raise error(f"{bad} (.npy format version {major}.{head[7]}; write arrays with numpy.save)")
    width = 2 if major == 1 else 4
    hlen = int.from_bytes(head[8 : 8 + width], "little")
    offset = 8 + width + hlen
    if hlen > NPY_MAX_HEADER_BYTES:
        raise error(f"{bad} (its header claims {hlen} bytes, more than {NPY_MAX_HEADER_BYTES})")
    if len(head) < offset:
        raise error(f"{bad} (its header is cut short; truncated?)")
    reader = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    buf = io.BytesIO(head[8:offset])
    try:
        shape, fortran, dtype = reader(buf, max_header_size=NPY_MAX_HEADER_BYTES)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as e:
        raise error(f"{bad} ({str(e).splitlines()[0][:200]})") from None
    if dtype.hasobject:
        raise error(f"{bad}: it holds Python objects (dtype=object), not numbers")
    if any(d < 0 for d in shape):
        raise error(f"{bad} (shape {list(shape)} has a negative size)")
    return tuple(shape), bool(fortran), dtype, offset


def open_npy(path: Path, error: type[Exception] = VseInputError) -> np.ndarray:
    """Memory-map a .npy without unpickling and without trusting it: an unreadable or non-array file raises
    `error` naming it and saying what it is instead (a FIFO or device, a text file, an empty file, Python
    objects, a header claiming more data than the file holds).

    Only a regular file is opened (checked by `stat` before, so a device is never opened, and by `fstat` after;
    opened with O_NONBLOCK, so a FIFO never blocks); the header's length is bounded before it is read, and
    shape x itemsize is checked against the file's size before anything is mapped; the data is mapped, never
    read. Readers of folders from elsewhere check the file by `vsekit.data.untrusted.check_regular` first, for
    a message saying what it is. Existence is the caller's check, so each can say what the missing file
    should have held.
    """
    not_regular = f"{path}: is not a regular file, expected a .npy file"
    try:
        regular = stat.S_ISREG(os.stat(path).st_mode)  # before opening: a device is never opened
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC) if regular else -1
    except OSError as e:
        raise error(f"{path}: cannot be read ({e.strerror or e})") from e
    if fd < 0:
        raise error(not_regular)
    with os.fdopen(fd, "rb") as f:
        try:
            st = os.fstat(f.fileno())
            head = f.read(8 + 4 + NPY_MAX_HEADER_BYTES) if stat.S_ISREG(st.st_mode) else None
        except OSError as e:
            raise error(f"{path}: cannot be read ({e.strerror or e})") from e
        if head is None:  # replaced since the stat
            raise error(not_regular)
        shape, fortran, dtype, offset = _npy_header(path, head, error)
        count = 1
        for d in shape:
            count *= d
        need = offset + count * dtype.itemsize
        if st.st_size < need:
            raise error(
                f"{path}: not a plain numeric .npy array (its header says {list(shape)} of {dtype}, "
                f"{need} bytes with the header, but the file holds {st.st_size}; truncated?)"
            )
        if count * dtype.itemsize == 0:
            out = np.zeros(shape, dtype, order="F" if fortran else "C")
            out.flags.writeable = False
            return out
        try:
            return np.memmap(
                f, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C"
            )
        except (OSError, ValueError) as e:
            raise error(f"{path}: cannot be read as .npy ({e or type(e).__name__})") from e


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
