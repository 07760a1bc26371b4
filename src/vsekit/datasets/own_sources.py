"""Readers of users' own picture-caption pairs, each giving an `own_items.Collected` to the one builder
(`own_pairs`).

- `read_folder(DIR)`: every x.png / x.jpg / ... under DIR (nested folders too, hidden ones skipped) with
  x.txt beside it, one caption per line; the id is the path without extension (`cats/tom`).
  `split_by_folder`: the top-level folder names the split (train/, dev/ or val/, test/; ids keep it).
- `read_table(FILE)`: CSV, TSV or parquet with an image-path column and a caption column (named, or found
  among the usual names); several rows of one picture give it several captions; relative paths are
  resolved against `images_root` (default: the table's folder); `split_col` declares splits.
- webdataset shards are read by `vsekit.datasets.own_shards`.

Readers only look: a missing caption, a blank caption line, a name clash, an unreadable caption file or
shard becomes a `Problem` naming it; the builder checks the pictures themselves. Every file a folder or a
table names is opened by the rules of `vsekit.data.untrusted`: inside its root (the folder; the table's
folder or `--images-root`), a regular file, read with a byte cap; anything else is a `Problem` naming it.
A table is bounded before it is decoded: a CSV record by its bytes across lines and its field count, a
parquet row group by its metadata's decompressed sizes, a parquet row by its cells' bytes (docs/security.md).
"""

from __future__ import annotations

import csv
import logging
import os
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from vsekit.data.text import MAX_CAPTION_CHARS, OVER_LONG
from vsekit.data.untrusted import (
    MAX_CAPTION_FILE_BYTES,
    UntrustedFileError,
    check_regular,
    read_inside,
    resolve_inside,
)
from vsekit.datasets.own_items import (
    BAD_CAPTIONS,
    BAD_NAME,
    EMPTY_CAPTION,
    MISSING_FILE,
    NAME_CLASH,
    NO_CAPTION,
    PICTURE_SUFFIXES,
    UNREADABLE,
    Collected,
    Item,
    PictureRef,
    Problem,
    normalise_caption,
)
from vsekit.datasets.own_splits import resolve_split, split_name
from vsekit.errors import MissingPackageError, VseInputError
from vsekit.utils.printable import printable

log = logging.getLogger(__name__)

IMAGE_COLUMNS = (
    "image",
    "image_path",
    "imagepath",
    "img",
    "img_path",
    "filepath",
    "file_path",
    "path",
    "filename",
    "file_name",
    "file",
    "url",
    "image_url",
)
CAPTION_COLUMNS = (
    "caption",
    "captions",
    "text",
    "title",
    "sentence",
    "description",
    "raw",
    "alt",
    "alt_text",
)
TABLE_FORMATS = {".csv": "csv", ".tsv": "tsv", ".tab": "tsv", ".parquet": "parquet", ".pq": "parquet"}
URL_RE = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")
MAX_TABLE_ROWS = 5_000_000  # rows of one CSV / TSV / parquet table
MAX_TABLE_LINE_BYTES = 1 << 20  # one line of a CSV / TSV table
# One logical record: a quoted field may span lines, so the line bound alone does not bound a row (a record
# of 2 M lines and 20 M fields is 1.6 GB of Python strings). A parquet row's needed cells, as decoded, too.
MAX_TABLE_RECORD_BYTES = 1 << 20
MAX_TABLE_FIELDS = 1024  # fields of one CSV / TSV record: a table has a handful of columns
# parquet: sizes from the file's metadata, checked before anything is decompressed (a 51 KB file can hold a
# column that inflates to gigabytes); then what is decoded is counted, since a dictionary page is stored once
# and expands once per row that names it
MAX_PARQUET_GROUP_BYTES = 256 << 20  # the needed columns of one row group, decompressed
MAX_PARQUET_ROW_GROUPS = 1 << 20  # row groups of one parquet table
MAX_TABLE_TEXT_BYTES = 1 << 30  # the needed cells of a whole parquet table, as decoded
# a caption cell of more bytes cannot be within MAX_CAPTION_CHARS characters (UTF-8: at most 4 bytes each),
# so it is reported as over-long from its size, never turned into a Python string
MAX_CAPTION_CELL_BYTES = 4 * MAX_CAPTION_CHARS
_PARQUET_BATCH_ROWS = 1024  # rows decoded at a time
_PY_CHUNK_BYTES = 16 << 20  # cell bytes turned into Python strings at a time


