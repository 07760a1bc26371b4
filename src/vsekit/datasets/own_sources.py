"""Readers of users' own picture-caption pairs, each giving `own_pairs.Collected` to the one builder.

- `read_folder(DIR)`: every x.png / x.jpg / ... under DIR (nested folders too, hidden ones skipped) with
  x.txt beside it, one caption per line; the id is the path without extension (`cats/tom`).
  `split_by_folder`: the top-level folder names the split (train/, dev/ or val/, test/; ids keep it).
- `read_table(FILE)`: CSV, TSV or parquet with an image-path column and a caption column (named, or found
  among the usual names); several rows of one picture give it several captions; relative paths are
  resolved against `images_root` (default: the table's folder); `split_col` declares splits.
- `read_webdataset(PATTERNS)`: tar shards in the img2dataset layout (key.jpg / key.png / key.webp + key.txt
  and / or key.json with a "caption"), `{000..009}` and `{a,b}` brace expansion and globs, read with the
  standard library's tarfile (no webdataset package); pictures are read from the tar by offset when needed.

Readers only look: a missing caption, a blank caption line, a name clash, an unreadable caption file or
shard becomes a `Problem` naming it; the builder checks the pictures themselves.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
import os
import re
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path

from vsekit.datasets.own_pairs import (
    BAD_CAPTIONS,
    BAD_NAME,
    BROKEN_SHARD,
    EMPTY_CAPTION,
    MISSING_FILE,
    NAME_CLASH,
    NO_CAPTION,
    PICTURE_SUFFIXES,
    Collected,
    Item,
    PictureRef,
    Problem,
    normalise_caption,
    resolve_split,
    split_name,
)
from vsekit.errors import MissingPackageError, VseInputError

log = logging.getLogger(__name__)

IMAGE_COLUMNS = ("image", "image_path", "imagepath", "img", "img_path", "filepath", "file_path", "path",
                 "filename", "file_name", "file", "url", "image_url")  # fmt: skip
CAPTION_COLUMNS = ("caption", "captions", "text", "title", "sentence", "description", "raw", "alt", "alt_text")
TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet"}
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def _display(text: str) -> str:
    """A name as it can be printed: bytes that are not UTF-8 (surrogate escapes) shown as U+FFFD."""
    return text.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def caption_lines(data: bytes, name: str) -> tuple[list[str], list[Problem]]:
    """Captions of a caption file (one per line, UTF-8, BOM allowed), and a problem per blank line between
    captions (trailing blank lines are not captions); an undecodable file is one BAD_CAPTIONS problem."""
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        return [], [Problem(name, BAD_CAPTIONS, f"not UTF-8 text (byte {e.start}); its picture is skipped")]
    lines = [normalise_caption(line) for line in text.split("\n")]
    while lines and not lines[-1]:
        lines.pop()
    captions = [line for line in lines if line]
    problems = [Problem(f"{name}:{n}", EMPTY_CAPTION, "blank line between captions; skipped")
                for n, line in enumerate(lines, 1) if not line]  # fmt: skip
    return captions, problems


# --------------------------------------------------------------------------------------------- folder


def read_folder(root: str | Path, split_by_folder: bool = False, exclude: Sequence[str | Path] = ()) -> Collected:
    """Pictures under `root` with their x.txt captions; `exclude`: folders not to walk (the output)."""
    root = Path(root)
    if not root.is_dir():
        raise VseInputError(f"{root}: {'no such folder' if not root.exists() else 'not a folder'} (give the folder "
                            "that holds x.jpg + x.txt pairs)")  # fmt: skip
    skip = {Path(p).resolve() for p in exclude}
    stems: dict[str, list[str]] = {}
    texts: set[str] = set()
    other = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and (Path(dirpath) / d).resolve() not in skip)
        for name in sorted(filenames):
            if name.startswith("."):
                continue
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            suffix = Path(name).suffix
            if suffix.lower() in PICTURE_SUFFIXES:
                stems.setdefault(rel[: -len(suffix)], []).append(rel)
            elif suffix.lower() == ".txt":
                texts.add(rel[: -len(suffix)])
            else:
                other += 1
    if not stems:
        raise VseInputError(f"{root}: no pictures ({', '.join(PICTURE_SUFFIXES)}) in this folder or below")
    items: list[Item] = []
    problems: list[Problem] = []
    outside: list[str] = []
    for stem in sorted(stems):
        rels = sorted(stems[stem])
        rel = rels[0]
        for clash in rels[1:]:
            problems.append(Problem(_display(clash), NAME_CLASH, f"{_display(rel)} has the same name, so {stem}.txt "
                                    "cannot tell them apart; this one is skipped"))  # fmt: skip
        try:
            rel.encode("utf-8")
        except UnicodeEncodeError:
            problems.append(Problem(_display(rel), BAD_NAME, "the file name is not valid UTF-8; rename it"))
            continue
        split = None
        if split_by_folder:
            top = rel.split("/", 1)[0] if "/" in rel else ""
            try:
                split = split_name(top, rel)
            except VseInputError:
                outside.append(rel)
                continue
        txt = root / f"{stem}.txt"
        if stem not in texts:
            problems.append(Problem(rel, NO_CAPTION, f"no {Path(stem).name}.txt beside it"))
            continue
        try:
            captions, found = caption_lines(txt.read_bytes(), f"{stem}.txt")
        except OSError as e:
            problems.append(Problem(f"{stem}.txt", BAD_CAPTIONS, f"cannot be read ({e.strerror or e})"))
            continue
        problems += found
        if not captions:
            if not any(p.kind == BAD_CAPTIONS for p in found):
                problems.append(Problem(rel, NO_CAPTION, f"{Path(stem).name}.txt holds no caption"))
            continue
        items.append(Item(rel, stem, PictureRef(root / rel), Path(rel).suffix.lower(), captions, split))
    if outside:
        raise VseInputError(f"{root}: --split-by-folder needs every picture under a top-level train/, dev/ (or val/) "
                            f"or test/ folder; {len(outside)} are not, e.g. {', '.join(outside[:3])}")  # fmt: skip
    orphans = len(texts - set(stems))
    if orphans:
        log.info("%s: %d caption file(s) without a picture beside them were ignored", root, orphans)
    notes = {"pictures_found": sum(len(v) for v in stems.values()), "caption_files_without_picture": orphans,
             "other_files_ignored": other}  # fmt: skip
    return Collected(items, problems, {"kind": "folder", "input": str(root), "split_by_folder": split_by_folder},
                     declared_splits=split_by_folder, notes=notes)  # fmt: skip


# --------------------------------------------------------------------------------------------- table


def table_format(path: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    found = TABLE_FORMATS.get(path.suffix.lower())
    if found is None:
        raise VseInputError(f"{path}: unknown table type {path.suffix!r} ({', '.join(TABLE_FORMATS)}); name it "
                            "with --format csv|tsv|parquet")  # fmt: skip
    return found


def pick_column(header: Sequence[str], wanted: str | None, candidates: Sequence[str], flag: str, path: Path) -> str:
    """`wanted` (exact, else ignoring case), or the first of `candidates` the header has (ignoring case)."""
    lower: dict[str, str] = {}
    for h in header:
        lower.setdefault(str(h).strip().lower(), h)
    if wanted is not None:
        if wanted in header:
            return wanted
        if wanted.strip().lower() in lower:
            return lower[wanted.strip().lower()]
        raise VseInputError(f"{path}: no column {wanted!r} ({flag}); its columns: {', '.join(map(str, header))}")
    for c in candidates:
        if c in lower:
            return lower[c]
    raise VseInputError(f"{path}: found none of the usual column names ({', '.join(candidates)}) among its "
                        f"columns ({', '.join(map(str, header))}); name the column with {flag}")  # fmt: skip


def _csv_rows(path: Path, delimiter: str) -> tuple[list[str], Iterator[tuple[str, list]]]:
    f = open(path, encoding="utf-8-sig", newline="")  # noqa: SIM115 - closed by the generator
    reader = csv.reader(f, delimiter=delimiter)
    try:
        header = next(reader)
    except StopIteration:
        f.close()
        raise VseInputError(f"{path}: empty table (expected a header row naming the columns)") from None
    except (UnicodeDecodeError, csv.Error) as e:
        f.close()
        raise VseInputError(f"{path}:1: cannot read the header ({e})") from e

    def rows() -> Iterator[tuple[str, list]]:
        with f:
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except UnicodeDecodeError as e:
                    raise VseInputError(f"{path}: not UTF-8 text after line {reader.line_num} ({e})") from e
                except csv.Error as e:
                    raise VseInputError(f"{path}:{reader.line_num}: {e}") from e
                if row:
                    yield f"{path.name}:{reader.line_num}", row

    return header, rows()


def _parquet_rows(path: Path, columns: list[str]) -> Iterator[tuple[str, list]]:
    import pyarrow.parquet as pq

    n = 0
    for batch in pq.ParquetFile(path).iter_batches(columns=columns):
        data = batch.to_pydict()
        for i in range(batch.num_rows):
            n += 1
            yield f"{path.name} row {n}", [data[c][i] for c in columns]


def _parquet_header(path: Path) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingPackageError(f"{path}: reading parquet needs pyarrow (pip install pyarrow), or save the table "
                                  "as CSV / TSV") from e  # fmt: skip
    try:
        return list(pq.ParquetFile(path).schema_arrow.names)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a broken file: one clear message
        raise VseInputError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e


def _cell_captions(value) -> list[str]:
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [normalise_caption(v) for v in value if v is not None]
    return [normalise_caption(value)]


def read_table(path: str | Path, image_col: str | None = None, caption_col: str | None = None,
               split_col: str | None = None, images_root: str | Path | None = None,
               fmt: str = "auto") -> Collected:  # fmt: skip
    """Rows (picture path, caption[, split]) grouped by picture; relative paths under `images_root`."""
    path = Path(path)
    if not path.is_file():
        raise VseInputError(f"{path}: {'no such file' if not path.exists() else 'not a file'} (give a CSV, TSV or "
                            "parquet table)")  # fmt: skip
    kind = table_format(path, fmt)
    root = Path(images_root) if images_root is not None else path.parent
    if images_root is not None and not root.is_dir():
        raise VseInputError(f"{root}: no such folder (--images-root)")
    if kind == "parquet":
        header = _parquet_header(path)
    else:
        header, csv_rows = _csv_rows(path, "\t" if kind == "tsv" else ",")
    icol = pick_column(header, image_col, IMAGE_COLUMNS, "--image-col", path)
    ccol = pick_column(header, caption_col, CAPTION_COLUMNS, "--caption-col", path)
    scol = pick_column(header, split_col, (), "--split-col", path) if split_col is not None else None
    cols = [icol, ccol] + ([scol] if scol else [])
    if kind == "parquet":
        rows = _parquet_rows(path, cols)
    else:
        index = [header.index(c) for c in cols]
        rows = ((where, [row[i] if i < len(row) else "" for i in index]) for where, row in csv_rows)
    groups: dict[str, dict] = {}
    problems: list[Problem] = []
    n_rows = 0
    base = os.path.normpath(os.path.abspath(root))
    for where, cells in rows:
        n_rows += 1
        value = "" if cells[0] is None else str(cells[0]).strip()
        if not value:
            problems.append(Problem(where, MISSING_FILE, f"empty {icol!r} cell; row skipped"))
            continue
        if URL_RE.match(value):
            raise VseInputError(f"{where}: {value[:80]!r} is a URL; vsekit reads local files only: download the "
                                "pictures first (img2dataset writes webdataset shards, which `vse data webdataset` "
                                "reads)")  # fmt: skip
        full = os.path.normpath(os.path.join(base, os.path.expanduser(value)))
        g = groups.get(full)
        if g is None:
            g = groups[full] = {"name": value, "where": where, "captions": [], "splits": []}
        caps = [c for c in _cell_captions(cells[1]) if c]
        if not caps:
            problems.append(Problem(f"{where} ({value})", EMPTY_CAPTION, f"empty {ccol!r} cell; row skipped"))
        g["captions"] += caps
        if scol is not None:
            cell = "" if cells[2] is None else str(cells[2]).strip()
            if not cell:
                raise VseInputError(f"{where}: empty {scol!r} cell (--split-col): every row needs its split")
            g["splits"].append((where, split_name(cell, f"{where} ({scol!r})")))
    if not n_rows:
        raise VseInputError(f"{path}: no rows under the header")
    items: list[Item] = []
    for full, g in groups.items():
        name = g["name"]
        if not os.path.isfile(full):
            problems.append(Problem(name, MISSING_FILE, f"no such file: {full} (named at {g['where']})"))
            continue
        if not g["captions"]:
            problems.append(Problem(name, NO_CAPTION, f"every row of it has an empty {ccol!r} cell"))
            continue
        split, conflict = resolve_split(g["splits"], name)
        problems += [conflict] if conflict else []
        rel = os.path.relpath(full, base)  # outside the root: '../x/a.png', whose id (`safe_id`) is 'x/a'
        suffix = Path(full).suffix
        key = rel[: -len(suffix)] if suffix else rel
        items.append(Item(name, key, PictureRef(Path(full)), suffix.lower(), g["captions"], split))
    source = {"kind": "table", "input": str(path), "format": kind, "image_col": icol, "caption_col": ccol,
              "split_col": scol, "images_root": str(root)}  # fmt: skip
    return Collected(items, problems, source, declared_splits=scol is not None,
                     notes={"rows": n_rows, "pictures_found": len(groups)})  # fmt: skip


# --------------------------------------------------------------------------------------------- webdataset


def expand_braces(pattern: str) -> list[str]:
    """Shell-style brace expansion as webdataset's: `{000..009}` (zero padding kept), `{a,b}`, several
    groups (the first varies slowest); braces holding neither stay as they are."""
    m = re.search(r"\{([^{}]*)\}", pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m.group(1), pattern[m.end() :]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        a, b = rng.groups()
        padded = (len(a) > 1 and a.startswith("0")) or (len(b) > 1 and b.startswith("0"))
        width = max(len(a), len(b)) if padded else 0
        lo, hi = int(a), int(b)
        step = 1 if hi >= lo else -1
        options = [str(i).zfill(width) for i in range(lo, hi + step, step)]
    elif "," in body:
        options = body.split(",")
    else:
        return [head + "{" + body + "}" + rest for rest in expand_braces(tail)]
    rests = expand_braces(tail)
    return [head + o + rest for o in options for rest in rests]


def expand_shards(patterns: Sequence[str]) -> list[Path]:
    """Every shard named by the patterns (brace expansion, then globs), in order, each once; a name that
    does not exist is an error naming it."""
    shards: list[Path] = []
    for pattern in patterns:
        for name in expand_braces(pattern):
            if any(ch in name for ch in "*?["):
                found = sorted(glob.glob(name))
                if not found:
                    raise VseInputError(f"{name}: no shard matches (from {pattern!r})")
                shards += [Path(f) for f in found]
            elif not os.path.isfile(name):
                raise VseInputError(f"{name}: no such shard (from {pattern!r})")
            else:
                shards.append(Path(name))
    seen: dict[str, Path] = {}
    for s in shards:
        seen.setdefault(os.path.abspath(s), s)
    if not seen:
        raise VseInputError("no shards given")
    return list(seen.values())


_KEY_RE = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")


def split_key(member: str) -> tuple[str, str] | None:
    """(key, extension) of a tar member as webdataset splits it: the key runs to the first dot of the file
    name (`a/000012.jpg` -> `a/000012`, `jpg`); None for a name without one."""
    m = _KEY_RE.match(member)
    return (m.group(1), m.group(2).lower()) if m else None


def _shard_members(shard: Path, problems: list[Problem]) -> tuple[dict[str, dict[str, tarfile.TarInfo]], tarfile.TarFile | None]:
    samples: dict[str, dict[str, tarfile.TarInfo]] = {}
    try:
        tf = tarfile.open(shard, mode="r:")
    except (tarfile.TarError, OSError, EOFError) as e:
        with open(shard, "rb") as f:
            head = f.read(4)
        why = ("a compressed tar: unpack it to a plain .tar (img2dataset writes plain .tar shards)"
               if head[:2] == b"\x1f\x8b" or head[:3] == b"BZh" or head[:4] == b"\xfd7zX" else
               f"not a readable uncompressed tar ({e})")  # fmt: skip
        problems.append(Problem(str(shard), BROKEN_SHARD, f"{why}; skipped"))
        return samples, None
    n = 0
    try:
        for m in tf:
            n += 1
            if not m.isfile():
                continue
            parts = split_key(m.name)
            if parts is None:
                continue
            key, ext = parts
            members = samples.setdefault(key, {})
            if ext in members:
                problems.append(Problem(f"{shard}:{m.name}", NAME_CLASH, "a second member with the same key and "
                                        "extension; skipped"))  # fmt: skip
                continue
            members[ext] = m
    except (tarfile.TarError, OSError, EOFError) as e:
        problems.append(Problem(str(shard), BROKEN_SHARD, f"unreadable after {n} member(s) ({e}); the samples read "
                                "before it are used"))  # fmt: skip
    return samples, tf


def read_webdataset(patterns: Sequence[str]) -> Collected:
    """Samples of img2dataset-style shards: a picture member plus captions from key.txt and/or key.json."""
    shards = expand_shards(patterns)
    items: list[Item] = []
    problems: list[Problem] = []
    n_samples = n_pictures = orphans = 0
    picture_exts = [s.lstrip(".") for s in PICTURE_SUFFIXES]
    for shard in shards:
        samples, tf = _shard_members(shard, problems)
        if tf is None:
            continue
        with tf:
            for key, members in samples.items():
                n_samples += 1
                pics = [e for e in members if e in picture_exts]
                if not pics:
                    orphans += 1
                    continue
                n_pictures += 1
                pic = members[pics[0]]
                name = f"{shard}:{pic.name}"
                for other in pics[1:]:
                    problems.append(Problem(f"{shard}:{members[other].name}", NAME_CLASH, f"{pic.name} has the same "
                                            "key; this one is skipped"))  # fmt: skip
                captions: list[str] = []
                bad = False
                if "txt" in members:
                    caps, found = caption_lines(_member_bytes(tf, members["txt"]), f"{shard}:{members['txt'].name}")
                    captions += caps
                    problems += found
                    bad |= any(p.kind == BAD_CAPTIONS for p in found)
                if "json" in members:
                    caps, problem = _json_captions(_member_bytes(tf, members["json"]), f"{shard}:{members['json'].name}")
                    captions += caps
                    problems += [problem] if problem else []
                    bad |= problem is not None
                if not captions:
                    if not bad:
                        where = " / ".join(f"{key.rsplit('/', 1)[-1]}.{e}" for e in ("txt", "json") if e in members)
                        problems.append(Problem(name, NO_CAPTION, f"{where} holds no caption" if where else
                                                "no .txt or .json caption for this key"))  # fmt: skip
                    continue
                items.append(Item(name, key, PictureRef(shard, pic.offset_data, pic.size), f".{pics[0]}", captions))
    if orphans:
        log.info("%d sample(s) without a picture were ignored", orphans)
    source = {"kind": "webdataset", "input": " ".join(patterns), "shards": [str(s) for s in shards]}
    return Collected(items, problems, source,
                     notes={"shards": len(shards), "samples": n_samples, "pictures_found": n_pictures})  # fmt: skip


def _member_bytes(tf: tarfile.TarFile, member: tarfile.TarInfo) -> bytes:
    try:
        f = tf.extractfile(member)
        return f.read() if f is not None else b""
    except (tarfile.TarError, OSError, EOFError):
        return b""


def _json_captions(data: bytes, name: str) -> tuple[list[str], Problem | None]:
    """The "caption" of an img2dataset .json (a string or a list of strings)."""
    try:
        meta = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return [], Problem(name, BAD_CAPTIONS, f"not valid JSON ({e})")
    value = meta.get("caption") if isinstance(meta, dict) else None
    caps = _cell_captions(value) if isinstance(value, (str, list)) else []
    return [c for c in caps if c], None


__all__ = ["read_folder", "read_table", "read_webdataset", "expand_braces", "expand_shards", "split_key",
           "caption_lines", "pick_column", "IMAGE_COLUMNS", "CAPTION_COLUMNS"]  # fmt: skip
