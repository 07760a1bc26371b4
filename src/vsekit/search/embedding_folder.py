"""Reading the clip-retrieval embeddings layout that `vse embed` writes (img_emb_N.npy, text_emb_N.npy,
metadata_N.parquet, embed.json): what `vse index --from-embeddings` builds from. Below both the writer
(`search.embed`) and the index (`search.index`), so neither imports the other.

The folder may come from elsewhere (clip-retrieval's output, a download), so every file in it is untrusted:
each is checked to be a regular file first (`vsekit.data.untrusted.check_regular`: a FIFO never blocks, a
link to `/dev/zero` is refused), `.npy` files are read by `vsekit.utils.io.open_npy` (no pickles, the header's
shape checked against the file's size, memory-mapped), `embed.json` and the parquet metadata are read with a
byte cap, and a parquet file's decoded size is checked from its footer before its rows are decoded."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vsekit.data.untrusted import UntrustedFileError, check_regular, read_bounded
from vsekit.errors import MissingPackageError, VseInputError
from vsekit.utils.io import open_npy
from vsekit.utils.safe_json import JsonBoundsError, loads_bounded

EMBED_FORMAT = "vsekit-embeddings/1"
MANIFEST_DIR = ".manifest"
MAX_EMBED_JSON_BYTES = 1 << 20  # embed.json: a model record and a few counts (plus its skipped list)
MAX_METADATA_FILE_BYTES = 256 << 20  # one metadata_N.parquet: paths, captions and ids of one chunk
MAX_METADATA_DECODED_BYTES = 1 << 30  # what its rows may take once decoded (from the parquet footer)


def pyarrow_modules():
    """(pyarrow, pyarrow.parquet), or one line saying how to install them (an optional extra)."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError as e:
        raise MissingPackageError(
            "embedding folders need pyarrow (parquet metadata): pip install 'vsekit[search]'"
        ) from e
    return pa, pq


# ---------------------------------------------------------------------------------------- reading


@dataclass
class EmbeddingFolder:
    """A clip-retrieval-layout folder opened for reading: per chunk its img_emb / text_emb / metadata files,
    checked to line up (row counts, one dimension) before anything is built from them."""

    dir: Path
    img: list[Path]
    text: list[Path | None]
    meta: list[Path]
    rows: list[int]
    dim: int
    info: dict

    @property
    def n(self) -> int:
        return sum(self.rows)

    def image_chunk(self, i: int) -> np.ndarray:
        """Chunk i's image embeddings [rows, F] float32, NaN/inf refused naming the file."""
        return _checked(self.img[i], self.rows[i], self.dim)

    def text_chunk(self, i: int) -> np.ndarray | None:
        path = self.text[i]
        return None if path is None else _checked(path, self.rows[i], None)

    def metadata(self, i: int) -> dict[str, list]:
        """Chunk i's metadata columns (image_path, caption, id: the ones an index reads)."""
        pf = _parquet(self.meta[i])
        names = [c for c in ("image_path", "caption", "id") if c in pf.schema_arrow.names]
        try:
            return pf.read(columns=names).to_pydict()
        except Exception as e:  # pyarrow raises its own error types for a corrupt file
            raise VseInputError(f"{self.meta[i]}: not a readable parquet file ({e})") from e


def _regular(path: Path, what: str) -> None:
    """`path` must be a regular file (a FIFO, device, folder or link to one is named and refused)."""
    try:
        check_regular(path, expected=what, trust_links=True)
    except UntrustedFileError as e:
        raise VseInputError(str(e)) from None
    except OSError as e:
        raise VseInputError(f"{path}: cannot be read ({e.strerror or e})") from None


def _npy(path: Path) -> np.ndarray:
    """A .npy of the folder: a regular file, read by `open_npy`, holding floating-point numbers."""
    _regular(path, "a .npy file")
    a = open_npy(path)
    if a.dtype.kind != "f":
        raise VseInputError(f"{path}: holds {a.dtype} values, expected floating-point embeddings")
    return a


def _parquet(path: Path):
    """A metadata parquet file read with a byte cap, its decoded size checked from its footer."""
    pa, pq = pyarrow_modules()
    try:
        data = read_bounded(
            path, MAX_METADATA_FILE_BYTES, expected="a parquet file", follow_symlinks=True, trust_links=True
        )
    except UntrustedFileError as e:
        raise VseInputError(str(e)) from None
    except OSError as e:
        raise VseInputError(f"{path}: cannot be read ({e.strerror or e})") from None
    try:
        pf = pq.ParquetFile(pa.BufferReader(data))
        decoded = sum(pf.metadata.row_group(g).total_byte_size for g in range(pf.metadata.num_row_groups))
    except Exception as e:  # pyarrow raises its own error types for a truncated or foreign file
        raise VseInputError(f"{path}: not a readable parquet file ({e})") from e
    if decoded > MAX_METADATA_DECODED_BYTES:
        raise VseInputError(
            f"{path}: its rows take {decoded} bytes decoded, more than the {MAX_METADATA_DECODED_BYTES} byte limit"
        )
    return pf