def _display(text: str) -> str:
    """A name as it can be printed (`vsekit.utils.printable`: control characters and bytes that are not
    UTF-8 shown as \\xNN)."""
    return printable(text)


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
    problems = [
        Problem(f"{name}:{n}", EMPTY_CAPTION, "blank line between captions; skipped")
        for n, line in enumerate(lines, 1)
        if not line
    ]
    return captions, problems


# --------------------------------------------------------------------------------------------- folder


def read_folder(
    root: str | Path,
    split_by_folder: bool = False,
    exclude: Sequence[str | Path] = (),
    *,
    trust_links: bool = False,
) -> Collected:
    """Pictures under `root` with their x.txt captions; `exclude`: folders not to walk (the output);
    `trust_links`: read files with several names (hard links), refused otherwise (`untrusted.check_links`)."""
    root = Path(root)
    if not root.is_dir():
        raise VseInputError(
            f"{root}: {'no such folder' if not root.exists() else 'not a folder'} (give the folder "
            "that holds x.jpg + x.txt pairs)"
        )
    skip = {Path(p).resolve() for p in exclude}
    stems: dict[str, list[str]] = {}
    texts: set[str] = set()
    other = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if not d.startswith(".") and (Path(dirpath) / d).resolve() not in skip
        )
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
        if len(rels) > 1:  # x.jpg + x.png: which one x.txt describes is unknown, so neither is used
            for clash in rels:
                others = ", ".join(_display(r) for r in rels if r != clash)
                problems.append(
                    Problem(
                        _display(clash),
                        NAME_CLASH,
                        f"{others} has the same name, so {_display(stem)}"
                        f".txt cannot tell them apart; {'both' if len(rels) == 2 else f'all {len(rels)}'} are skipped",
                    )
                )
            continue
        rel = rels[0]
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
        try:  # a link out of the folder is refused here; PictureRef.read opens the resolved path, capped
            picture = resolve_inside(root, rel, label="the folder")
        except UntrustedFileError as e:
            problems.append(Problem(rel, UNREADABLE, f"{e.detail}; not read"))
            continue
        if stem not in texts:
            problems.append(Problem(rel, NO_CAPTION, f"no {Path(stem).name}.txt beside it"))
            continue
        try:
            data = read_inside(
                root,
                f"{stem}.txt",
                MAX_CAPTION_FILE_BYTES,
                label="the folder",
                expected="a caption file",
                trust_links=trust_links,
            )
        except UntrustedFileError as e:
            problems.append(
                Problem(f"{stem}.txt", BAD_CAPTIONS, f"{e.detail}; not read, its picture is skipped")
            )
            continue
        except OSError as e:
            problems.append(Problem(f"{stem}.txt", BAD_CAPTIONS, f"cannot be read ({e.strerror or e})"))
            continue
        captions, found = caption_lines(data, f"{stem}.txt")
        problems += found
        if not captions:
            if not any(p.kind == BAD_CAPTIONS for p in found):
                problems.append(Problem(rel, NO_CAPTION, f"{Path(stem).name}.txt holds no caption"))
            continue
        ref = PictureRef(picture, trust_links=trust_links)
        items.append(Item(rel, stem, ref, Path(rel).suffix.lower(), captions, split))
    if outside:
        raise VseInputError(
            f"{root}: --split-by-folder needs every picture under a top-level train/, dev/ (or val/) "
            f"or test/ folder; {len(outside)} are not, e.g. {', '.join(outside[:3])}"
        )
    orphans = len(texts - set(stems))
    if orphans:
        log.info("%s: %d caption file(s) without a picture beside them were ignored", root, orphans)
    notes = {
        "pictures_found": sum(len(v) for v in stems.values()),
        "caption_files_without_picture": orphans,
        "other_files_ignored": other,
    }
    return Collected(
        items,
        problems,
        {"kind": "folder", "input": str(root), "split_by_folder": split_by_folder},
        declared_splits=split_by_folder,
        notes=notes,
    )


