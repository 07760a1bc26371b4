"""`read_webdataset(PATTERNS)`: pictures and captions of webdataset tar shards (the img2dataset layout),
read as untrusted input.

A sample is the members sharing a key (the name up to its first dot): one picture (key.jpg / key.png /
key.webp / ...) plus captions from key.txt (a line each) and the "caption" of key.json, pooled. Shards are
named by `{000..009}` / `{a,b}` brace expansion and globs, and read with the standard library's tarfile (no
webdataset package); a picture's bytes stay in the tar and are read by offset when the builder needs them.

Shards made by someone else are not trusted, so every read is bounded before it happens:
- brace patterns are counted before they are expanded (at most MAX_SHARD_NAMES names);
- at most MAX_SHARD_MEMBERS members of a shard are read; no single read tarfile makes (a header, a pax or
  GNU long-name record) may exceed TAR_READ_LIMIT bytes, whatever size the header declares;
- a member is used only when it is a regular file (no link, device or sparse file) whose name is UTF-8
  without control characters, at most MAX_MEMBER_DEPTH folders deep and MAX_MEMBER_NAME_BYTES long, not
  also a folder of another member's name (`a.png` beside `a.png/b.png`), and whose declared size fits in the shard and under the cap of its kind
  (`vsekit.data.untrusted`: MAX_PICTURE_BYTES; MAX_CAPTION_FILE_BYTES for key.txt / key.json), checked from
  its header before any of its bytes are read; a picture's pixel count is checked from its own header
  (`vsekit.data.pictures.check_pixels`: MAX_IMAGE_PIXELS) before its pixels are;
- a .json caption is parsed by `vsekit.utils.safe_json.loads_bounded` (depth, number length, lone
  surrogates bounded);
- a shard that ends without the end-of-archive block (cut short, or a damaged header) is reported.
Each refusal is a `Problem` naming the shard and member (`--strict` stops on it), never a crash, and so is
every sample left out: a member without a key (`..png`, a name with no dot) and a sample without a picture.
"""

from __future__ import annotations

import glob
import itertools
import logging
import os
import re
import stat
import tarfile
from collections.abc import Sequence
from pathlib import Path

from vsekit.data.pictures import PixelLimitError, check_pixels
from vsekit.data.untrusted import MAX_CAPTION_FILE_BYTES, MAX_PICTURE_BYTES, file_kind
from vsekit.datasets.own_items import (
    BAD_CAPTIONS,
    BAD_NAME,
    BROKEN_SHARD,
    NAME_CLASH,
    NO_CAPTION,
    NO_PICTURE,
    PICTURE_SUFFIXES,
    UNREADABLE,
    Collected,
    Item,
    PictureRef,
    Problem,
)
from vsekit.datasets.own_sources import caption_cell, caption_lines
from vsekit.errors import VseInputError
from vsekit.utils.printable import printable
from vsekit.utils.safe_json import JsonBoundsError, loads_bounded

log = logging.getLogger(__name__)

MAX_SHARD_NAMES = 1_000_000  # shard names all patterns may expand to, counted before expanding
MAX_SHARD_MEMBERS = 200_000  # members read per shard (img2dataset writes 3 x 10,000)
TAR_READ_LIMIT = 8 << 20  # the largest single read tarfile may make (headers, pax / GNU long-name records)
MAX_MEMBER_DEPTH = 64  # folders in a member's name (img2dataset writes none)
MAX_MEMBER_NAME_BYTES = 4096  # a member's whole name, PATH_MAX (each component is shortened when stored)
PICTURE_EXTS = tuple(s.lstrip(".") for s in PICTURE_SUFFIXES)

_GROUP_RE = re.compile(r"\{([^{}]*)\}")
_RANGE_RE = re.compile(r"(\d+)\.\.(\d+)")
_KEY_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
_COMPRESSED = (b"\x1f\x8b", b"BZh", b"\xfd7zX", b"\x28\xb5\x2f\xfd")  # gzip, bzip2, xz, zstd


# --------------------------------------------------------------------------------------------- names


