"""The output folder of a build of users' own pictures: whether OUT may be written (new, an earlier build of
this builder, or refused), its marker, the pictures stored under OUT/images or referenced in place, the split
files staged in OUT/.staging and published by renaming (the old manifest removed first, so a folder without
`manifest.json` is an unfinished build), and JSON that stays valid UTF-8 whatever a path's bytes.

A stored picture's file name comes from its id, so from a shard member or a folder path: `output_name`
maps it into what a file system takes (each component at most MAX_COMPONENT_BYTES, leaving room under
NAME_MAX for the temporary name a crash-safe write uses; at most MAX_OUTPUT_DEPTH folders) and never lets a
file take a folder's name (`a.png` beside `a.png/b.png`)."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vsekit.data.manifest import ManifestError, read_manifest, remove_manifest
from vsekit.data.precomp import CAP2IMG, CAPS, IDS, IMAGES, IMS, IMS_LENGTHS, SplitWriter, writing_split
from vsekit.datasets.own_items import PICTURE_SUFFIXES, Picture
from vsekit.datasets.own_splits import SPLITS
from vsekit.errors import VseInputError
from vsekit.utils.io import (
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
    utf8_text,
)
from vsekit.utils.locks import LOCK_NAME
from vsekit.utils.progress import progress_bar

FORMAT = "vsekit-precomp/1"
NAME = "own"
SPLIT_FILES = (IMS, CAPS, CAP2IMG, IDS, IMAGES, "_meta.jsonl", IMS_LENGTHS)  # in the order files_sha256 lists
PROBLEMS_FILE = "problems.txt"
MARKER = "own_build.json"  # in OUT/.cache: this folder holds a (maybe unfinished) build of this builder
# one component of a stored picture's path: NAME_MAX (255 bytes) less what `atomic_path`'s temporary name adds
# (".NAME.XXXXXXXX.tmp": 14 bytes), with room to spare
MAX_COMPONENT_BYTES = 200
MAX_OUTPUT_DEPTH = 8  # folders of a stored picture's path under OUT/images: 8 x 200 bytes, far below PATH_MAX
_HASH_CHARS = 16
# a folder component that a picture's file name could equal (it ends in a picture suffix, maybe followed by
# '_'): it gains one more '_', so no file takes a folder's name and no two components map to one
_FILE_LIKE_RE = re.compile("(?:" + "|".join(re.escape(s) for s in PICTURE_SUFFIXES) + ")_*$", re.IGNORECASE)


def _fit(component: str, keep: str = "") -> str:
    """`component` (+ `keep`, a suffix that stays whole) within MAX_COMPONENT_BYTES of UTF-8: a longer one
    is cut at a character and ends with a hash of the whole, so two long names stay two."""
    whole = component + keep
    data = whole.encode("utf-8", "surrogateescape")
    if len(data) <= MAX_COMPONENT_BYTES:
        return whole
    digest = hashlib.sha256(data).hexdigest()[:_HASH_CHARS]
    room = MAX_COMPONENT_BYTES - len(keep.encode("utf-8")) - _HASH_CHARS - 1
    head = component.encode("utf-8", "surrogateescape")[:room].decode("utf-8", "ignore")
    return f"{head}-{digest}{keep}"


def output_name(ident: str, suffix: str) -> str:
    """The path under OUT/images of the picture with id `ident` (a `safe_id`: '/' between folders) and
    `suffix`: every component within MAX_COMPONENT_BYTES (a longer one cut and hashed), folders below
    MAX_OUTPUT_DEPTH joined with '+' into the file's name (a `safe_id` never holds '+'), and a folder whose name
    ends like a picture file given one more '_'. Distinct ids give distinct paths, and no path is a folder
    of another."""
    parts = ident.split("/")
    if len(parts) > MAX_OUTPUT_DEPTH + 1:
        parts = parts[:MAX_OUTPUT_DEPTH] + ["+".join(parts[MAX_OUTPUT_DEPTH:])]
    folders = [_fit(p + "_" if _FILE_LIKE_RE.search(p) else p) for p in parts[:-1]]
    return "/".join([*folders, _fit(parts[-1], suffix)])


def _is_ours(out: Path) -> bool:
    if (out / ".cache" / MARKER).is_file():
        return True
    try:
        return read_manifest(out).get("name") == NAME
    except ManifestError:
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
        raise VseInputError(
            f"{out}: exists, is not empty and holds no earlier `vse data folder | table | webdataset` "
            "build; nothing was written: choose a new or empty --out, or pass --overwrite to "
            "replace the dataset files there"
        )
    return "foreign"


def start_out(out: Path, state: str) -> None:
    """Create OUT and its marker; a foreign dataset's split files and manifest are removed (--overwrite)."""
    out.mkdir(parents=True, exist_ok=True)
    if state == "foreign":
        for split in SPLITS:
            for suffix in SPLIT_FILES:
                (out / f"{split}{suffix}").unlink(missing_ok=True)
        remove_manifest(out)
    marker = out / ".cache" / MARKER
    if not marker.is_file():
        atomic_write_json(marker, {"builder": "vsekit.datasets.own_pairs", "format": FORMAT})


