"""What of users' own input is usable: captions screened (`vsekit.data.text.caption_problem`, the rule
`vse data check` applies too), safe unique ids, every picture read, hashed and decoded on threads (the
results cached by file, size and mtime in `OUT/.cache/checked.json`, so a rerun reads no picture again), and
duplicates (same sha256) merged into one picture with one split."""

from __future__ import annotations

import json
import re
import unicodedata
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from vsekit.data.precomp import DataFormatError
from vsekit.data.text import caption_problem
from vsekit.datasets.own_features import decode_picture
from vsekit.datasets.own_items import (
    DUPLICATE,
    EMPTY_FILE,
    MISSING_FILE,
    NO_CAPTION,
    UNREADABLE,
    Item,
    Picture,
    PictureRef,
    Problem,
    normalise_caption,
)
from vsekit.datasets.own_splits import resolve_split
from vsekit.utils.io import atomic_write_json
from vsekit.utils.progress import progress_bar

CHECK_VERSION = 1  # bump when the picture check changes: cached results are then redone
CHECK_CHUNK = 4096  # pictures handed to the checking threads at a time


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
            problems.append(
                Problem(
                    it.name,
                    NO_CAPTION,
                    "every caption of it was skipped (above); picture skipped"
                    if it.captions
                    else "no caption; picture skipped",
                )
            )
    return kept, problems


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


def read_check_cache(path: Path) -> dict:
    """The check results an earlier build cached (none when missing, unreadable or of another
    CHECK_VERSION)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data.get("entries", {}) if isinstance(data, dict) and data.get("version") == CHECK_VERSION else {}


def write_check_cache(path: Path, entries: dict) -> None:
    """Record the check results (stamp -> [sha256, problem kind, detail]) for the next build here."""
    atomic_write_json(path, {"version": CHECK_VERSION, "entries": entries})


def check_all(
    items: Sequence[Item], cache: dict, workers: int, progress: bool, used: set[str]
) -> list[tuple[str | None, Problem | None]]:
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
        for start in range(
            0, len(items), CHECK_CHUNK
        ):  # bounded: a million pictures are not a million futures
            for result in pool.map(one, items[start : start + CHECK_CHUNK]):
                results.append(result)
                bar.update()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)  # Ctrl-C: the queued checks are dropped, not run
        bar.close()
    return results


def merge_duplicates(
    items: Sequence[Item], ids: Sequence[str], shas: Sequence[str]
) -> tuple[list[Picture], list[Problem]]:
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
            problems.append(
                Problem(
                    items[i].name,
                    DUPLICATE,
                    f"same bytes as {items[keep].name}; its "
                    f"{len(items[i].captions)} caption(s) were merged into {ids[keep]!r}",
                )
            )
        split, conflict = resolve_split(
            [(items[i].name, items[i].split) for i in members if items[i].split], items[keep].name
        )
        problems += [conflict] if conflict else []
        pictures.append(
            Picture(
                ids[keep],
                sha,
                items[keep],
                [items[i].name for i in members],
                unique_captions(captions),
                split,
            )
        )
    pictures.sort(key=lambda p: p.id)
    return pictures, problems