def _brace_groups(pattern: str) -> tuple[list[str], list[tuple[str, ...] | range | None]]:
    """The pattern as literals between brace groups, and each group's options (a `range` of numbers, a tuple
    of words, or None for braces holding neither, which stay as they are)."""
    literals: list[str] = []
    groups: list[tuple[str, ...] | range | None] = []
    start = 0
    for m in _GROUP_RE.finditer(pattern):
        literals.append(pattern[start : m.start()])
        body = m.group(1)
        rng = _RANGE_RE.fullmatch(body)
        if rng and max(len(rng.group(1)), len(rng.group(2))) <= 18:  # int() of thousands of digits is refused
            lo, hi = int(rng.group(1)), int(rng.group(2))
            groups.append(range(lo, hi + 1) if hi >= lo else range(lo, hi - 1, -1))
        elif rng:
            groups.append(range(10**18 + 1))  # more names than any limit: counted, never expanded
        elif "," in body:
            groups.append(tuple(body.split(",")))
        else:
            groups.append(None)
        start = m.end()
    literals.append(pattern[start:])
    return literals, groups


def brace_count(pattern: str) -> int:
    """How many names `expand_braces(pattern)` gives, computed without expanding it."""
    n = 1
    for g in _brace_groups(pattern)[1]:
        n *= 1 if g is None else len(g)
    return n


def expand_braces(pattern: str, limit: int = MAX_SHARD_NAMES) -> list[str]:
    """Shell-style brace expansion as webdataset's: `{000..009}` (zero padding kept), `{a,b}`, several
    groups (the first varies slowest); braces holding neither stay as they are. A pattern giving more than
    `limit` names is an error naming it, raised before any name is made."""
    n = brace_count(pattern)
    if n > limit:
        said = f"{n}" if n <= 10**18 else "more than 10**18"
        raise VseInputError(
            f"{pattern}: the braces expand to {said} shard names, more than the {limit} "
            "vsekit reads; name fewer shards"
        )
    literals, groups = _brace_groups(pattern)
    choices: list[list[str]] = []
    for m, g in zip(_GROUP_RE.finditer(pattern), groups):
        if g is None:
            choices.append([m.group(0)])
        elif isinstance(g, range):
            a, b = _RANGE_RE.fullmatch(m.group(1)).groups()
            padded = (len(a) > 1 and a.startswith("0")) or (len(b) > 1 and b.startswith("0"))
            width = max(len(a), len(b)) if padded else 0
            choices.append([str(i).zfill(width) for i in g])
        else:
            choices.append(list(g))
    return [
        "".join(itertools.chain.from_iterable(itertools.zip_longest(literals, combo, fillvalue="")))
        for combo in itertools.product(*choices)
    ]


def expand_shards(patterns: Sequence[str]) -> list[Path]:
    """Every shard named by the patterns (brace expansion, then globs), in order, each once; a name that
    does not exist, or is not a regular file, is an error naming it; at most MAX_SHARD_NAMES names."""
    shards: list[Path] = []
    for pattern in patterns:
        for name in expand_braces(pattern, MAX_SHARD_NAMES - len(shards)):
            if any(ch in name for ch in "*?["):
                found = [f for f in sorted(glob.glob(name)) if os.path.isfile(f)]
                if not found:
                    raise VseInputError(f"{name}: no shard matches (from {pattern!r})")
                if len(shards) + len(found) > MAX_SHARD_NAMES:
                    raise VseInputError(
                        f"{name}: more than {MAX_SHARD_NAMES} shards in all; name fewer shards"
                    )
                shards += [Path(f) for f in found]
            elif not os.path.isfile(name):
                why = "not a regular file" if os.path.exists(name) else "no such shard"
                raise VseInputError(f"{name}: {why} (from {pattern!r})")
            else:
                shards.append(Path(name))
    seen: dict[str, Path] = {}
    for s in shards:
        seen.setdefault(os.path.abspath(s), s)
    if not seen:
        raise VseInputError("no shards given")
    return list(seen.values())


