"""Users' own pictures and captions as a training set: the one builder behind `vse data folder | table |
webdataset` (the readers are in `vsekit.datasets.own_sources`).

A reader collects items (a name to report, a key for the id, where the picture's bytes are, its captions,
maybe a declared split) and the problems it found on the way. `build_own_dataset` then
0. holds `OUT/.lock` for the whole build (a second build into the same folder fails at once, naming it)
   and skips every caption `vsekit.data.text.caption_problem` refuses (a control character, more than
   MAX_CAPTION_CHARS characters), reporting it: `vse data check` applies the same rule;
1. checks every picture (read, sha256, full decode, on `workers` threads): an empty file or one that does
   not decode is reported by name and skipped;
2. merges duplicates (same sha256): the copy with the smallest id is kept, the captions of all copies are
   pooled, every other copy is reported by name; a merged picture has ONE split, so the same bytes never
   lie in two splits (a declared split conflict goes to the evaluation side: test, then dev);
3. with `strict`, stops on any problem, naming them all, before anything is written;
4. splits the pictures (a seeded permutation of the sorted ids: `dev` / `test` fractions below 1, or
   counts), unless the input declared them;
5. stores pictures that do not exist as files (tar members; every picture with `copy_images`) under
   `OUT/images/`, otherwise references them where they are through `manifest.json`'s `images_root`;
6. extracts grid features (`vsekit.datasets.own_features`: content-keyed, resumable cache), unless
   `pixels` (then backbone recipes train from the pictures);
7. writes the precomp layout: every split file goes to `OUT/.staging/` first, then the old manifest is
   removed, the files are renamed into place and `manifest.json` is written last. A folder without
   `manifest.json` is an unfinished build: run the same command again.

The check results are cached too (`OUT/.cache/checked.json`, keyed by file, size and mtime), so the rerun
of a stopped build does not read every picture again. A build that fails (an error, not Ctrl-C) removes
what it created in OUT unless it finished feature parts a rerun resumes from; what OUT held before it
started (an earlier build's cache) is never removed. Text that is not valid UTF-8 (a folder's path with other
bytes) is written to JSON with `\\xNN` escapes (`vsekit.utils.io.utf8_text`), and pictures whose folder
cannot be recorded that way are copied into OUT/images, so nothing fails once files are published.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import shutil
import time
import unicodedata
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from vsekit.data.precomp import DataFormatError
from vsekit.data.text import caption_problem
from vsekit.data.untrusted import MAX_PICTURE_BYTES, read_bounded
from vsekit.datasets.own_features import (
    FeatureOptions,
    compute_features,
    decode_picture,
    finished_parts,
    make_extractor,
)
from vsekit.errors import VseInputError
from vsekit.utils.io import (
    atomic_path,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
    utf8_text,
)
from vsekit.utils.locks import LOCK_NAME, folder_lock
from vsekit.utils.progress import progress_bar

log = logging.getLogger(__name__)

FORMAT = "vsekit-precomp/1"
NAME = "own"
SPLITS = ("train", "dev", "test")
SPLIT_FILES = ("_ims.npy", "_caps.txt", "_cap2img.txt", "_ids.txt", "_images.txt", "_meta.jsonl", "_ims_lengths.txt")
MANIFEST = "manifest.json"
PROBLEMS_FILE = "problems.txt"
MARKER = "own_build.json"  # in OUT/.cache: this folder holds a (maybe unfinished) build of this builder
CHECK_VERSION = 1  # bump when the picture check changes: cached results are then redone
CHECK_CHUNK = 4096  # pictures handed to the checking threads at a time
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp", ".tif", ".tiff")
SPLIT_ALIASES = {"train": "train", "training": "train", "restval": "train", "dev": "dev", "val": "dev",
                 "valid": "dev", "validation": "dev", "test": "test", "testing": "test"}  # fmt: skip
EVAL_ORDER = {"train": 0, "dev": 1, "test": 2}  # a picture declared in two splits goes to the later one

# problem kinds (each reported with the name of the picture, caption file or table row)
UNREADABLE = "unreadable picture"
EMPTY_FILE = "empty file"
MISSING_FILE = "missing picture"
NO_CAPTION = "no caption"
EMPTY_CAPTION = "empty caption"
BAD_CAPTIONS = "unreadable captions"
DUPLICATE = "duplicate picture"
NAME_CLASH = "name clash"
BAD_NAME = "bad file name"
SPLIT_CONFLICT = "split conflict"
BROKEN_SHARD = "broken shard"
# and the kinds of `vsekit.data.text.caption_problem` ("control character", "over-long caption"): a caption skipped
# kinds that leave a picture out (the others: a duplicate merged, a split resolved, a caption line dropped)
SKIPPING = (UNREADABLE, EMPTY_FILE, MISSING_FILE, NO_CAPTION, BAD_CAPTIONS, NAME_CLASH, BAD_NAME)


@dataclass(frozen=True)
class PictureRef:
    """Where a picture's bytes are: a file, or `size` bytes at `offset` of an uncompressed tar."""

    path: Path
    offset: int | None = None
    size: int | None = None

    @property
    def is_file(self) -> bool:
        return self.offset is None

    def read(self) -> bytes:
        if self.offset is None:  # a path the reader resolved inside its root: no link followed, capped
            return read_bounded(self.path, MAX_PICTURE_BYTES, expected="a picture file")
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            data = f.read(self.size or 0)
        if len(data) != self.size:
            raise OSError(f"{self.path}: truncated ({len(data)} of {self.size} bytes at offset {self.offset})")
        return data

    def stamp(self) -> str:
        """Key of the check cache: the file (resolved), its size and mtime, and the member's place."""
        st = self.path.stat()
        return f"{self.path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{self.offset}|{self.size}"


