"""What `vse index` / `vse embed` read pictures from: a folder of pictures (`x.txt` beside `x.png` gives its
captions), a dataset split (`DATASET_DIR:SPLIT`, its pictures or only its stored features), or one picture.

Every file named by the folder is read by the rules of `vsekit.data.untrusted` (inside the folder, a regular
file, bounded in bytes); what cannot be used is left out before anything is embedded and listed in
`Source.problems`, naming the file."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from vsekit.data.precomp import DataFormatError, PrecompSplit, load_precomp_split, read_lines
from vsekit.data.untrusted import (
    MAX_CAPTION_FILE_BYTES,
    MAX_PICTURE_BYTES,
    UntrustedFileError,
    check_regular,
    read_bounded,
    read_inside,
    resolve_inside,
)
from vsekit.errors import VseInputError
from vsekit.search.encode import IMAGE_SUFFIXES
from vsekit.utils.printable import printable


@dataclass
class Source:
    """Pictures to index (paths relative to `root`), their ids and captions, and features when a split has them."""

    label: str
    root: Path
    paths: list[str]
    ids: list[str]
    captions: list[tuple[str, int]] = field(default_factory=list)  # (text, picture index in this source)
    split: PrecompSplit | None = None
    # a split without `{split}_images.txt`: only its stored features can be indexed; `paths` are then
    # "SPLIT:ROW" labels (the image's 0-based row, as in `vse eval --save-sims`), which name no file
    features_only: bool = False
    # files found but left out before any embedding, one message each naming the file: pictures whose names
    # are not valid UTF-8, caption files that are not UTF-8 text (the picture is kept, without captions)
    problems: list[str] = field(default_factory=list)

    def first_caption(self) -> list[str | None]:
        out: list[str | None] = [None] * len(self.paths)
        for text, i in self.captions:
            if out[i] is None:
                out[i] = text
        return out


def display_path(path: str | Path) -> str:
    """A path as text that can always be printed and stored (`vsekit.utils.printable`): bytes of a name that
    are not valid UTF-8 (which Python carries as surrogate escapes) and control characters are shown as
    \\xNN, e.g. `pics/caf\\xe9.png`."""
    return printable(str(path))


def is_utf8_name(path: str | Path) -> bool:
    """Whether a path's text is valid UTF-8 (so it can go into JSON lines, parquet and messages as is)."""
    try:
        str(path).encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def path_kind(path: Path) -> str:
    """What is at `path`, for a message: "does not exist", "is a folder", "is a file", "is not a regular file"."""
    if not path.exists():
        return "does not exist"
    if path.is_dir():
        return "is a folder"
    return "is a file" if path.is_file() else "is not a regular file or folder"


def expect_file(path: Path, what: str, error: type[VseInputError] = VseInputError) -> None:
    """Raise `error` naming `path` unless it is a file: "X: is a folder, expected WHAT" (or missing, or a fifo)."""
    if not path.is_file():
        raise error(f"{display_path(path)}: {path_kind(path)}, expected {what}")


def _read_captions_beside(
    root: Path, name: str, i: int, problems: list[str], trust_links: bool = False
) -> list[tuple[str, int]]:
    """The captions of `root / name` (x.txt beside picture i, one per line), or none with a problem recorded.
    Read by the rules of `untrusted.read_inside` (inside `root`, a regular file, at most MAX_CAPTION_FILE_BYTES):
    a caption file that links out of the folder, is a FIFO or a device, is too large, is not UTF-8 text or
    cannot be read is skipped and reported like an unreadable picture. No file at all: no captions."""
    side = root / name
    if not os.path.lexists(side):
        return []
    try:
        text = read_inside(
            root,
            name,
            MAX_CAPTION_FILE_BYTES,
            label="the folder",
            expected="a caption file",
            trust_links=trust_links,
        ).decode()
    except UntrustedFileError as e:
        problems.append(f"{display_path(side)}: {e.detail}; its captions were skipped")
        return []
    except OSError as e:
        problems.append(
            f"{display_path(side)}: cannot be read ({e.strerror or e}); its captions were skipped"
        )
        return []
    except UnicodeDecodeError as e:
        problems.append(f"{display_path(side)}: not UTF-8 text ({e}); its captions were skipped")
        return []
    return [(s, i) for s in (line.strip() for line in text.split("\n")) if s]


def is_dataset_dir(path: Path) -> bool:
    """A precomp dataset directory (it holds `SPLIT_caps.txt` files), not a folder of pictures."""
    return any(path.glob("*_caps.txt"))


def split_source(root: Path, split: str, captions_per_image: int) -> Source:
    """A dataset split: its pictures (`{split}_images.txt`), or without that file its stored features only,
    each image then labelled "SPLIT:ROW"."""
    data = load_precomp_split(root, split, captions_per_image)
    caps = [(c, int(i)) for c, i in zip(data.captions, data.cap2img)]
    if data.image_paths is None:
        data.require_features()  # neither pictures nor features: nothing to index
        rows = [f"{split}:{i}" for i in range(data.n_images)]
        return Source(
            f"{root}:{split}", root.resolve(), rows, list(data.image_ids), caps, data, features_only=True
        )
    for i in range(len(data.image_paths)):  # a line resolving outside the images root refuses the split, as
        data.abs_image_path(i)  # check, train, eval and show refuse it (one rule: precomp.resolve_image_path)
    return Source(
        f"{root}:{split}",
        data.images_root.resolve(),
        list(data.image_paths),
        list(data.image_ids),
        caps,
        data,
    )