def split_key(member: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member as webdataset splits it: the key runs to the first dot of the file
    name (`a/000012.jpg` -> `a/000012`, `jpg`); None for a name without one."""
    m = _KEY_RE.match(member)
    return (m.group(1), m.group(2).lower()) if m else None


# --------------------------------------------------------------------------------------------- one shard


class _CappedReads:
    """The shard's file as tarfile sees it: any single read over TAR_READ_LIMIT (a pax or GNU long-name
    header declaring gigabytes) is a ReadError instead of an allocation of that size."""

    def __init__(self, f, name: str) -> None:
        self._f = f
        self.name = name
        self.mode = "rb"

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > TAR_READ_LIMIT:
            raise tarfile.ReadError(
                f"a header asks for a read of {n} bytes, more than the {TAR_READ_LIMIT} limit"
            )
        return self._f.read(n)

    def seek(self, *args) -> int:
        return self._f.seek(*args)

    def tell(self) -> int:
        return self._f.tell()

    def seekable(self) -> bool:
        return True


def _open_shard(shard: Path, problems: list[Problem]):
    """The shard's file, opened without following it into a FIFO or device (a regular file only), or None
    with a problem naming it."""
    try:
        fd = os.open(shard, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        problems.append(Problem(str(shard), BROKEN_SHARD, f"cannot be opened ({e.strerror or e}); skipped"))
        return None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        problems.append(Problem(str(shard), BROKEN_SHARD, f"is {file_kind(mode)}, not a tar file; skipped"))
        return None
    return os.fdopen(fd, "rb")


def _name_problem(name: str) -> str | None:
    """Why a member name cannot become an id and a line of the output (not UTF-8, a control character)."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        return "the member name is not valid UTF-8; skipped (rename it)"
    if _CONTROL_RE.search(name):
        return "the member name holds a control character; skipped (rename it)"
    if name.count("/") > MAX_MEMBER_DEPTH:
        return f"the member name is more than {MAX_MEMBER_DEPTH} folders deep; skipped (rename it)"
    if len(name.encode("utf-8")) > MAX_MEMBER_NAME_BYTES:
        return f"the member name is longer than {MAX_MEMBER_NAME_BYTES} bytes; skipped (rename it)"
    return None


def _shown(name: str, limit: int = 200) -> str:
    """A member name as a report shows it: `printable`, and a name longer than `limit` characters (a name
    thousands of folders deep) cut in the middle, so one report stays one readable line."""
    shown = printable(name)
    if len(shown) <= limit:
        return shown
    return f"{shown[: limit // 2]}…[{len(shown) - limit + limit // 4} characters]…{shown[-(limit // 4) :]}"


def _folder_clashes(
    shard: Path, samples: dict[str, dict[str, tarfile.TarInfo]], problems: list[Problem]
) -> None:
    """Drop (with a NAME_CLASH problem) every member one of whose folders is another member's name: `a.png`
    and `a.png/b.png` cannot both be files; the nested one is dropped, whichever comes first in the shard."""
    files = {m.name for members in samples.values() for m in members.values()}
    for key in list(samples):
        members = samples[key]
        for ext, m in list(members.items()):
            cuts = [i for i, ch in enumerate(m.name) if ch == "/"]
            clash = next((m.name[:i] for i in cuts if m.name[:i] in files), None)
            if clash is not None:
                why = f"{clash} is a member (a file) of this shard too, so it cannot be a folder; skipped"
                problems.append(Problem(f"{shard}:{m.name}", NAME_CLASH, why))
                del members[ext]
        if not members:
            del samples[key]