# --------------------------------------------------------------------------------------------- table


def table_format(path: Path, fmt: str = "auto") -> str:
    if fmt != "auto":
        return fmt
    found = TABLE_FORMATS.get(path.suffix.lower())
    if found is None:
        raise VseInputError(
            f"{path}: unknown table type {path.suffix!r} ({', '.join(TABLE_FORMATS)}); name it "
            "with --format csv|tsv|parquet"
        )
    return found


def pick_column(
    header: Sequence[str], wanted: str | None, candidates: Sequence[str], flag: str, path: Path
) -> str:
    """`wanted` (exact, else ignoring case), or the first of `candidates` the header has (ignoring case)."""
    lower: dict[str, str] = {}
    for h in header:
        lower.setdefault(str(h).strip().lower(), h)
    if wanted is not None:
        if wanted in header:
            return wanted
        if wanted.strip().lower() in lower:
            return lower[wanted.strip().lower()]
        raise VseInputError(
            f"{path}: no column {wanted!r} ({flag}); its columns: {', '.join(map(str, header))}"
        )
    for c in candidates:
        if c in lower:
            return lower[c]
    raise VseInputError(
        f"{path}: found none of the usual column names ({', '.join(candidates)}) among its "
        f"columns ({', '.join(map(str, header))}); name the column with {flag}"
    )


class _CsvLines:
    """The lines of a CSV / TSV file for `csv.reader`, each decoded on its own (so a bad byte is reported at
    its own line, not at the header), at most MAX_TABLE_LINE_BYTES each, and at most MAX_TABLE_RECORD_BYTES
    for the logical record being read (`record_done` after each record): `csv.reader` asks for a line only
    when the record it reads needs one, so a quoted field left open is stopped at the bound, not read to the
    end of the file."""

    def __init__(self, f, path: Path) -> None:
        self.f, self.path = f, path
        self.n = 0  # physical lines read
        self.start = 1  # the line the current record starts at
        self.record_bytes = 0

    def record_done(self) -> None:
        self.record_bytes = 0

    def __iter__(self) -> _CsvLines:
        return self

    def __next__(self) -> str:
        line = self.f.readline(MAX_TABLE_LINE_BYTES + 1)
        if not line:
            raise StopIteration
        self.n += 1
        n = self.n
        if len(line) > MAX_TABLE_LINE_BYTES:
            limit = MAX_TABLE_LINE_BYTES
            raise VseInputError(
                f"{self.path}:{n}: a line longer than {limit} bytes, more than a table row vsekit reads"
            )
        if not self.record_bytes:
            self.start = n
        self.record_bytes += len(line)
        if self.record_bytes > MAX_TABLE_RECORD_BYTES:
            raise VseInputError(
                f"{self.path}:{self.start}: a record longer than {MAX_TABLE_RECORD_BYTES:,} bytes (lines "
                f"{self.start}-{n} and on: a quoted field left open?), more than a table row vsekit reads"
            )
        try:
            return line.decode("utf-8-sig" if n == 1 else "utf-8")
        except UnicodeDecodeError as e:
            raise VseInputError(f"{self.path}:{n}: not UTF-8 text (byte {e.start + 1} of the line)") from None


def _check_fields(row: list, lines: _CsvLines) -> None:
    if len(row) > MAX_TABLE_FIELDS:
        raise VseInputError(
            f"{lines.path}:{lines.start}: a record of {len(row):,} fields, more than the {MAX_TABLE_FIELDS:,} "
            "vsekit reads (a table has a handful of columns)"
        )


