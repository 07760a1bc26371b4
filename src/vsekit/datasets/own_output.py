"""The output folder of a build of users' own pictures: whether OUT may be written (new, an earlier build of
this builder, or refused), its marker, the pictures stored under OUT/images or referenced in place, the split
files staged in OUT/.staging and published by renaming (the old manifest removed first, so a folder without
`manifest.json` is an unfinished build), and JSON that stays valid UTF-8 whatever a path's bytes."""

from __future__ import annotations

import json
import os
import shutil
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from vsekit.datasets.own_items import Picture
from vsekit.datasets.own_splits import SPLITS
from vsekit.errors import VseInputError
from vsekit.utils.io import (
    atomic_path,
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
SPLIT_FILES = (
    "_ims.npy",
    "_caps.txt",
    "_cap2img.txt",
    "_ids.txt",
    "_images.txt",
    "_meta.jsonl",
    "_ims_lengths.txt",
)
MANIFEST = "manifest.json"
PROBLEMS_FILE = "problems.txt"
MARKER = "own_build.json"  # in OUT/.cache: this folder holds a (maybe unfinished) build of this builder


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
        (out / MANIFEST).unlink(missing_ok=True)
    marker = out / ".cache" / MARKER
    if not marker.is_file():
        atomic_write_json(marker, {"builder": "vsekit.datasets.own_pairs", "format": FORMAT})


def store_pictures(out: Path, pictures: Sequence[Picture], progress: bool) -> dict[str, str]:
    """Copy each picture to OUT/images/<id><suffix> (kept when already there with the same bytes)."""
    paths = {}
    for p in progress_bar(pictures, desc="store pictures", unit="img", enabled=progress):
        rel = f"images/{p.id}{p.item.suffix}"
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
    path: Path, ids: Sequence[str], sha_of: dict[str, str], where: dict, shape: tuple[int, int]
) -> None:
    """Stream the rows of a split into a temp .npy beside `path`, fsync, rename (a split can be many GB)."""
    with atomic_path(path) as tmp:
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(len(ids), *shape))
        for row, ident in enumerate(ids):
            arr, r = where[sha_of[ident]]
            mm[row] = arr[r]
        mm.flush()
        del mm


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
    if where is not None and shape is not None:
        _write_features(stage / f"{split}_ims.npy", ids, {i: by_id[i].sha256 for i in ids}, where, shape)
    atomic_write_text(stage / f"{split}_caps.txt", "".join(c + "\n" for c in caps))
    atomic_write_text(stage / f"{split}_cap2img.txt", "".join(f"{r}\n" for r in cap2img))
    atomic_write_text(stage / f"{split}_ids.txt", "".join(f"{i}\n" for i in ids))
    atomic_write_text(stage / f"{split}_images.txt", "".join(f"{paths[i]}\n" for i in ids))
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