@dataclass
class Item:
    """One picture of the input: `name` is what reports call it, `key` what its id is made from."""

    name: str
    key: str
    picture: PictureRef
    suffix: str
    captions: list[str]
    split: str | None = None


@dataclass(frozen=True)
class Problem:
    name: str
    kind: str
    detail: str

    def __str__(self) -> str:
        return f"{self.name}: {self.kind}: {self.detail}"


@dataclass
class Collected:
    """What a reader found: the items, the problems met while reading, and what the input was."""

    items: list[Item]
    problems: list[Problem]
    source: dict
    declared_splits: bool = False
    notes: dict = field(default_factory=dict)


@dataclass(frozen=True)
class BuildOptions:
    """How to build: split sizes (fractions below 1, or counts), seed, features or `pixels`, and policies."""

    dev: float = 0.1
    test: float = 0.1
    seed: int = 0
    pixels: bool = False
    copy_images: bool = False
    strict: bool = False
    overwrite: bool = False
    workers: int = 2
    progress: bool = True
    features: FeatureOptions = field(default_factory=FeatureOptions)


@dataclass
class Picture:
    """One unique picture of the output (duplicates merged)."""

    id: str
    sha256: str
    item: Item
    names: list[str]
    captions: list[str]
    split: str | None


# --------------------------------------------------------------------------------------------- text, ids


def normalise_caption(text: str) -> str:
    """Whitespace (newlines, tabs) collapsed to single spaces: a caption must fit on one line."""
    return " ".join(str(text).split())


def unique_captions(captions: Sequence[str]) -> list[str]:
    """Normalised, non-empty, each once (in first-seen order): pooled duplicates repeat captions."""
    seen: dict[str, None] = {}
    for c in captions:
        c = normalise_caption(c)
        if c:
            seen.setdefault(c, None)
    return list(seen)


def screen_captions(items: Sequence[Item]) -> tuple[list[Item], list[Problem]]:
    """The items with every caption `caption_problem` refuses left out (the one rule `vse data check` applies
    too), each reported; an item left without a caption is reported (NO_CAPTION) and left out."""
    kept, problems = [], []
    for it in items:
        good = []
        for k, c in enumerate(it.captions, 1):
            problem = caption_problem(normalise_caption(c))
            if problem is None:
                good.append(c)
            else:
                problems.append(Problem(it.name, problem[0], f"caption {k}: {problem[1]}; skipped"))
        if good:
            kept.append(it if len(good) == len(it.captions) else replace(it, captions=good))
        else:
            problems.append(Problem(it.name, NO_CAPTION, "every caption of it was skipped (above); picture skipped"
                                    if it.captions else "no caption; picture skipped"))  # fmt: skip
    return kept, problems