def _csv_rows(path: Path, delimiter: str) -> tuple[list[str], Iterator[tuple[str, list]]]:
    """The header and the non-empty rows (with `file:line` of each) of a CSV / TSV table, at most
    MAX_TABLE_ROWS rows."""
    f = open(path, "rb")  # noqa: SIM115 - closed by the generator
    lines = _CsvLines(f, path)
    reader = csv.reader(lines, delimiter=delimiter)
    try:
        header = next(reader)
        lines.record_done()
        _check_fields(header, lines)
    except StopIteration:
        f.close()
        raise VseInputError(f"{path}: empty table (expected a header row naming the columns)") from None
    except csv.Error as e:
        f.close()
        raise VseInputError(f"{path}:{reader.line_num}: cannot read the header ({e})") from e
    except VseInputError:
        f.close()
        raise

    def rows() -> Iterator[tuple[str, list]]:
        n = 0
        with f:
            while True:
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except csv.Error as e:
                    raise VseInputError(f"{path}:{reader.line_num}: {e}") from e
                lines.record_done()
                _check_fields(row, lines)
                if row:
                    n += 1
                    if n > MAX_TABLE_ROWS:
                        raise VseInputError(f"{path}: more than {MAX_TABLE_ROWS} rows; split the table")
                    yield f"{path.name}:{reader.line_num}", row

    return header, rows()


def _text_type(t, lists: bool) -> bool:
    """Whether a parquet column type holds text (string, large or dictionary-encoded string, or nothing), or
    with `lists` also lists of text."""
    import pyarrow as pa

    if pa.types.is_dictionary(t):
        t = t.value_type
    if lists and (pa.types.is_list(t) or pa.types.is_large_list(t)):
        t = t.value_type
    string_view = getattr(pa.types, "is_string_view", lambda _: False)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or string_view(t) or pa.types.is_null(t)


def _needed_leaves(pf, columns: list[str]) -> dict[str, list[int]]:
    """The parquet leaf columns (indices into the row groups' column chunks) each of `columns` is stored in:
    a text column is one leaf named like it, a list of text one leaf below it (`caption.list.element`)."""
    schema = pf.metadata.schema
    leaves: dict[str, list[int]] = {c: [] for c in columns}
    for j in range(pf.metadata.num_columns):
        leaf = schema.column(j).path
        for (
            c
        ) in columns:  # a column named "a.b" and a struct "a" with a field "b" both count: a bound too strict
            if leaf == c or leaf.startswith(c + "."):
                leaves[c].append(j)
    return leaves


def _checked_row_groups(pf, path: Path, columns: list[str], problems: list[Problem]) -> list[int]:
    """The row groups whose needed columns decompress within MAX_PARQUET_GROUP_BYTES by the file's metadata,
    read before any page is decompressed; each other group is a problem naming the file, the row group, the
    column and its size, and is skipped. A table whose groups together pass MAX_TABLE_TEXT_BYTES is refused."""
    md = pf.metadata
    if md.num_row_groups > MAX_PARQUET_ROW_GROUPS:
        raise VseInputError(
            f"{path}: {md.num_row_groups:,} row groups, more than the {MAX_PARQUET_ROW_GROUPS:,} vsekit reads"
        )
    leaves = _needed_leaves(pf, columns)
    kept, total, first = [], 0, 1
    for g in range(md.num_row_groups):
        group = md.row_group(g)
        sizes = {c: sum(group.column(j).total_uncompressed_size for j in js) for c, js in leaves.items()}
        rows = max(group.num_rows, 0)
        over = [(c, n) for c, n in sizes.items() if n < 0 or n > MAX_PARQUET_GROUP_BYTES]
        if not over and sum(sizes.values()) > MAX_PARQUET_GROUP_BYTES:
            over = [(", ".join(map(repr, columns)), sum(sizes.values()))]
        if over:
            col, size = over[0]
            problems.append(
                Problem(
                    f"{path.name} row group {g} (rows {first}-{first + rows - 1})",
                    UNREADABLE,
                    f"column {col if ',' in str(col) else repr(col)} decompresses to {size:,} bytes, more than "
                    f"the {MAX_PARQUET_GROUP_BYTES:,} vsekit reads of one row group; its {rows:,} row(s) are "
                    "skipped, not decompressed",
                )
            )
        else:
            kept.append(g)
            total += sum(sizes.values())
        first += rows
    if total > MAX_TABLE_TEXT_BYTES:
        raise VseInputError(
            f"{path}: its columns {', '.join(map(repr, columns))} decompress to {total:,} bytes, more than the "
            f"{MAX_TABLE_TEXT_BYTES:,} vsekit reads of a table; split it"
        )
    return kept


