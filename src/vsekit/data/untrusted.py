"""The one set of rules for opening a file that untrusted input names (see docs/security.md).

A folder, a table, a shard or a web client comes from elsewhere: the names it holds may point anywhere (an
absolute path, `../`, `~`, a symbolic link out of the folder) and at anything (a FIFO that blocks forever, a
link to `/dev/zero` that never ends, a device whose opening does something, a folder). So such a name is
1. resolved inside its root (`resolve_inside`): relative names only, no `~`, and the fully resolved path
   (every `..` and symbolic link followed) must lie under the resolved root;
2. opened without following a last symbolic link (`O_NOFOLLOW`) and without blocking (`O_NONBLOCK`: a FIFO
   opens at once), after `stat` and again by `fstat` on the open file checked to be a regular file, so a FIFO,
   device, socket or folder is refused naming what it is, before and after it is opened;
3. read with a byte cap (`MAX_PICTURE_BYTES`, `MAX_CAPTION_FILE_BYTES`): the size is checked before reading,
   and the read stops one byte past the cap whatever the file claims;
4. refused when it has more than one name (`st_nlink > 1`, `check_links`), unless the user said they trust
   the folder (`trust_links`, `--trust-links`): a hard link resolves inside the root wherever its file lies,
   so `x.txt` hard-linked to `/etc/passwd` (or to a private picture) would pass rule 1. The rule applies to
   names resolved from untrusted input (links not followed); a path the user typed is followed as given.

A refusal is an `UntrustedFileError`: a `VseInputError` (a one-line error, exit 2, when the file was named on
the command line) and an `OSError` (so every reader that already reports an unreadable file and skips it does
so for these too). Failures of the system itself (no such file, permission denied) stay plain OSErrors.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

from vsekit.errors import VseInputError
from vsekit.utils.printable import printable

MAX_PICTURE_BYTES = (
    128 * 1024 * 1024
)  # one picture file: far above any real photo, far below a memory problem
MAX_CAPTION_FILE_BYTES = 1024 * 1024  # one x.txt beside a picture: thousands of captions
READ_BLOCK = 1024 * 1024

# why a file was refused (UntrustedFileError.kind)
OUTSIDE = "outside its root"
NOT_REGULAR = "not a regular file"
TOO_LARGE = "too large"
BAD_PATH = "not a usable path"
HARD_LINK = "a hard link"


class UntrustedFileError(VseInputError, OSError):
    """A file named by untrusted input that vsekit refuses to read. `name` is how the input named it, `kind`
    one of OUTSIDE / NOT_REGULAR / TOO_LARGE / BAD_PATH / HARD_LINK, `detail` the reason as a user reads it."""

    def __init__(self, name: str, kind: str, detail: str) -> None:
        super().__init__(f"{name}: {detail}")
        self.name, self.kind, self.detail = name, kind, detail
        self.strerror = detail  # what readers that print `e.strerror or e` for an unreadable file show

    def __str__(self) -> str:
        return f"{printable(self.name)}: {self.detail}"

    def __reduce__(self):  # picklable (DataLoader workers hand errors back to the main process)
        return type(self), (self.name, self.kind, self.detail)


def file_kind(mode: int) -> str:
    """What a stat mode is, for a message: "a folder", "a FIFO (named pipe)", "a character device", …"""
    for test, what in (
        (stat.S_ISREG, "a regular file"),
        (stat.S_ISDIR, "a folder"),
        (stat.S_ISFIFO, "a FIFO (named pipe)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISLNK, "a symbolic link"),
    ):
        if test(mode):
            return what
    return "not a regular file"


def resolve_inside(
    root: str | Path, name: str, *, label: str = "its root", absolute_ok: bool = False
) -> Path:
    """The fully resolved path of `name` under `root`, or UntrustedFileError when it lies outside.

    `name` must be relative (an absolute one only with `absolute_ok`, and then it must lie inside too), must
    not start with `~` (never expanded), and `root / name` with every `..` and symbolic link followed must
    lie under the resolved `root`. `label` names the root in messages ("the images root", "the folder").
    """
    text = str(name)
    if not text.strip():
        raise UntrustedFileError(text, BAD_PATH, "empty path")
    if "\0" in text:
        raise UntrustedFileError(text, BAD_PATH, f"{text!r} is not a usable path (it holds a NUL byte)")
    try:
        base = Path(root).resolve()
    except (OSError, RuntimeError, ValueError) as e:
        raise UntrustedFileError(str(root), BAD_PATH, f"{str(root)!r} is not a usable path ({e})") from e
    if text.startswith("~"):
        raise UntrustedFileError(
            text,
            OUTSIDE,
            f"{text!r} points outside {label} {base} ('~' is not expanded: paths are relative to it)",
        )
    rel = Path(text)
    if rel.is_absolute() and not absolute_ok:
        raise UntrustedFileError(text, OUTSIDE, f"{text!r} points outside {label} {base}")
    try:
        full = (base / rel).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # symbolic link loops
        raise UntrustedFileError(text, BAD_PATH, f"{text!r} is not a usable path ({e})") from e
    if not full.is_relative_to(base):
        lexical = Path(os.path.normpath(base / rel))
        how = " through a symbolic link" if lexical.is_relative_to(base) else ""
        raise UntrustedFileError(text, OUTSIDE, f"{text!r} points outside {label} {base}{how}")
    return full


def check_links(st: os.stat_result, name: str, trust_links: bool = False) -> None:
    """The hard-link rule (one owner): a regular file with more than one name is refused unless
    `trust_links`. A hard link resolves inside the root wherever its file lies (`x.txt` made a second name of
    `/etc/passwd`), so "the resolved path lies inside" cannot tell; a file with one name is where it is."""
    if not trust_links and stat.S_ISREG(st.st_mode) and st.st_nlink > 1:
        raise UntrustedFileError(
            name,
            HARD_LINK,
            f"is a hard link ({st.st_nlink} names for one file, which may lie outside the folder); refused: "
            "pass --trust-links if you trust this folder",
        )


def check_regular(
    path: str | Path,
    *,
    name: str | None = None,
    follow_symlinks: bool = True,
    expected: str = "a regular file",
    trust_links: bool | None = None,
) -> os.stat_result:
    """`stat` of `path` when it is a regular file, else UntrustedFileError saying what it is ("is a FIFO
    (named pipe), expected a picture file"); a missing file stays FileNotFoundError. A file with several
    names is refused (`check_links`) unless `trust_links` (default: `follow_symlinks`, i.e. trusted only for
    a path the user typed; a name resolved from untrusted input passes `trust_links` explicitly)."""
    st = os.stat(path, follow_symlinks=follow_symlinks)
    label = name if name is not None else str(path)
    if not stat.S_ISREG(st.st_mode):
        raise UntrustedFileError(label, NOT_REGULAR, f"is {file_kind(st.st_mode)}, expected {expected}")
    check_links(st, label, follow_symlinks if trust_links is None else trust_links)
    return st


def read_bounded(
    path: str | Path,
    max_bytes: int,
    *,
    name: str | None = None,
    follow_symlinks: bool = False,
    expected: str = "a regular file",
    trust_links: bool | None = None,
) -> bytes:
    """The bytes of the regular file `path`, at most `max_bytes` of them, never blocking.

    Without `follow_symlinks` (the default: `path` was resolved by `resolve_inside`), a symbolic link at
    `path` is refused (O_NOFOLLOW); with it (a path the user typed) the link is followed. A FIFO, device,
    socket or folder is refused before it is opened (stat) and again once open (fstat); a file larger than
    `max_bytes` is refused before reading, and one that grows while read stops at `max_bytes` + 1 bytes.
    A file with several names is refused before and after opening (`check_links`) unless `trust_links`
    (default: `follow_symlinks`: a resolved name from untrusted input is checked, a typed path is not).
    """
    label = name if name is not None else str(path)
    trusted = follow_symlinks if trust_links is None else trust_links
    try:
        check_regular(
            path, name=label, follow_symlinks=follow_symlinks, expected=expected, trust_links=trusted
        )
    except UntrustedFileError as e:
        if not follow_symlinks and e.detail.startswith("is a symbolic link"):
            raise UntrustedFileError(label, OUTSIDE, "is a symbolic link (not followed here)") from None
        raise
    flags = (
        os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_BINARY", 0)
    )
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except OSError as e:
        if e.errno == errno.ELOOP and not follow_symlinks:  # replaced by a link since the stat
            raise UntrustedFileError(label, OUTSIDE, "is a symbolic link (not followed here)") from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):  # replaced since the stat
            raise UntrustedFileError(label, NOT_REGULAR, f"is {file_kind(st.st_mode)}, expected {expected}")
        check_links(st, label, trusted)  # a second name made since the stat
        if st.st_size > max_bytes:
            raise UntrustedFileError(
                label, TOO_LARGE, f"{st.st_size} bytes is more than the {max_bytes} byte limit"
            )
        parts, got = [], 0
        while got <= max_bytes:
            block = os.read(fd, min(READ_BLOCK, max_bytes + 1 - got))
            if not block:
                break
            parts.append(block)
            got += len(block)
        if got > max_bytes:
            raise UntrustedFileError(label, TOO_LARGE, f"grew past the {max_bytes} byte limit while read")
        return b"".join(parts)
    finally:
        os.close(fd)


def read_inside(
    root: str | Path,
    name: str,
    max_bytes: int,
    *,
    label: str = "its root",
    absolute_ok: bool = False,
    expected: str = "a regular file",
    trust_links: bool = False,
) -> bytes:
    """`read_bounded` of `name` resolved inside `root` (`resolve_inside`); errors name `name`; a file with
    several names is refused unless `trust_links` (`check_links`)."""
    return read_bounded(
        resolve_inside(root, name, label=label, absolute_ok=absolute_ok),
        max_bytes,
        name=name,
        expected=expected,
        trust_links=trust_links,
    )


__all__ = [
    "HARD_LINK",
    "MAX_CAPTION_FILE_BYTES",
    "MAX_PICTURE_BYTES",
    "UntrustedFileError",
    "check_links",
    "check_regular",
    "file_kind",
    "read_bounded",
    "read_inside",
    "resolve_inside",
]