def resolve_split(declared: Sequence[tuple[str, str]], name: str) -> tuple[str | None, Problem | None]:
    """The one split of a picture declared (by `(source name, split)` pairs) maybe more than once: the
    evaluation side of a conflict (test, then dev), which is reported."""
    values = sorted({s for _, s in declared}, key=EVAL_ORDER.get)
    if len(values) <= 1:
        return (values[0] if values else None), None
    where = ", ".join(f"{n} ({s})" for n, s in declared)
    return values[-1], Problem(name, SPLIT_CONFLICT, f"declared in several splits: {where}; it goes to {values[-1]}")


def split_name(value: str, where: str) -> str:
    """A declared split, with its aliases (val/validation -> dev, restval -> train); else an input error."""
    key = str(value).strip().lower()
    if key not in SPLIT_ALIASES:
        raise VseInputError(f"{where}: split {str(value)!r} is not train, dev or test (aliases: "
                            f"{', '.join(k for k in SPLIT_ALIASES if k not in SPLITS)})")  # fmt: skip
    return SPLIT_ALIASES[key]


_UNSAFE = re.compile(r"[^\w.\-]+")


def safe_id(key: str) -> str:
    """An id from a relative path without extension: '/' kept between folders, any run of other characters
    than letters, digits, '_', '.', '-' becomes '_', no segment starts with '.' (ids name files)."""
    text = unicodedata.normalize("NFC", key).replace("\\", "/")
    parts = []
    for seg in text.split("/"):
        seg = _UNSAFE.sub("_", seg)
        if seg in ("", ".", ".."):
            continue
        parts.append("_" + seg[1:] if seg.startswith(".") else seg)
    return "/".join(parts) or "_"


def assign_ids(items: Sequence[Item]) -> list[str]:
    """Safe, unique ids: names that collide once made safe get -2, -3, ... (a name that was safe already keeps
    its id; the others follow in the order of their names)."""
    safe = [safe_id(it.key) for it in items]
    order = sorted(range(len(items)), key=lambda i: (safe[i], safe[i] != items[i].key, items[i].name))
    taken: set[str] = set()
    ids = [""] * len(items)
    for i in order:
        ident, k = safe[i], 1
        while ident in taken:
            k += 1
            ident = f"{safe[i]}-{k}"
        taken.add(ident)
        ids[i] = ident
    return ids


# --------------------------------------------------------------------------------------------- output dir


def _is_ours(out: Path) -> bool:
    if (out / ".cache" / MARKER).is_file():
        return True
    try:
        return json.loads((out / MANIFEST).read_text(encoding="utf-8")).get("name") == NAME
    except (OSError, ValueError, AttributeError):
        return False


def check_out_dir(out: Path, overwrite: bool) -> str:
    """'new' (missing or empty), 'ours' (an earlier build of this builder, finished or not) or 'foreign'
    (refused unless `overwrite`). Writes nothing."""
    if out.exists() and not out.is_dir():
        raise VseInputError(f"{out}: exists and is not a folder; choose another --out")
    if not out.is_dir() or not any(p.name != LOCK_NAME for p in out.iterdir()):  # the lock: this build's own
        return "new"
    if _is_ours(out):
        return "ours"
    if not overwrite:
        raise VseInputError(f"{out}: exists, is not empty and holds no earlier `vse data folder | table | webdataset` "
                            "build; nothing was written: choose a new or empty --out, or pass --overwrite to "
                            "replace the dataset files there")  # fmt: skip
    return "foreign"


def _start_out(out: Path, state: str) -> None:
    """Create OUT and its marker; a foreign dataset's split files and manifest are removed (--overwrite)."""
    out.mkdir(parents=True, exist_ok=True)
    if state == "foreign":
        for split in SPLITS:
            for suffix in SPLIT_FILES:
                (out / f"{split}{suffix}").unlink(missing_ok=True)
        (out / MANIFEST).unlink(missing_ok=True)
    marker = out / ".cache" / MARKER
    if not marker.is_file():
        atomic_write_json(marker, {"builder": "vsekit.datasets.own_pairs", "format": FORMAT})