def _cell_bytes(arr):
    """The bytes of each cell of an arrow column of text, lists of text or nothing (numpy int64), computed from
    the offsets: no Python string is made, and a dictionary value is counted once per row that names it."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    t = arr.type
    if pa.types.is_null(t) or len(arr) == 0:
        return np.zeros(len(arr), np.int64)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        parents = pc.list_parent_indices(arr).to_numpy(zero_copy_only=False)
        sizes = _cell_bytes(arr.flatten())
        return np.bincount(parents, weights=sizes, minlength=len(arr)).astype(np.int64)
    if pa.types.is_dictionary(t):
        sizes = _cell_bytes(arr.dictionary)
        nulls = arr.is_null().to_numpy(zero_copy_only=False)
        idx = arr.indices.fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
        out = sizes[idx] if len(sizes) else np.zeros(len(arr), np.int64)
        out[nulls] = 0
        return out
    return pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)


def _batch_rows(batch, rows: list[int], columns: list[str], first: int, path: Path, problems: list[Problem]):
    """(row index, Python values) of rows `rows` of `batch` (its first row is row `first + 1` of the table); a
    row holding text that is not UTF-8 (arrow does not check what a parquet file stores) is a problem naming
    it, skipped."""
    import pyarrow as pa

    sub = batch.take(pa.array(rows, pa.int64()))
    try:
        data = sub.to_pydict()
        return [(r, [data[c][k] for c in columns]) for k, r in enumerate(rows)]
    except UnicodeDecodeError:
        pass
    out = []
    for k, r in enumerate(rows):
        try:
            out.append((r, [sub.column(c)[k].as_py() for c in columns]))
        except UnicodeDecodeError as e:
            problems.append(
                Problem(
                    f"{path.name} row {first + r + 1}",
                    BAD_CAPTIONS,
                    f"not UTF-8 text (byte {e.start}); row skipped",
                )
            )
    return out


def _parquet_rows(path: Path, columns: list[str], problems: list[Problem]) -> Iterator[tuple[str, list]]:
    """The rows of a parquet table (`columns`: the picture column, the caption column, maybe the split
    column), at most MAX_TABLE_ROWS. A parquet column has one type for all its rows, so a column that is not
    text (bytes, numbers, a struct; captions may also be lists of text) is refused before any row is read,
    naming the table, the column and its type: its cells would otherwise become Python reprs.
    Bounded before it is decoded: row groups by their metadata (`_checked_row_groups`), then rows read
    `_PARQUET_BATCH_ROWS` at a time as dictionaries (a repeated value is decoded once); a row whose cells
    pass MAX_TABLE_RECORD_BYTES, or whose caption passes MAX_CAPTION_CELL_BYTES, is a problem and is never
    made into Python strings; what is made is counted against MAX_TABLE_TEXT_BYTES."""
    import numpy as np
    import pyarrow.parquet as pq

    pf = pq.ParquetFile(path)
    schema = pf.schema_arrow
    for i, col in enumerate(columns):
        t = schema.field(col).type
        if not _text_type(t, lists=i == 1):
            wanted = ("text (paths)", "text or lists of text (captions)", "text (splits)")[i]
            raise VseInputError(
                f"{path}: column {col!r} holds {t}, not {wanted}; no row of it is read (store it as strings)"
            )
    groups = _checked_row_groups(pf, path, columns, problems)
    leaves = _needed_leaves(pf, columns)
    names = [pf.metadata.schema.column(j).path for c in columns for j in leaves[c]]
    try:  # text read as dictionaries: a value stored once is decoded once, never expanded per row
        pf = pq.ParquetFile(path, read_dictionary=names)
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a broken file: one message
        raise VseInputError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    md = pf.metadata
    firsts = np.cumsum([0] + [max(md.row_group(g).num_rows, 0) for g in range(md.num_row_groups)])
    decoded = 0
    for g in groups:
        n = int(firsts[g])  # rows before this group, read or skipped
        batches = pf.iter_batches(
            batch_size=_PARQUET_BATCH_ROWS, row_groups=[g], columns=columns, use_threads=False
        )
        while True:
            try:
                batch = next(batches, None)
            except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a broken file: one message
                why = f"{type(e).__name__}: {e}"
                raise VseInputError(f"{path}: not a readable parquet file after row {n} ({why})") from e
            if batch is None:
                break
            if n + batch.num_rows > MAX_TABLE_ROWS:
                raise VseInputError(f"{path}: more than {MAX_TABLE_ROWS} rows; split the table")
            sizes = [_cell_bytes(batch.column(c)) for c in columns]
            row_bytes = sum(sizes)
            keep: list[int] = []
            chunk = 0
            for r in range(batch.num_rows + 1):
                if r < batch.num_rows:
                    if row_bytes[r] > MAX_TABLE_RECORD_BYTES:
                        problems.append(
                            Problem(
                                f"{path.name} row {n + r + 1}",
                                UNREADABLE,
                                f"{int(row_bytes[r]):,} bytes of cells, more than the "
                                f"{MAX_TABLE_RECORD_BYTES:,} of a table row vsekit reads; row skipped, not decoded",
                            )
                        )
                        continue
                    if sizes[1][r] > MAX_CAPTION_CELL_BYTES:
                        problems.append(
                            Problem(
                                f"{path.name} row {n + r + 1}",
                                OVER_LONG,
                                f"a {columns[1]!r} cell of {int(sizes[1][r]):,} bytes (the limit is "
                                f"{MAX_CAPTION_CHARS:,} characters); row skipped, not decoded",
                            )
                        )
                        continue
                    keep.append(r)
                    chunk += int(row_bytes[r])
                    if chunk < _PY_CHUNK_BYTES:
                        continue
                if not keep:
                    continue
                decoded += chunk
                if decoded > MAX_TABLE_TEXT_BYTES:
                    raise VseInputError(
                        f"{path}: more than {MAX_TABLE_TEXT_BYTES:,} bytes of text in its columns "
                        f"{', '.join(map(repr, columns))} (by row {n + keep[-1] + 1}); split the table"
                    )
                for k, cells in _batch_rows(batch, keep, columns, n, path, problems):
                    yield f"{path.name} row {n + k + 1}", cells
                keep, chunk = [], 0
            n += batch.num_rows


def _parquet_header(path: Path) -> list[str]:
    """The column names of a parquet table (which must hold at most MAX_TABLE_ROWS rows)."""
    try:
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingPackageError(
            f"{path}: reading parquet needs pyarrow (pip install pyarrow), or save the table as CSV / TSV"
        ) from e
    try:
        pf = pq.ParquetFile(path)
        names, rows = list(pf.schema_arrow.names), pf.metadata.num_rows
    except Exception as e:  # noqa: BLE001 - pyarrow raises its own types for a broken file: one clear message
        raise VseInputError(f"{path}: not a readable parquet file ({type(e).__name__}: {e})") from e
    if rows > MAX_TABLE_ROWS:
        raise VseInputError(f"{path}: {rows} rows, more than the {MAX_TABLE_ROWS} vsekit reads; split it")
    return names


def caption_cell(value) -> list[str] | None:
    """Captions of a table cell or a JSON "caption": text, or a list of texts (empty items skipped); [] for
    no value; None for anything else (bytes, a number, a mapping), which the caller reports."""
    if value is None:
        return []
    if isinstance(value, str):
        return [normalise_caption(value)]
    if isinstance(value, (list, tuple)) and all(v is None or isinstance(v, str) for v in value):
        return [normalise_caption(v) for v in value if v is not None]
    return None


def _cell_captions(value) -> list[str]:
    return caption_cell(value) or []


def read_table(
    path: str | Path,
    image_col: str | None = None,
    caption_col: str | None = None,
    split_col: str | None = None,
    images_root: str | Path | None = None,
    fmt: str = "auto",
    *,
    trust_links: bool = False,
) -> Collected:
    """Rows (picture path, caption[, split]) grouped by picture; relative paths under `images_root`;
    `trust_links`: read files with several names (hard links), refused otherwise (`untrusted.check_links`)."""
    path = Path(path)
    if not path.is_file():
        raise VseInputError(
            f"{path}: {'no such file' if not path.exists() else 'not a file'} (give a CSV, TSV or "
            "parquet table)"
        )
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
    problems: list[Problem] = []
    if kind == "parquet":
        rows = _parquet_rows(path, cols, problems)
    else:
        index = [header.index(c) for c in cols]
        rows = ((where, [row[i] if i < len(row) else "" for i in index]) for where, row in csv_rows)
    groups: dict[str, dict] = {}
    n_rows = 0
    base = os.path.normpath(os.path.abspath(root))
    for where, cells in rows:
        n_rows += 1
        value = "" if cells[0] is None else str(cells[0]).strip()
        if not value:
            problems.append(Problem(where, MISSING_FILE, f"empty {icol!r} cell; row skipped"))
            continue
        if URL_RE.match(value):
            raise VseInputError(
                f"{where}: {value[:80]!r} is a URL; vsekit reads local files only: download the "
                "pictures first (img2dataset writes webdataset shards, which `vse data webdataset` "
                "reads)"
            )
        full = os.path.normpath(
            os.path.join(base, value)
        )  # grouping only: what is read is `resolve_inside`'s
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
    label = "the table's folder" if images_root is None else "--images-root"
    for full, g in groups.items():
        name = g["name"]
        try:  # only inside the images root (no '~', '..' or link out of it), a regular file (not a FIFO, device)
            picture = resolve_inside(root, name, label=label, absolute_ok=True)
            check_regular(picture, name=name, expected="a picture file", trust_links=trust_links)
        except FileNotFoundError:
            problems.append(Problem(name, MISSING_FILE, f"no such file: {full} (named at {g['where']})"))
            continue
        except UntrustedFileError as e:
            problems.append(Problem(name, UNREADABLE, f"{e.detail} (named at {g['where']}); not read"))
            continue
        except OSError as e:
            problems.append(
                Problem(name, UNREADABLE, f"cannot be read ({e.strerror or e}; named at {g['where']})")
            )
            continue
        if not g["captions"]:
            problems.append(Problem(name, NO_CAPTION, f"every row of it has an empty {ccol!r} cell"))
            continue
        split, conflict = resolve_split(g["splits"], name)
        problems += [conflict] if conflict else []
        rel = os.path.relpath(
            full, base
        )  # the name as written; lexically outside only through a link in the root
        suffix = Path(full).suffix
        key = rel[: -len(suffix)] if suffix else rel
        ref = PictureRef(picture, trust_links=trust_links)
        items.append(Item(name, key, ref, suffix.lower(), g["captions"], split))
    source = {
        "kind": "table",
        "input": str(path),
        "format": kind,
        "image_col": icol,
        "caption_col": ccol,
        "split_col": scol,
        "images_root": str(root),
    }
    return Collected(
        items,
        problems,
        source,
        declared_splits=scol is not None,
        notes={"rows": n_rows, "pictures_found": len(groups)},
    )


__all__ = [
    "read_folder",
    "read_table",
    "caption_lines",
    "caption_cell",
    "pick_column",
    "IMAGE_COLUMNS",
    "CAPTION_COLUMNS",
    "MAX_TABLE_ROWS",
    "MAX_TABLE_LINE_BYTES",
    "MAX_TABLE_RECORD_BYTES",
    "MAX_TABLE_FIELDS",
    "MAX_PARQUET_GROUP_BYTES",
    "MAX_PARQUET_ROW_GROUPS",
    "MAX_TABLE_TEXT_BYTES",
    "MAX_CAPTION_CELL_BYTES",
]