def _checked(path: Path, rows: int, dim: int | None) -> np.ndarray:
    a = _npy(path)
    if a.ndim != 2 or a.shape[0] != rows or (dim is not None and a.shape[1] != dim):
        raise VseInputError(f"{path}: expected [{rows}, {dim or 'dim'}] vectors, got shape {list(a.shape)}")
    x = np.ascontiguousarray(a, dtype=np.float32)
    bad = ~np.isfinite(x).all(axis=1)
    if bad.any():
        raise VseInputError(
            f"{path}: row {int(np.argmax(bad))} has NaN/inf values ({int(bad.sum())} such rows)"
        )
    return x


def open_embedding_folder(path: str | Path) -> EmbeddingFolder:
    """Open OUT of `vse embed` (or any clip-retrieval-layout folder): pairs img_emb_N.npy with
    metadata_N.parquet (and text_emb_N.npy) by N, and checks their row counts and dimension agree."""
    _, pq = pyarrow_modules()
    root = Path(path)
    if not root.is_dir():
        what = "no such folder" if not root.exists() else "is a file, expected a folder"
        raise VseInputError(f"{root}: {what} (give the --out folder of `vse embed`)")
    info_path = root / "embed.json"
    info: dict = {}
    if info_path.exists() or info_path.is_symlink():
        try:
            text = read_bounded(
                info_path,
                MAX_EMBED_JSON_BYTES,
                expected="a JSON file",
                follow_symlinks=True,
                trust_links=True,
            )
            info = loads_bounded(text, str(info_path))
        except UntrustedFileError as e:
            raise VseInputError(str(e)) from None
        except JsonBoundsError as e:
            raise VseInputError(f"{e} (not the embed.json `vse embed` writes)") from None
        except OSError as e:
            raise VseInputError(f"{info_path}: cannot be read ({e.strerror or e})") from None
        if not isinstance(info, dict):
            raise VseInputError(f"{info_path}: holds a JSON {type(info).__name__}, expected an object")
    elif (root / MANIFEST_DIR / "job.json").is_file():
        raise VseInputError(
            f"{info_path}: missing — `vse embed` has not finished writing {root}; run it again to finish"
        )
    imgs = sorted((root / "img_emb").glob("img_emb_*.npy"))
    if not imgs:
        raise VseInputError(
            f"{root / 'img_emb'}: no img_emb_N.npy files (not an embeddings folder with image embeddings)"
        )
    img, text, meta, rows, dim = [], [], [], [], None
    for p in imgs:
        name = p.stem[len("img_emb_") :]
        m = root / "metadata" / f"metadata_{name}.parquet"
        if not (m.exists() or m.is_symlink()):
            raise VseInputError(f"{m}: missing (img_emb_{name}.npy has no metadata)")
        _regular(m, "a parquet file")
        a = _npy(p)
        if a.ndim != 2:
            raise VseInputError(f"{p}: expected a 2-d [rows, dim] array, got shape {list(a.shape)}")
        if a.shape[0] == 0:  # a chunk whose pictures were all unreadable
            pass
        elif dim is None:
            dim = int(a.shape[1])
        elif a.shape[1] != dim:
            raise VseInputError(f"{p}: {a.shape[1]}-d vectors, but {imgs[0]} holds {dim}-d ones")
        n_meta = _parquet(m).metadata.num_rows
        if n_meta != a.shape[0]:
            raise VseInputError(f"{m}: {n_meta} metadata rows, but {p.name} holds {a.shape[0]} embeddings")
        t = root / "text_emb" / f"text_emb_{name}.npy"
        has_text = t.exists() or t.is_symlink()
        if has_text:
            ta = _npy(t)
            if ta.ndim != 2 or ta.shape[0] != a.shape[0]:
                raise VseInputError(f"{t}: shape {list(ta.shape)}, but {p.name} holds {a.shape[0]} rows")
        img.append(p)
        meta.append(m)
        text.append(t if has_text else None)
        rows.append(int(a.shape[0]))
    if dim is None:
        raise VseInputError(f"{root / 'img_emb'}: every img_emb file is empty (no picture could be embedded)")
    keep = [i for i, r in enumerate(rows) if r > 0]
    return EmbeddingFolder(
        root,
        [img[i] for i in keep],
        [text[i] for i in keep],
        [meta[i] for i in keep],
        [rows[i] for i in keep],
        int(dim),
        info,
    )