def _shard_members(
    shard: Path, f, problems: list[Problem]
) -> tuple[dict[str, dict[str, tarfile.TarInfo]], tarfile.TarFile | None]:
    """The usable members of a shard by key and extension, and the open TarFile (None when the shard is not
    a tar at all); every member refused and a shard cut short become problems."""
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        tf = tarfile.open(fileobj=_CappedReads(f, str(shard)), mode="r:")
    except (tarfile.TarError, OSError, EOFError, RecursionError) as e:
        f.seek(0)
        head = f.read(4)
        why = (
            "a compressed tar: unpack it to a plain .tar (img2dataset writes plain .tar shards)"
            if any(head.startswith(c) for c in _COMPRESSED)
            else f"not a readable uncompressed tar ({e})"
        )
        problems.append(Problem(str(shard), BROKEN_SHARD, f"{why}; skipped"))
        return samples, None
    n = 0
    ended = False  # tarfile stopped by itself (at the end-of-archive block, or silently at a bad header)
    try:
        while n < MAX_SHARD_MEMBERS:
            m = tf.next()
            if m is None:
                ended = True
                break
            n += 1
            where = f"{shard}:{_shown(m.name)}"
            if m.isdir():
                continue
            if not m.isfile() or m.issparse():
                kind = (
                    "a link" if m.issym() or m.islnk() else "sparse" if m.issparse() else "a device or FIFO"
                )
                problems.append(Problem(where, BROKEN_SHARD, f"{kind}, not a regular file; skipped"))
                continue
            bad_name = _name_problem(m.name)
            if bad_name:
                problems.append(Problem(where, BAD_NAME, bad_name))
                continue
            parts = split_key(m.name)
            if parts is None:
                why = (
                    "the file name starts with a dot, so it has no key (webdataset keys run up to the first "
                    "dot); skipped"
                    if m.name.rsplit("/", 1)[-1].startswith(".")
                    else "the file name has no extension, so it belongs to no sample; skipped"
                )
                problems.append(Problem(where, BAD_NAME, why))
                continue
            key, ext = parts
            members = samples.setdefault(key, {})
            if ext in members:
                problems.append(
                    Problem(where, NAME_CLASH, "a second member with the same key and extension; skipped")
                )
                continue
            members[ext] = m
        else:
            ended = tf.next() is None
            if not ended:
                why = f"more than {MAX_SHARD_MEMBERS} members; the rest of the shard is not read"
                problems.append(Problem(str(shard), BROKEN_SHARD, why))
    except (tarfile.TarError, OSError, EOFError, RecursionError) as e:
        why = f"unreadable after {n} member(s) ({e}); the samples read before it are used"
        problems.append(Problem(str(shard), BROKEN_SHARD, why))
        _folder_clashes(shard, samples, problems)
        return samples, tf
    _folder_clashes(shard, samples, problems)
    if ended:
        end = tf.offset  # where tarfile stopped: a whole zero block here is the end-of-archive marker
        f.seek(end)
        block = f.read(tarfile.BLOCKSIZE)
        if len(block) < tarfile.BLOCKSIZE or any(block):
            why = (
                "ends"
                if not block
                else "is cut inside a header"
                if len(block) < tarfile.BLOCKSIZE
                else "holds a damaged header"
            )
            why = (
                f"cut short or damaged: after {n} member(s) it {why} at byte {end}, not the end-of-archive "
                "block; the samples read before it are used"
            )
            problems.append(Problem(str(shard), BROKEN_SHARD, why))
    return samples, tf


def _size_problem(member: tarfile.TarInfo, cap: int, what: str, shard_size: int) -> str | None:
    """Why a member is not read, from its header alone: it declares more than `cap` bytes, or more than the
    shard holds after its header (a shard cut short)."""
    if member.size > cap:
        return f"{member.size} bytes is more than the {cap} byte limit of {what}; not read"
    if member.offset_data + member.size > shard_size:
        return (
            f"cut short: it declares {member.size} bytes, the shard holds "
            f"{max(0, shard_size - member.offset_data)} of them; not read"
        )
    return None


def _member_bytes(
    tf: tarfile.TarFile, member: tarfile.TarInfo, name: str, shard_size: int
) -> tuple[bytes | None, Problem | None]:
    """A caption member's bytes, read only when its declared size is within MAX_CAPTION_FILE_BYTES."""
    why = _size_problem(member, MAX_CAPTION_FILE_BYTES, "a caption file", shard_size)
    if why:
        return None, Problem(name, BAD_CAPTIONS, why)
    try:
        f = tf.extractfile(member)
        data = f.read(MAX_CAPTION_FILE_BYTES + 1) if f is not None else b""
    except (tarfile.TarError, OSError, EOFError) as e:
        return None, Problem(name, BAD_CAPTIONS, f"cannot be read ({e})")
    return data, None


def _json_captions(data: bytes, name: str) -> tuple[list[str], Problem | None]:
    """The "caption" of an img2dataset .json (a string or a list of strings), parsed within the bounds of
    `loads_bounded` (nesting, a number's digits, lone surrogates): a file outside them is a problem naming it."""
    try:
        meta = loads_bounded(data, name)
    except JsonBoundsError as e:
        return [], Problem(name, BAD_CAPTIONS, str(e).removeprefix(f"{name}: "))
    value = meta.get("caption") if isinstance(meta, dict) else None
    if value is None:
        return [], None
    caps = caption_cell(value)
    if caps is None:
        return [], Problem(
            name, BAD_CAPTIONS, f'its "caption" is {type(value).__name__}, not text or a list of text'
        )
    return [c for c in caps if c], None


