"""Reading the clip-retrieval embeddings layout that `vse embed` writes (img_emb_N.npy, text_emb_N.npy,
metadata_N.parquet, embed.json): what `vse index --from-embeddings` builds from. Below both the writer
(`search.embed`) and the index (`search.index`), so neither imports the other."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vsekit.errors import MissingPackageError, VseInputError

EMBED_FORMAT = "vsekit-embeddings/1"
MANIFEST_DIR = ".manifest"


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
        _, pq = pyarrow_modules()
        return pq.read_table(str(self.meta[i])).to_pydict()


def _checked(path: Path, rows: int, dim: int | None) -> np.ndarray:
    a = np.load(path, mmap_mode="r", allow_pickle=False)
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
    if info_path.is_file():
        try:
            info = json.loads(info_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise VseInputError(f"{info_path}: not valid JSON ({e})") from e
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
        if not m.is_file():
            what = "is a folder, expected a parquet file" if m.is_dir() else "missing"
            raise VseInputError(f"{m}: {what} (img_emb_{name}.npy has no metadata)")
        a = np.load(p, mmap_mode="r", allow_pickle=False)
        if a.ndim != 2:
            raise VseInputError(f"{p}: expected a 2-d [rows, dim] array, got shape {list(a.shape)}")
        if a.shape[0] == 0:  # a chunk whose pictures were all unreadable
            pass
        elif dim is None:
            dim = int(a.shape[1])
        elif a.shape[1] != dim:
            raise VseInputError(f"{p}: {a.shape[1]}-d vectors, but {imgs[0]} holds {dim}-d ones")
        try:
            n_meta = pq.ParquetFile(str(m)).metadata.num_rows
        except Exception as e:  # pyarrow raises its own error types for a truncated or foreign file
            raise VseInputError(f"{m}: not a readable parquet file ({e})") from e
        if n_meta != a.shape[0]:
            raise VseInputError(f"{m}: {n_meta} metadata rows, but {p.name} holds {a.shape[0]} embeddings")
        t = root / "text_emb" / f"text_emb_{name}.npy"
        if t.is_file():
            ta = np.load(t, mmap_mode="r", allow_pickle=False)
            if ta.ndim != 2 or ta.shape[0] != a.shape[0]:
                raise VseInputError(f"{t}: shape {list(ta.shape)}, but {p.name} holds {a.shape[0]} rows")
        img.append(p)
        meta.append(m)
        text.append(t if t.is_file() else None)
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