# --------------------------------------------------------------------------------------------- checks


def check_picture(ref: PictureRef, name: str) -> tuple[str | None, Problem | None]:
    """(sha256, None) for a picture that reads and decodes; (None, problem) otherwise."""
    import hashlib

    try:
        data = ref.read()
    except FileNotFoundError:
        return None, Problem(name, MISSING_FILE, "no such file")
    except OSError as e:
        return None, Problem(name, UNREADABLE, f"cannot be read ({e.strerror or e})")
    if not data:
        return None, Problem(name, EMPTY_FILE, "0 bytes")
    try:
        img = decode_picture(data, name)
        img.convert("RGB")  # what every extractor does: an unconvertible mode fails here, not mid-features
    except DataFormatError as e:
        return None, Problem(name, UNREADABLE, str(e).removeprefix(f"{name}: "))
    except (OSError, ValueError) as e:
        return None, Problem(name, UNREADABLE, f"cannot convert to RGB ({e})")
    return hashlib.sha256(data).hexdigest(), None


def _read_check_cache(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if isinstance(data, dict) and data.get("version") == CHECK_VERSION else {}


def _check_all(items: Sequence[Item], cache: dict, workers: int, progress: bool,
               used: set[str]) -> list[tuple[str | None, Problem | None]]:  # fmt: skip
    """Check results of every item (cached ones reused); `cache` gains the new results as they come, `used`
    the cache keys of these items."""

    def one(item: Item) -> tuple[str | None, Problem | None]:
        try:
            stamp = item.picture.stamp()
            used.add(stamp)
        except OSError:
            stamp = None
        hit = cache.get(stamp) if stamp else None
        if hit is not None:
            sha, kind, detail = hit
            return sha, (Problem(item.name, kind, detail) if kind else None)
        sha, problem = check_picture(item.picture, item.name)
        if stamp:
            cache[stamp] = [sha, problem.kind if problem else None, problem.detail if problem else None]
        return sha, problem

    results = []
    bar = progress_bar(total=len(items), desc="check pictures", unit="img", enabled=progress)
    pool = ThreadPoolExecutor(max(1, workers))
    try:
        for start in range(0, len(items), CHECK_CHUNK):  # bounded: a million pictures are not a million futures
            for result in pool.map(one, items[start : start + CHECK_CHUNK]):
                results.append(result)
                bar.update()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: the queued checks are dropped, not run
        bar.close()
    return results


def merge_duplicates(items: Sequence[Item], ids: Sequence[str], shas: Sequence[str]) -> tuple[list[Picture], list[Problem]]:
    """One Picture per sha256: the copy with the smallest id is kept, captions pooled (kept copy first), one
    split (the evaluation side of any conflict); every other copy is a DUPLICATE problem."""
    groups: dict[str, list[int]] = {}
    for i, sha in enumerate(shas):
        groups.setdefault(sha, []).append(i)
    pictures, problems = [], []
    for sha, members in groups.items():
        members.sort(key=lambda i: ids[i])
        keep = members[0]
        captions: list[str] = []
        for i in members:
            captions += items[i].captions
        for i in members[1:]:
            problems.append(Problem(items[i].name, DUPLICATE, f"same bytes as {items[keep].name}; its "
                                    f"{len(items[i].captions)} caption(s) were merged into {ids[keep]!r}"))  # fmt: skip
        split, conflict = resolve_split([(items[i].name, items[i].split) for i in members if items[i].split],
                                        items[keep].name)  # fmt: skip
        problems += [conflict] if conflict else []
        pictures.append(Picture(ids[keep], sha, items[keep], [items[i].name for i in members],
                                unique_captions(captions), split))  # fmt: skip
    pictures.sort(key=lambda p: p.id)
    return pictures, problems


# --------------------------------------------------------------------------------------------- splits


def split_count(value: float, n: int, flag: str) -> int:
    """Pictures a split gets: a fraction in [0, 1) of n (at least 1 when above 0), or a whole count >= 1."""
    if not math.isfinite(value) or value < 0:
        raise VseInputError(f"{flag} must be a fraction in [0, 1) or a count, got {value}")
    if value < 1:
        return 0 if value == 0 else max(1, int(math.floor(value * n + 0.5)))
    if value != int(value):
        raise VseInputError(f"{flag} {value}: give a fraction below 1 (0.1) or a whole number of pictures (500)")
    return int(value)


def assign_splits(ids: Sequence[str], dev: float, test: float, seed: int) -> dict[str, list[str]]:
    """Seeded split by picture: a permutation (from `seed`) of the sorted ids; test first, then dev."""
    ids = sorted(ids)
    n = len(ids)
    t, d = split_count(test, n, "--test"), split_count(dev, n, "--dev")
    if t + d >= n:
        raise VseInputError(f"{n} usable picture(s) cannot give {t} test and {d} dev pictures and keep one to "
                            "train on; lower --dev / --test")  # fmt: skip
    perm = np.random.default_rng(seed).permutation(n)
    return {"test": sorted(ids[i] for i in perm[:t]), "dev": sorted(ids[i] for i in perm[t : t + d]),
            "train": sorted(ids[i] for i in perm[t + d :])}  # fmt: skip


# --------------------------------------------------------------------------------------------- pictures


def _store_pictures(out: Path, pictures: Sequence[Picture], progress: bool) -> dict[str, str]:
    """Copy each picture to OUT/images/<id><suffix> (kept when already there with the same bytes)."""
    paths = {}
    for p in progress_bar(pictures, desc="store pictures", unit="img", enabled=progress):
        rel = f"images/{p.id}{p.item.suffix}"
        dest = out / rel
        if not (dest.is_file() and sha256_file(dest) == p.sha256):
            atomic_write_bytes(dest, p.item.picture.read(), fsync=False)
        paths[p.id] = rel
    return paths


def _reference_pictures(out: Path, pictures: Sequence[Picture], input_root: Path | None) -> tuple[dict[str, str], str]:
    """(id -> path relative to the images root, images_root as manifest.json declares it) for pictures
    left where they are: the root is the deepest folder holding them all (and `input_root`)."""
    resolved = {p.id: p.item.picture.path.resolve() for p in pictures}
    parents = [str(f.parent) for f in resolved.values()] + ([str(input_root.resolve())] if input_root else [])
    base = Path(os.path.commonpath(parents))
    out_abs = out.resolve()
    declared = os.path.relpath(base, out_abs) if base.is_relative_to(out_abs) else str(base)
    return {i: f.relative_to(base).as_posix() for i, f in resolved.items()}, declared


# --------------------------------------------------------------------------------------------- writing


def _write_features(path: Path, ids: Sequence[str], sha_of: dict[str, str], where: dict, shape: tuple[int, int]) -> None:
    """Stream the rows of a split into a temp .npy beside `path`, fsync, rename (a split can be many GB)."""
    with atomic_path(path) as tmp:
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(len(ids), *shape))
        for row, ident in enumerate(ids):
            arr, r = where[sha_of[ident]]
            mm[row] = arr[r]
        mm.flush()
        del mm