def _picture_problem(tf: tarfile.TarFile, pic: tarfile.TarInfo, name: str, shard_size: int) -> Problem | None:
    """A picture member over MAX_PICTURE_BYTES or cut short, or whose header declares more pixels than
    `check_pixels` allows (only the header is read); one whose header cannot be read is left to the
    builder's check, which names the problem as it does for every input."""
    why = _size_problem(pic, MAX_PICTURE_BYTES, "a picture", shard_size)
    if why:
        return Problem(name, UNREADABLE, why)
    try:
        with tf.extractfile(pic) as f:
            check_pixels(f, name)
    except PixelLimitError as e:
        return Problem(name, UNREADABLE, e.detail)
    except Exception:  # noqa: BLE001 - a header PIL cannot read (many types): the builder's check reports it
        return None
    return None


def _sample(
    shard: Path,
    tf: tarfile.TarFile,
    shard_size: int,
    key: str,
    members: dict[str, tarfile.TarInfo],
    problems: list[Problem],
) -> Item | None:
    """The item of one sample with a picture, or None with its problems added; a member is read only after
    its declared size is checked."""
    pics = [e for e in members if e in PICTURE_EXTS]
    pic = members[pics[0]]
    name = f"{shard}:{pic.name}"
    for other in pics[1:]:
        why = f"{pic.name} has the same key; this one is skipped"
        problems.append(Problem(f"{shard}:{members[other].name}", NAME_CLASH, why))
    captions: list[str] = []
    bad = False
    if "txt" in members:
        where = f"{shard}:{members['txt'].name}"
        data, problem = _member_bytes(tf, members["txt"], where, shard_size)
        found = [problem] if problem else []
        if data is not None:
            caps, found = caption_lines(data, where)
            captions += caps
        problems += found
        bad |= any(p.kind == BAD_CAPTIONS for p in found)
    if "json" in members:
        where = f"{shard}:{members['json'].name}"
        data, problem = _member_bytes(tf, members["json"], where, shard_size)
        if data is not None:
            caps, problem = _json_captions(data, where)
            captions += caps
        problems += [problem] if problem else []
        bad |= problem is not None
    if not captions:
        if not bad:
            said = " / ".join(f"{key.rsplit('/', 1)[-1]}.{e}" for e in ("txt", "json") if e in members)
            problems.append(
                Problem(
                    name,
                    NO_CAPTION,
                    f"{said} holds no caption" if said else "no .txt or .json caption for this key",
                )
            )
        return None
    problem = _picture_problem(tf, pic, name, shard_size)
    if problem:
        problems.append(problem)
        return None
    return Item(name, key, PictureRef(shard, pic.offset_data, pic.size), f".{pics[0]}", captions)


def read_webdataset(patterns: Sequence[str]) -> Collected:
    """Samples of img2dataset-style shards: a picture member plus captions from key.txt and/or key.json."""
    shards = expand_shards(patterns)
    items: list[Item] = []
    problems: list[Problem] = []
    n_samples = n_pictures = orphans = 0
    for shard in shards:
        f = _open_shard(shard, problems)
        if f is None:
            continue
        with f:
            samples, tf = _shard_members(shard, f, problems)
            if tf is None:
                continue
            shard_size = os.fstat(f.fileno()).st_size
            for key, members in samples.items():
                n_samples += 1
                if not any(e in PICTURE_EXTS for e in members):
                    orphans += 1
                    said = ", ".join(sorted(m.name for m in members.values()))
                    problems.append(
                        Problem(f"{shard}:{key}", NO_PICTURE, f"no picture member ({said}); sample skipped")
                    )
                    continue
                n_pictures += 1
                item = _sample(shard, tf, shard_size, key, members, problems)
                items += [item] if item else []
    if orphans:
        log.info("%d sample(s) without a picture were skipped (listed among the problems)", orphans)
    source = {"kind": "webdataset", "input": " ".join(patterns), "shards": [str(s) for s in shards]}
    notes = {"shards": len(shards), "samples": n_samples, "pictures_found": n_pictures}
    return Collected(items, problems, source, notes=notes)


__all__ = [
    "read_webdataset",
    "expand_braces",
    "expand_shards",
    "brace_count",
    "split_key",
    "MAX_SHARD_NAMES",
    "MAX_SHARD_MEMBERS",
    "TAR_READ_LIMIT",
]