def store_pictures(out: Path, pictures: Sequence[Picture], progress: bool) -> dict[str, str]:
    """Copy each picture to OUT/images/<id><suffix> (`output_name`; kept when already there with the same
    bytes)."""
    paths: dict[str, str] = {}
    taken: set[str] = set()
    for p in progress_bar(pictures, desc="store pictures", unit="img", enabled=progress):
        rel, k = f"images/{output_name(p.id, p.item.suffix)}", 1
        while rel in taken:  # two ids cut to one name (hashes made to match): never one file for both
            k += 1
            rel = f"images/{output_name(f'{p.id}-{k}', p.item.suffix)}"
        taken.add(rel)
        dest = out / rel
        if not (dest.is_file() and sha256_file(dest) == p.sha256):
            atomic_write_bytes(dest, p.item.picture.read(), fsync=False)
        paths[p.id] = rel
    return paths


def reference_pictures(
    out: Path, pictures: Sequence[Picture], input_root: Path | None
) -> tuple[dict[str, str], str]:
    """(id -> path relative to the images root, images_root as manifest.json declares it) for pictures
    left where they are: the root is the deepest folder holding them all (and `input_root`)."""
    resolved = {p.id: p.item.picture.path.resolve() for p in pictures}
    parents = [str(f.parent) for f in resolved.values()] + ([str(input_root.resolve())] if input_root else [])
    base = Path(os.path.commonpath(parents))
    out_abs = out.resolve()
    declared = os.path.relpath(base, out_abs) if base.is_relative_to(out_abs) else str(base)
    return {i: f.relative_to(base).as_posix() for i, f in resolved.items()}, declared


def listable(rel: str) -> bool:
    """Whether a picture path fits a line of `{split}_images.txt`: stripped, one line, valid UTF-8."""
    return rel == rel.strip() and "\n" not in rel and "\r" not in rel and utf8_text(rel) == rel


def _write_features(
    split: SplitWriter, ids: Sequence[str], sha_of: dict[str, str], where: dict, shape: tuple[int, int]
) -> None:
    """Stream the rows of a split into its features, filled in place (a split can be many GB)."""
    mm = split.memmap(IMS, (len(ids), *shape), np.float16)
    for row, ident in enumerate(ids):
        arr, r = where[sha_of[ident]]
        mm[row] = arr[r]


def write_split(
    stage: Path,
    split: str,
    ids: Sequence[str],
    by_id: dict[str, Picture],
    paths: dict[str, str],
    where: dict | None,
    shape: tuple[int, int] | None,
) -> dict:
    """Stage one split's files in `stage` (features when `where` is given, captions, caption -> row, ids,
    picture paths, a meta line per row); its counts, for the manifest."""
    caps, cap2img, metas = [], [], []
    for row, ident in enumerate(ids):
        p = by_id[ident]
        for c in p.captions:
            caps.append(c)
            cap2img.append(row)
        metas.append(
            {
                "id": ident,
                "sha256": p.sha256,
                "names": [utf8_text(n) for n in p.names],
                "captions": len(p.captions),
            }
        )
    with writing_split(stage, split) as w:
        if where is not None and shape is not None:
            _write_features(w, ids, {i: by_id[i].sha256 for i in ids}, where, shape)
        w.captions(caps)
        w.cap2img(cap2img)
        w.ids(ids)
        w.image_paths(paths[i] for i in ids)
    atomic_write_text(
        stage / f"{split}_meta.jsonl", "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in metas)
    )
    per_image = Counter(len(by_id[i].captions) for i in ids)
    return {
        "images": len(ids),
        "captions": len(caps),
        "captions_per_image": {str(k): per_image[k] for k in sorted(per_image)},
    }


def publish(out: Path, stage: Path, extra: Sequence[str]) -> dict[str, str]:
    """Rename the staged files over OUT's (a split file not staged is removed); sha256 of each published."""
    remove_manifest(out)  # from here until the new one: an unfinished build
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


def utf8_json(value: Any) -> Any:
    """`value` (JSON data) with every string valid UTF-8 (`utf8_text`): a path with other bytes is recorded
    escaped instead of failing when manifest.json is written, after the split files were published."""
    if isinstance(value, str):
        return utf8_text(value)
    if isinstance(value, dict):
        return {utf8_text(str(k)): utf8_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [utf8_json(v) for v in value]
    return value