def _write_split(stage: Path, split: str, ids: Sequence[str], by_id: dict[str, Picture], paths: dict[str, str],
                 where: dict | None, shape: tuple[int, int] | None) -> dict:  # fmt: skip
    caps, cap2img, metas = [], [], []
    for row, ident in enumerate(ids):
        p = by_id[ident]
        for c in p.captions:
            caps.append(c)
            cap2img.append(row)
        metas.append({"id": ident, "sha256": p.sha256, "names": [utf8_text(n) for n in p.names],
                      "captions": len(p.captions)})  # fmt: skip
    if where is not None and shape is not None:
        _write_features(stage / f"{split}_ims.npy", ids, {i: by_id[i].sha256 for i in ids}, where, shape)
    atomic_write_text(stage / f"{split}_caps.txt", "".join(c + "\n" for c in caps))
    atomic_write_text(stage / f"{split}_cap2img.txt", "".join(f"{r}\n" for r in cap2img))
    atomic_write_text(stage / f"{split}_ids.txt", "".join(f"{i}\n" for i in ids))
    atomic_write_text(stage / f"{split}_images.txt", "".join(f"{paths[i]}\n" for i in ids))
    atomic_write_text(stage / f"{split}_meta.jsonl",
                      "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in metas))  # fmt: skip
    per_image = Counter(len(by_id[i].captions) for i in ids)
    return {"images": len(ids), "captions": len(caps),
            "captions_per_image": {str(k): per_image[k] for k in sorted(per_image)}}  # fmt: skip


def _publish(out: Path, stage: Path, extra: Sequence[str]) -> dict[str, str]:
    """Rename the staged files over OUT's (a split file not staged is removed); sha256 of each published."""
    (out / MANIFEST).unlink(missing_ok=True)  # from here until the new one: an unfinished build
    published = {}
    names = [f"{s}{suffix}" for s in SPLITS for suffix in SPLIT_FILES] + list(extra)
    for name in names:
        src = stage / name
        if src.is_file():
            os.replace(src, out / name)
            published[name] = sha256_file(out / name)
        else:
            (out / name).unlink(missing_ok=True)
    shutil.rmtree(stage, ignore_errors=True)
    return published


# --------------------------------------------------------------------------------------------- build


def report_problems(problems: Sequence[Problem]) -> None:
    for p in problems:
        log.warning("%s", p)


def build_own_dataset(collected: Collected, out_dir: str | Path, options: BuildOptions | None = None,
                      input_root: str | Path | None = None) -> dict:  # fmt: skip
    """Build the precomp dataset of `collected` in `out_dir` (or finish a stopped build); returns the manifest.

    `input_root`: the folder the input's pictures are named from (a `vse data folder` DIR, a table's images
    root), the least images root when the pictures are referenced in place. One build at a time holds OUT
    (`OUT/.lock`); a build that fails removes what it created there (see the module's docstring).
    """
    opts = options or BuildOptions()
    out = Path(out_dir)
    with folder_lock(out, "`vse data` build", "this folder", VseInputError, log.info):
        before = {p.name for p in out.iterdir()}
        try:
            return _build(collected, out, opts, input_root)
        except Exception:  # not Ctrl-C: a stopped build keeps its work for the rerun
            _undo_failed_build(out, before)
            raise


def _undo_failed_build(out: Path, before: set[str]) -> None:
    """Remove what a failed build created in OUT (its cache, staged files, copied pictures), unless it finished
    feature parts a rerun resumes from; what OUT held before the build is never touched."""
    created = sorted(p for p in out.iterdir() if p.name not in before and p.name != LOCK_NAME)
    if (out / ".cache") in created and finished_parts(out / ".cache" / "features"):
        log.info("the feature parts done so far are kept in %s; run the same command again to resume",
                 utf8_text(str(out / ".cache")))  # fmt: skip
        created = [p for p in created if p.name == ".staging"]
    for p in created:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _utf8_json(value):
    """`value` (JSON data) with every string valid UTF-8 (`utf8_text`): a path with other bytes is recorded
    escaped instead of failing when manifest.json is written, after the split files were published."""
    if isinstance(value, str):
        return utf8_text(value)
    if isinstance(value, dict):
        return {utf8_text(str(k)): _utf8_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_utf8_json(v) for v in value]
    return value


def _listable(rel: str) -> bool:
    """Whether a picture path fits a line of `{split}_images.txt`: stripped, one line, valid UTF-8."""
    return rel == rel.strip() and "\n" not in rel and "\r" not in rel and utf8_text(rel) == rel


def _build(collected: Collected, out: Path, opts: BuildOptions, input_root: str | Path | None) -> dict:
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    state = check_out_dir(out, opts.overwrite)
    items, caption_problems = screen_captions(collected.items)
    problems = list(collected.problems) + caption_problems
    what = collected.source.get("input", "the input")
    if not items and not problems:
        raise VseInputError(f"{what}: no pictures found")
    if collected.declared_splits and any(it.split is None for it in items):
        first = next(it for it in items if it.split is None)
        raise VseInputError(f"{first.name}: no split declared (every picture needs one when splits are declared)")
    # a machine that cannot extract (no CUDA, a missing package, bad weights) fails before any picture is read
    extractor = None if opts.pixels else make_extractor(opts.features)
    timings["setup"] = time.perf_counter() - t0

    ids = assign_ids(items)
    check_cache_path = out / ".cache" / "checked.json"
    cache = _read_check_cache(check_cache_path) if state == "ours" else {}
    n_cached = len(cache)
    used: set[str] = set()
    try:
        checked = _check_all(items, cache, opts.workers, opts.progress, used)
    except BaseException:
        if not opts.strict and len(cache) > n_cached:  # keep what was checked: the rerun starts from there
            _start_out(out, state)
            atomic_write_json(check_cache_path, {"version": CHECK_VERSION, "entries": cache})
        raise
    cache = {k: v for k, v in cache.items() if k in used}  # files no longer in the input are forgotten
    timings["check"] = time.perf_counter() - t0 - timings["setup"]
    good = [i for i, (_, p) in enumerate(checked) if p is None]
    problems += [p for _, p in checked if p is not None]
    pictures, dup_problems = merge_duplicates([items[i] for i in good], [ids[i] for i in good],
                                              [checked[i][0] for i in good])  # fmt: skip
    problems += dup_problems
    if problems and opts.strict:
        raise VseInputError(f"--strict: {len(problems)} problem(s) in {what}; nothing was written:\n"
                            + "\n".join(f"  {p}" for p in problems))  # fmt: skip
    report_problems(problems)
    if not pictures:
        raise VseInputError(f"{what}: no usable picture with a caption ({len(problems)} problem(s), listed above)")
    if collected.declared_splits:
        splits = {s: sorted(p.id for p in pictures if p.split == s) for s in SPLITS}
        if not splits["train"]:
            raise VseInputError(f"{what}: no picture is declared in the train split")
    else:
        splits = assign_splits([p.id for p in pictures], opts.dev, opts.test, opts.seed)
    for s in ("dev", "test"):
        if not splits[s]:
            log.warning("%s: the %s split is empty, so no %s files are written%s", what, s, s,
                        "; training needs a dev split (or data.val_split=...)" if s == "dev" else "")  # fmt: skip

    _start_out(out, state)
    atomic_write_json(check_cache_path, {"version": CHECK_VERSION, "entries": cache})
    by_id = {p.id: p for p in pictures}
    t1 = time.perf_counter()
    store = opts.copy_images or not all(p.item.picture.is_file for p in pictures)
    images_root = None
    if not store:
        paths, images_root = _reference_pictures(out, pictures, Path(input_root) if input_root else None)
        odd = [rel for rel in paths.values() if not _listable(rel)]
        if odd:  # `{split}_images.txt` holds one stripped UTF-8 path per line
            log.info("%d picture path(s) cannot be listed one per line in UTF-8 (e.g. %r): the pictures are copied "
                     "into %s", len(odd), utf8_text(odd[0]), utf8_text(str(out / "images")))  # fmt: skip
        elif utf8_text(images_root) != images_root:
            log.info("the pictures' folder %s is not a UTF-8 path, which manifest.json cannot record: the pictures "
                     "are copied into %s", utf8_text(images_root), utf8_text(str(out / "images")))  # fmt: skip
        if odd or utf8_text(images_root) != images_root:
            store, images_root = True, None
    if store:
        paths = _store_pictures(out, pictures, opts.progress)
    timings["pictures"] = time.perf_counter() - t1

    where, spec, shape, device, feat_stats = None, None, None, None, {"computed": 0, "reused": 0}
    if extractor is not None:
        t2 = time.perf_counter()
        spec, shape, device = extractor.spec, extractor.shape, str(extractor.device)
        refs = {p.sha256: (p.item.picture, p.item.name) for p in pictures}
        where, feat_stats = compute_features(refs, out / ".cache" / "features", extractor,
                                             opts.features.batch_size, opts.workers, opts.progress)  # fmt: skip
        timings["features"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    stage = out / ".staging"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    split_info = {s: _write_split(stage, s, splits[s], by_id, paths, where, shape) for s in SPLITS if splits[s]}
    if problems:
        atomic_write_text(stage / PROBLEMS_FILE, "".join(f"{utf8_text(str(p))}\n" for p in problems))

    kinds = Counter(p.kind for p in problems)
    manifest: dict = {
        "format": FORMAT,
        "name": NAME,
        "source": collected.source,
        "build": {"split_by": "declared" if collected.declared_splits else "seeded fractions",
                  "dev": None if collected.declared_splits else opts.dev,
                  "test": None if collected.declared_splits else opts.test,
                  "seed": opts.seed, "pixels": opts.pixels, "copy_images": store, "strict": opts.strict,
                  "backbone": None if opts.pixels else opts.features.backbone,
                  "batch_size": None if opts.pixels else opts.features.batch_size,
                  "device": device},  # fmt: skip
        "counts": {**collected.notes, "pictures": len(pictures), "captions": sum(len(p.captions) for p in pictures),
                   "duplicates_merged": kinds.get(DUPLICATE, 0),
                   "skipped": sum(n for k, n in kinds.items() if k in SKIPPING)},  # fmt: skip
        "problems": dict(sorted(kinds.items())),
        "splits": split_info,
        "layout": {
            "{split}_ims.npy": "float16 (images, regions, dim) grid features, one row per picture"
            if not opts.pixels else "not written: pictures only (--pixels), for backbone recipes",
            "{split}_caps.txt": "one caption per line, the captions of one picture consecutive",
            "{split}_cap2img.txt": "0-based picture row of each caption line",
            "{split}_ids.txt": "picture id (its name without extension, made safe) per row",
            "{split}_images.txt": "picture path per row, relative to images_root (else this folder)",
            "{split}_meta.jsonl": "per row: id, sha256 of the bytes, every input name merged into it, captions",
            PROBLEMS_FILE: "every problem of the input, one per line (absent when there were none)",
        },
        "files_sha256": {},
        "cache": {"features_computed": feat_stats["computed"], "features_reused": feat_stats["reused"]},
        "timings_s": {},
    }
    if images_root is not None:
        manifest["images_root"] = images_root
    if spec is not None:
        manifest["features"] = spec
    manifest = _utf8_json(manifest)  # before anything is published: writing it cannot fail on a path's bytes
    manifest["files_sha256"] = _publish(out, stage, [PROBLEMS_FILE])
    timings["write"] = time.perf_counter() - t3
    timings["total"] = time.perf_counter() - t0
    manifest["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    atomic_write_json(out / MANIFEST, manifest, ensure_ascii=False)
    return manifest


def summary_line(manifest: dict, out: str | Path) -> str:
    """One line for the terminal: split sizes, captions, what was skipped, features computed/reused, time."""
    sp = manifest["splits"]
    sizes = " / ".join(f"{s} {sp[s]['images']:,}" if s in sp else f"{s} 0" for s in SPLITS)
    c = manifest["counts"]
    kinds = manifest.get("problems", {})
    skipped = ", ".join(f"{k} {n}" for k, n in kinds.items()) or "none"
    feats = ("pictures only (--pixels)" if manifest["build"]["pixels"] else
             f"features {manifest['cache']['features_computed']:,} computed, {manifest['cache']['features_reused']:,} reused")  # fmt: skip
    out = utf8_text(str(out))  # printable whatever the folder's bytes
    return (f"dataset ready in {out}: pictures {sizes}, {c['captions']:,} captions; problems: {skipped}; {feats} "
            f"({manifest['timings_s']['total']:.1f} s); check it with: vse data check {out}")


__all__ = ["BuildOptions", "Collected", "Item", "PictureRef", "Problem", "Picture", "build_own_dataset",
           "assign_ids", "assign_splits", "safe_id", "split_count", "split_name", "merge_duplicates",
           "normalise_caption", "unique_captions", "resolve_split", "screen_captions", "summary_line", "PICTURE_SUFFIXES", "SPLITS"]  # fmt: skip