def folder_source(root: Path, trust_links: bool = False) -> Source:
    """Every picture under `root` (sorted, hidden files skipped); `x.png` + `x.txt` gives x's caption; a file
    with several names (a hard link) is left out unless `trust_links` (`untrusted.check_links`).

    Decided here, before anything is embedded: a picture whose name is not valid UTF-8 is left out (it could
    not be stored in pictures.jsonl / parquet), and a caption file that is not UTF-8 text is skipped; both
    are listed in `problems`, naming the file, and reported with the unreadable pictures."""
    found = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES
        and not p.is_dir()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    if not found:
        raise DataFormatError(f"{root}: no pictures ({', '.join(IMAGE_SUFFIXES)}) in this folder or below")
    problems = [
        f"{display_path(root / rel)}: its file name is not valid UTF-8; rename it to index it"
        for rel in found
        if not is_utf8_name(rel)
    ]
    paths = []
    for rel in found:
        if not is_utf8_name(rel):
            continue
        try:  # a link out of the folder, a FIFO or a device is never read (`vsekit.data.untrusted`)
            check_regular(
                resolve_inside(root, rel, label="the folder"),
                name=rel,
                expected="a picture file",
                trust_links=trust_links,
            )
        except OSError as e:  # UntrustedFileError too
            why = e.detail if isinstance(e, UntrustedFileError) else f"cannot be read ({e.strerror or e})"
            problems.append(f"{display_path(root / rel)}: {why}; left out")
            continue
        paths.append(rel)
    if not paths:
        raise DataFormatError(
            f"{root}: none of its {len(found)} pictures can be indexed (e.g. "
            f"{problems[0]}); rename them or move them into the folder"
        )
    caps = []
    for i, rel in enumerate(paths):
        caps += _read_captions_beside(
            root, Path(rel).with_suffix(".txt").as_posix(), i, problems, trust_links
        )
    return Source(str(root), root.resolve(), paths, [Path(p).stem for p in paths], caps, problems=problems)


def _require_utf8(path: Path) -> None:
    """SOURCE's own path must be valid UTF-8: it is stored (index.json's roots, parquet's image_path)."""
    full = os.path.abspath(path)
    if not is_utf8_name(full):
        raise DataFormatError(
            f"{display_path(full)}: this path is not valid UTF-8 text, so the pictures' paths "
            "could not be stored; rename it (or the folder above it that is not)"
        )


def resolve_source(spec: str, captions_per_image: int = 5, *, trust_links: bool = False) -> Source:
    """`DATASET_DIR:SPLIT`, a dataset directory (its test split), a folder of pictures, or one picture;
    `trust_links`: a folder's files with several names are read (`folder_source`)."""
    path = Path(spec)
    if path.exists():
        _require_utf8(path)
    if path.is_dir():
        if is_dataset_dir(path):
            if not (path / "test_caps.txt").is_file():
                splits = sorted(p.name[: -len("_caps.txt")] for p in path.glob("*_caps.txt"))
                raise DataFormatError(
                    f"{path}: a dataset directory; name a split as {path}:SPLIT ({', '.join(splits)})"
                )
            return split_source(path, "test", captions_per_image)
        return folder_source(path, trust_links)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise DataFormatError(f"{path}: not a picture ({', '.join(IMAGE_SUFFIXES)}) nor a directory")
        problems: list[str] = []
        caps = _read_captions_beside(path.parent, path.with_suffix(".txt").name, 0, problems)
        return Source(str(path), path.parent.resolve(), [path.name], [path.stem], caps, problems=problems)
    if ":" in spec:
        root, split = spec.rsplit(":", 1)
        if Path(root).is_dir() and split:
            _require_utf8(Path(root))
            return split_source(Path(root), split, captions_per_image)
    raise DataFormatError(
        f"{display_path(spec)}: {path_kind(path)} (give a folder of pictures, a dataset directory, or "
        "DATASET_DIR:SPLIT)"
    )


def hash_pictures(
    root: Path, paths: list[str], progress: bool = False, desc: str = "hash pictures"
) -> tuple[list[str | None], list[str]]:
    """The sha256 of each picture file's bytes (what pictures.jsonl records, so `vse index --refresh` can tell a
    changed picture from an unchanged one), and a problem naming each file that cannot be read (its hash None).

    Hashed before the pictures are embedded: a picture rewritten in between is then recorded with its older
    hash and seen as changed by the next refresh, never stored as unchanged with a stale embedding."""
    from vsekit.utils.progress import progress_bar

    hashes: list[str | None] = []
    problems: list[str] = []
    for rel in progress_bar(paths, desc=desc, unit="img", enabled=progress):
        path = root / rel  # checked inside `root` when the source was read; a FIFO or device is refused here
        try:
            hashes.append(
                hashlib.sha256(
                    read_bounded(path, MAX_PICTURE_BYTES, follow_symlinks=True, expected="a picture file")
                ).hexdigest()
            )
        except OSError as e:
            hashes.append(None)
            problems.append(f"{display_path(path)}: cannot read image ({e.strerror or e})")
    return hashes, problems


def read_extra_captions(captions_file: str | Path | None) -> list[str]:
    """`--captions FILE`: its non-empty lines, stripped (read before any picture is embedded)."""
    if not captions_file:
        return []
    expect_file(Path(captions_file), "a text file of captions (one per line)", DataFormatError)
    return [s.strip() for s in read_lines(Path(captions_file)) if s.strip()]
