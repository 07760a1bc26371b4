"""`vse data link-images D --images DIR`: map a COCO or Flickr30K precomp folder's rows back to picture files.

SCAN's precomp sets ship features and `{split}_ids.txt` but not the pictures' names (SCAN #13), so a run trained
on them cannot show its hits. The ids are COCO image ids (pictures `COCO_val2014_<12 digits>.jpg`, under
`train2014/` too, or the 2017 naming `<12 digits>.jpg`) or Flickr30K ids (`<id>.jpg`). This finds each id's
picture anywhere under DIR and writes `{split}_images.txt` (paths relative to DIR) with `manifest.json`'s
`images_root` = DIR. Every id must be found, else nothing is written and the first missing ones are named.
A file under DIR that links out of it, or is not a regular file (a FIFO, a device), is never linked: it is
reported and skipped (the rule of `vsekit.data.untrusted`), as `vse data check` and training would refuse it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from vsekit.data.manifest import read_manifest, write_manifest
from vsekit.data.precomp import (
    IDS,
    IMAGES,
    DataFormatError,
    load_precomp_split,
    split_path,
    splits_with,
    write_precomp_split,
)
from vsekit.data.untrusted import UntrustedFileError, check_regular, resolve_inside

log = logging.getLogger(__name__)


def picture_names(image_id: str) -> list[str]:
    """File names a COCO or Flickr30K image id may have, most specific first."""
    names = []
    if image_id.isdigit():
        n = int(image_id)
        names += [f"COCO_val2014_{n:012d}.jpg", f"COCO_train2014_{n:012d}.jpg", f"{n:012d}.jpg"]
    names += [f"{image_id}.jpg", f"{image_id}.jpeg", f"{image_id}.png"]
    return names


def link_images(
    data_dir: str | Path, images_dir: str | Path, splits: list[str] | None = None, captions_per_image: int = 5
) -> dict[str, int]:
    """Write `{split}_images.txt` for each split (default: every split with `{split}_ids.txt`); returns the
    number of pictures linked per split."""
    root, pics = Path(data_dir), Path(images_dir)
    if not pics.is_dir():
        what = "is a file, expected a folder of pictures" if pics.exists() else "no such folder"
        raise DataFormatError(f"{pics}: {what} (--images)")
    if splits is None:
        splits = splits_with(root, IDS)
    if not splits:
        raise DataFormatError(
            f"{root}: no {{split}}_ids.txt files: the image ids are what the pictures are found by"
        )
    by_name: dict[str, list[Path]] = {}
    for dirpath, dirnames, filenames in os.walk(pics):  # links to folders are listed, never walked into
        dirnames.sort()
        for f in sorted(filenames):
            by_name.setdefault(f, []).append(Path(dirpath, f))
    refused: dict[Path, str] = {}

    def usable(path: Path) -> bool:
        """A regular file inside --images (`untrusted`'s rule); a link out of it, a FIFO or a device is
        refused, reported and skipped."""
        rel = path.relative_to(pics).as_posix()
        try:
            check_regular(resolve_inside(pics, rel, label="--images"), name=rel, expected="a picture file")
        except OSError as e:  # UntrustedFileError included
            if path not in refused:
                refused[path] = str(e) if isinstance(e, UntrustedFileError) else f"{rel}: {e.strerror or e}"
                log.warning("%s: %s; skipped", pics, refused[path])
            return False
        return True

    def find(image_id: str) -> Path | None:  # the first usable file in sorted order wins
        return next((p for n in picture_names(image_id) for p in by_name.get(n, ()) if usable(p)), None)

    linked: dict[str, list[str]] = {}
    for split in splits:
        ids_file = split_path(root, split, IDS)
        if not ids_file.is_file():
            raise DataFormatError(f"{ids_file}: missing; it names the split's images")
        data = load_precomp_split(root, split, captions_per_image)
        rows, missing = [], []
        for image_id in data.image_ids:
            found = find(str(image_id).strip())
            if found is None:
                missing.append(str(image_id))
            else:
                rows.append(found.relative_to(pics).as_posix())
        if missing:
            also = f"; {len(refused)} file(s) refused, e.g. {next(iter(refused.values()))}" if refused else ""
            raise DataFormatError(
                f"{pics}: no picture for {len(missing)} of the {len(rows) + len(missing)} ids of "
                f"{ids_file} (first: {', '.join(missing[:3])}; looked for e.g. "
                f"{picture_names(missing[0])[0]}{also}); nothing was written"
            )
        linked[split] = rows
    base = pics.resolve()
    try:
        declared = base.relative_to(root.resolve()).as_posix() or "."
    except ValueError:
        declared = str(base)
    manifest = read_manifest(root)  # a broken one stops here (ManifestError), before anything is written
    others = [split_path(root, s, IMAGES).name for s in splits_with(root, IMAGES) if s not in linked]
    if others and manifest.get("images_root", declared) != declared:
        raise DataFormatError(
            f"{root}: {', '.join(others)} lists pictures under {manifest['images_root']!r}, not "
            f"{declared!r}: link every split in one command (--splits)"
        )
    manifest["images_root"] = declared
    write_manifest(root, manifest)  # first: split files never point into an undeclared root
    for split, rows in linked.items():
        write_precomp_split(root, split, image_paths=rows)
    return {s: len(r) for s, r in linked.items()}
