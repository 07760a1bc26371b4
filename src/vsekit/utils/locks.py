"""One writer per folder: an exclusive lock file (`.lock`) that a second writer meets and fails on at once,
naming the folder and the pid that holds it, instead of both writing the same files and one of them failing
half-way in the operating system's words.

Used by `vse index` (`vsekit.search.index.writer_lock`) and the dataset builders (`vse data folder | table |
webdataset`). The lock is an flock, which the kernel drops when its holder dies, so a killed writer never
blocks the next; without fcntl (Windows) the lock is the file itself, created exclusively, and the pid it
records is checked.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from vsekit.errors import VseInputError

LOCK_NAME = ".lock"


def lock_owner(path: Path) -> int | None:
    """The pid a lock file records (None: empty, unreadable or not a pid)."""
    try:
        return int(path.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None


def pid_alive(pid: int) -> bool | None:
    """Whether process `pid` runs on this machine (None: cannot tell here)."""
    if os.name != "posix":  # os.kill(pid, 0) is not a probe on Windows
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


class _Holder:
    """Who writes (`vse index`) and what (this index): the words of the lock's messages."""

    def __init__(self, holder: str, what: str, error: type[VseInputError]) -> None:
        self.holder, self.what, self.error = holder, what, error

    def busy(self, lock: Path, pid: int | None) -> VseInputError:
        who = f" (pid {pid})" if pid is not None else ""
        return self.error(
            f"{lock}: another {self.holder} is writing to {self.what} right now{who}; wait for it to finish"
        )


def _acquire_flock(lock: Path, words: _Holder) -> int:
    """An flock on `lock` (the kernel drops it when its holder dies, so a dead writer never blocks); returns the fd."""
    import fcntl

    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise words.busy(lock, lock_owner(lock)) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # a writer that finished between our open and flock removed the file: lock the current one
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _acquire_pidfile(lock: Path, words: _Holder, log: Callable[[str], None]) -> int:
    """Without fcntl (Windows): the lock is the file itself, created exclusively; a leftover one whose pid
    is not running any more is taken over, one we cannot check is refused with how to clear it."""
    for _ in range(3):
        try:
            return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pid = lock_owner(lock)
            alive = pid_alive(pid) if pid is not None else None
            if alive:
                raise words.busy(lock, pid) from None
            if alive is None:
                by = (
                    f"{words.holder} (pid {pid})"
                    if pid is not None
                    else f"a {words.holder} that recorded no pid"
                )
                raise words.error(
                    f"{lock}: held by {by}; if no {words.holder} is writing to {words.what} any "
                    f"more, delete {lock} and run again"
                ) from None
            log(f"note: {lock}: its writer (pid {pid}) is not running any more; taking the lock over")
            lock.unlink(missing_ok=True)
    raise words.busy(lock, lock_owner(lock))


@contextmanager
def folder_lock(
    folder: str | Path,
    holder: str,
    what: str,
    error: type[VseInputError] = VseInputError,
    log: Callable[[str], None] = print,
    name: str = LOCK_NAME,
) -> Iterator[Path]:
    """Hold `folder/name` exclusively for the block; a second writer gets `error`: "FOLDER/.lock: another
    `holder` is writing to `what` right now (pid N); wait for it to finish". Yields the lock file's path.

    The lock file records the holder's pid and is removed on every exit, error or Ctrl-C included; a folder
    this call created is removed too when nothing else was written in it. A lock left by a killed writer does
    not block: flock dies with its holder (elsewhere the recorded pid is checked).
    """
    folder = Path(folder)
    words = _Holder(holder, what, error)
    if folder.exists() and not folder.is_dir():
        raise error(f"{folder}: exists and is not a folder; choose another --out")
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    lock = folder / name
    try:
        try:
            import fcntl  # noqa: F401

            flocked, fd = True, _acquire_flock(lock, words)
            prev = lock_owner(lock)
            if prev is not None and prev != os.getpid():  # its holder is gone, or we would not hold the flock
                log(
                    f"note: {lock}: left by a {holder} (pid {prev}) that stopped without finishing; taking it over"
                )
        except ImportError:
            flocked, fd = False, _acquire_pidfile(lock, words, log)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode("ascii"))
            yield lock
        finally:
            if flocked:
                lock.unlink(missing_ok=True)  # while still held, so no other writer can be holding this file
                os.close(fd)  # releases the flock
            else:  # Windows cannot delete an open file
                os.close(fd)
                lock.unlink(missing_ok=True)
    finally:
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()  # only when empty: a failed first run leaves no folder behind


__all__ = ["LOCK_NAME", "folder_lock", "lock_owner", "pid_alive"]
