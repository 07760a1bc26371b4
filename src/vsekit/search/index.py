"""A search index: picture embeddings of one trained model, their metadata, and FAISS indexes over them.

INDEX_DIR/
  index.json                 written last and atomically: model fingerprint, FAISS settings, roots, segments
  segments/NNNN/             one per `vse index` call (incremental adds append a segment, never rewrite one;
                             `--refresh` writes the refreshed folder's pictures as one new segment: search/refresh.py)
    pictures.jsonl           {"root": i, "path": relative path, "caption": str|null, "id": str, "sha256": hex of the
                             file's bytes (pictures embedded from files; what --refresh compares)} per picture
    image_emb.npy            float32 [n, F]: the model's full image embeddings (re-ranking, rebuilding)
    captions.jsonl           {"text": str, "image": global picture id|null} per caption (image -> text search)
    caption_emb.npy          float32 [m, D]
  images.gN.faiss            inner-product index over the pictures' proxy vectors (generation N)
  captions.gN.faiss          the same over the captions
  .work/JOB/chunk_*.npz      finished encoding chunks of an interrupted run; reused on restart, then removed
  .lock                      held (flock) by the one `vse index` writing here; records its pid, removed when it exits

A reader that opens index.json sees a consistent set of files: new files get new names, index.json is
replaced in one rename, and the old files are deleted only after that. Picture paths are stored relative
to a recorded root, and are only ever resolved inside it (the server depends on that).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vsekit.data.precomp import DataFormatError, PrecompSplit, load_precomp_split, read_lines
from vsekit.errors import MissingPackageError, VseInputError
from vsekit.search.encode import (
    IMAGE_SUFFIXES,
    ImageEmbedder,
    TextEmbedder,
    embed_features,
    needs_rerank,
    proxy_vectors,
    read_manifest_extractor,
    run_extractor_spec,
    same_extractor,
)
from vsekit.utils.io import (
    atomic_path,
    atomic_save_npy,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
)

INDEX_FORMAT = "vsekit-index/1"
INDEX_KINDS = ("flat", "ivf", "hnsw", "ivfpq")
IVF_KINDS = ("ivf", "ivfpq")
LOCK_NAME = ".lock"
# An IVF index's lists were fitted to the vectors present when it was built. Once it holds more than
# RETRAIN_GROWTH times that many, an incremental add re-trains the lists on a fresh sample of all stored
# embeddings and rebuilds the index (nlist re-chosen when automatic) instead of appending to stale lists.
RETRAIN_GROWTH = 2.0

logger = logging.getLogger(__name__)


class IndexFormatError(VseInputError):
    """An index directory that cannot be read or extended safely; the message names the file."""


# ---------------------------------------------------------------------------------------------- FAISS


@dataclass
class FaissParams:
    """Which FAISS index and its knobs. `flat` is exact; `ivf` and `hnsw` trade recall for speed
    (docs/search.md has the measured trade-off)."""

    kind: str = "flat"
    nlist: int = 0  # ivf: number of lists; 0 = about 4*sqrt(n) (autofaiss' rule), at least 39 vectors per list
    nprobe: int = 16  # ivf: lists visited per query (search time; more = higher recall, slower)
    hnsw_m: int = 32  # hnsw: graph degree (memory: 8*M bytes per vector on top of the vector)
    ef_construction: int = 80  # hnsw: build-time beam
    ef_search: int = 64  # hnsw: query-time beam (search time; more = higher recall, slower)
    pq_m: int = 0  # ivfpq: sub-quantizers (bytes per code); 0 = auto_pq(d): about d/8, dividing d
    trained_on: int = 0  # ivf/ivfpq: vectors in the index when its lists were last trained (the retrain rule)
    refine: int = 10  # ivfpq: re-score the top refine*k of the PQ codes exactly with the stored embeddings (0 = off)

    def validate(self) -> None:
        if self.kind not in INDEX_KINDS:
            raise VseInputError(f"index kind {self.kind!r}; choose one of {', '.join(INDEX_KINDS)}")
        for name in ("nprobe", "ef_construction", "ef_search"):
            if getattr(self, name) < 1:
                raise VseInputError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.hnsw_m < 2:  # FAISS crashes (segfault) building an HNSW graph of degree 1
            raise VseInputError(f"hnsw_m must be >= 2, got {self.hnsw_m}")
        if self.nlist < 0:
            raise VseInputError(f"nlist must be >= 0 (0 = automatic), got {self.nlist}")
        if self.pq_m < 0:
            raise VseInputError(f"pq_m must be >= 0 (0 = automatic), got {self.pq_m}")
        if self.refine < 0:
            raise VseInputError(f"refine must be >= 0 (0 = PQ scores as they are), got {self.refine}")
        for name in ("nlist", "nprobe", "hnsw_m", "ef_construction", "ef_search", "pq_m", "refine"):
            if getattr(self, name) > 2**31 - 1:  # FAISS takes them as C ints
                raise VseInputError(f"{name} must be <= {2**31 - 1}, got {getattr(self, name)}")


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise MissingPackageError("search needs FAISS: pip install 'vsekit[search]' (faiss-cpu)") from e
    return faiss


def auto_nlist(n: int) -> int:
    """A power of two near 4*sqrt(n), with at least 39 training vectors per list."""
    target = 2 ** int(round(np.log2(max(1.0, 4 * np.sqrt(n)))))
    return int(max(1, min(target, n // 39)))


def auto_pq(d: int, n: int) -> tuple[int, int]:
    """(m, nbits) of an IVF-PQ code, autofaiss-style: m = the largest divisor of d that is <= d/8 (about 8
    dimensions per sub-quantizer; 512-d -> 64 bytes per vector, 1/32 of float32) and 8-bit codes; fewer bits
    (>= 4) when there are too few vectors to train 2**nbits centroids per sub-quantizer (39 each)."""
    m = max(v for v in range(1, max(1, d // 8) + 1) if d % v == 0)
    nbits = 8
    while nbits > 4 and n < 39 * 2**nbits:
        nbits -= 1
    return m, nbits


def ivfpq_train_size(n: int, nlist: int) -> int:
    """Vectors k-means sees for IVF-PQ: max(65,536, 40*nlist), at most n and at most 256*nlist (FAISS warns
    below 39 per list; more only costs time). 1M vectors, 4,096 lists -> 163,840."""
    return int(min(n, min(256 * nlist, max(65_536, 40 * nlist))))


def check_trainable(params: FaissParams, n: int, d: int | None = None) -> None:
    """Raise VseInputError (naming the option) when an index of `params` cannot be trained on `n` vectors of
    dimension `d` (when known): IVF needs at least nlist vectors, IVF-PQ at least 16 and --pq-m dividing d.
    `vse index` calls it before embedding anything, so a hopeless --nlist costs nothing."""
    if params.kind not in IVF_KINDS:
        return
    nlist = params.nlist or auto_nlist(n)
    if n < nlist:
        raise VseInputError(f"--nlist {nlist}: an IVF index with {nlist} lists needs at least {nlist} vectors to "
                            f"train, got {n}; use a smaller --nlist (0 = automatic) or --index flat")  # fmt: skip
    if params.kind == "ivfpq":
        if d is not None and params.pq_m and d % params.pq_m:
            raise VseInputError(f"--pq-m {params.pq_m} must divide the vector dimension {d}")
        _, nbits = auto_pq(d or 8, n)
        if n < 2**nbits:
            raise VseInputError(f"--index ivfpq: an IVF-PQ index needs at least {2**nbits} vectors to train its "
                                f"codes, got {n}; use --index flat or ivf")  # fmt: skip


def build_faiss(vectors: np.ndarray, params: FaissParams, seed: int = 0):
    """A FAISS inner-product index over `vectors` [N, D] (trained first when the kind needs it)."""
    faiss = _faiss()
    params.validate()
    x = np.ascontiguousarray(vectors, dtype=np.float32)
    n, d = x.shape
    if params.kind == "flat":
        index = faiss.IndexFlatIP(d)
    elif params.kind == "hnsw":
        index = faiss.IndexHNSWFlat(d, params.hnsw_m, faiss.METRIC_INNER_PRODUCT)
        index.hnsw.efConstruction = params.ef_construction
    else:
        nlist = params.nlist or auto_nlist(n)
        check_trainable(params, n, d)
        if params.kind == "ivfpq":
            m, nbits = auto_pq(d, n)
            if params.pq_m:
                m = params.pq_m
            index = faiss.IndexIVFPQ(faiss.IndexFlatIP(d), d, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT)
            max_train = max(ivfpq_train_size(n, nlist), min(n, 39 * 2**nbits))
            logger.info("IVF-PQ: %d lists, %d x %d-bit codes, trained on %d of %d vectors", nlist, m, nbits,
                        min(n, max_train), n)  # fmt: skip
        else:
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
            max_train = 256 * nlist
        index.cp.seed = seed
        train = x if n <= max_train else x[np.sort(np.random.default_rng(seed).choice(n, max_train, replace=False))]
        index.train(train)
        params.trained_on = n
    if n:
        index.add(x)
    tune_faiss(index, params)
    return index


def tune_faiss(index, params: FaissParams) -> None:
    """Apply the search-time knobs (nprobe / efSearch) to a loaded index."""
    if hasattr(index, "nprobe"):
        index.nprobe = min(params.nprobe, index.nlist)
    if hasattr(index, "hnsw"):
        index.hnsw.efSearch = params.ef_search


class RefinedIndex:
    """An IVF-PQ index whose shortlist is re-scored exactly: the top `factor`*k by PQ code are scored with the
    stored float32 vectors (`vectors(ids)`, memory-mapped from the segments) and the best k returned, with their
    exact inner products. PQ codes alone rank a query's near neighbours coarsely (recall@10 0.42 at 64 bytes on
    1M x 512-d; 0.96 with this step, docs/benchmarks.md); the stored embeddings are there anyway.

    It stands in for the FAISS index where a search, `add`, `ntotal` or `nprobe` is used; `write_faiss`
    writes the FAISS index underneath."""

    def __init__(self, base, vectors: Callable[[np.ndarray], np.ndarray], factor: int) -> None:
        self.base, self.vectors, self.factor = base, vectors, factor

    ntotal = property(lambda self: self.base.ntotal)
    d = property(lambda self: self.base.d)
    nlist = property(lambda self: self.base.nlist)

    @property
    def nprobe(self) -> int:
        return self.base.nprobe

    @nprobe.setter
    def nprobe(self, value: int) -> None:
        self.base.nprobe = value

    def add(self, x: np.ndarray) -> None:
        self.base.add(x)

    def search(self, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        q = np.ascontiguousarray(q, dtype=np.float32)
        _, cand = self.base.search(q, k * self.factor)
        scores = np.full((len(q), k), -np.finfo(np.float32).max, dtype=np.float32)
        ids = np.full((len(q), k), -1, dtype=np.int64)
        for i in range(len(q)):
            c = cand[i][cand[i] >= 0]
            if len(c):
                s = self.vectors(c) @ q[i]
                top = np.argsort(-s, kind="stable")[:k]
                scores[i, : len(top)], ids[i, : len(top)] = s[top], c[top]
        return scores, ids


def write_faiss(index, path: Path) -> None:
    """Temp file + fsync + rename (FAISS writes large indexes straight to disk, not through memory)."""
    faiss = _faiss()
    if isinstance(index, RefinedIndex):
        index = index.base
    with atomic_path(path) as tmp:
        faiss.write_index(index, str(tmp))


def read_faiss(path: Path):
    faiss = _faiss()
    if not path.is_file():
        raise IndexFormatError(f"{path}: {_missing(path)} (the index directory is incomplete)")
    try:
        return faiss.read_index(str(path))
    except RuntimeError as e:
        raise IndexFormatError(f"{path}: not a readable FAISS index ({str(e).splitlines()[0]})") from e


# -------------------------------------------------------------------------------------------- sources


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
    """A path as text that can always be printed and stored: bytes of a name that are not valid UTF-8 (which
    Python carries as surrogate escapes) are shown as \\xNN, e.g. `pics/caf\\xe9.png`."""
    return os.fsencode(str(path)).decode("utf-8", "backslashreplace")


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


def _read_captions_beside(side: Path, i: int, problems: list[str]) -> list[tuple[str, int]]:
    """The captions of `side` (x.txt beside picture i), or none with a problem recorded: a caption file that
    is not UTF-8 text (or cannot be read) is skipped and reported like an unreadable picture."""
    try:
        return [(s, i) for s in (line.strip() for line in read_lines(side)) if s]
    except (DataFormatError, OSError) as e:
        why = str(e) if isinstance(e, DataFormatError) else f"{display_path(side)}: cannot be read ({e.strerror or e})"
        problems.append(f"{why}; its captions were skipped")
        return []


def _is_dataset_dir(path: Path) -> bool:
    return any(path.glob("*_caps.txt"))


def split_source(root: Path, split: str, captions_per_image: int) -> Source:
    """A dataset split: its pictures (`{split}_images.txt`), or without that file its stored features only,
    each image then labelled "SPLIT:ROW"."""
    data = load_precomp_split(root, split, captions_per_image)
    caps = [(c, int(i)) for c, i in zip(data.captions, data.cap2img)]
    if data.image_paths is None:
        data.require_features()  # neither pictures nor features: nothing to index
        rows = [f"{split}:{i}" for i in range(data.n_images)]
        return Source(f"{root}:{split}", root.resolve(), rows, list(data.image_ids), caps, data, features_only=True)
    return Source(f"{root}:{split}", data.images_root.resolve(), list(data.image_paths), list(data.image_ids), caps, data)


def folder_source(root: Path) -> Source:
    """Every picture under `root` (sorted, hidden files skipped); `x.png` + `x.txt` gives x's caption.

    Decided here, before anything is embedded: a picture whose name is not valid UTF-8 is left out (it could
    not be stored in pictures.jsonl / parquet), and a caption file that is not UTF-8 text is skipped; both
    are listed in `problems`, naming the file, and reported with the unreadable pictures."""
    found = sorted(
        p.relative_to(root).as_posix()
        for p in root.rglob("*")
        if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()
        and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )  # fmt: skip
    if not found:
        raise DataFormatError(f"{root}: no pictures ({', '.join(IMAGE_SUFFIXES)}) in this folder or below")
    problems = [f"{display_path(root / rel)}: its file name is not valid UTF-8; rename it to index it"
                for rel in found if not is_utf8_name(rel)]  # fmt: skip
    paths = [rel for rel in found if is_utf8_name(rel)]
    if not paths:
        raise DataFormatError(f"{root}: none of its {len(found)} pictures has a valid UTF-8 file name "
                              f"(e.g. {problems[0].split(': ')[0]}); rename them to index them")  # fmt: skip
    caps = []
    for i, rel in enumerate(paths):
        side = (root / rel).with_suffix(".txt")
        if side.is_file():
            caps += _read_captions_beside(side, i, problems)
    return Source(str(root), root.resolve(), paths, [Path(p).stem for p in paths], caps, problems=problems)


def _require_utf8(path: Path) -> None:
    """SOURCE's own path must be valid UTF-8: it is stored (index.json's roots, parquet's image_path)."""
    full = os.path.abspath(path)
    if not is_utf8_name(full):
        raise DataFormatError(f"{display_path(full)}: this path is not valid UTF-8 text, so the pictures' paths "
                              "could not be stored; rename it (or the folder above it that is not)")  # fmt: skip


def resolve_source(spec: str, captions_per_image: int = 5) -> Source:
    """`DATASET_DIR:SPLIT`, a dataset directory (its test split), a folder of pictures, or one picture."""
    path = Path(spec)
    if path.exists():
        _require_utf8(path)
    if path.is_dir():
        if _is_dataset_dir(path):
            if not (path / "test_caps.txt").is_file():
                splits = sorted(p.name[: -len("_caps.txt")] for p in path.glob("*_caps.txt"))
                raise DataFormatError(f"{path}: a dataset directory; name a split as {path}:SPLIT ({', '.join(splits)})")
            return split_source(path, "test", captions_per_image)
        return folder_source(path)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_SUFFIXES:
            raise DataFormatError(f"{path}: not a picture ({', '.join(IMAGE_SUFFIXES)}) nor a directory")
        problems: list[str] = []
        side = path.with_suffix(".txt")
        caps = _read_captions_beside(side, 0, problems) if side.is_file() else []
        return Source(str(path), path.parent.resolve(), [path.name], [path.stem], caps, problems=problems)
    if ":" in spec:
        root, split = spec.rsplit(":", 1)
        if Path(root).is_dir() and split:
            _require_utf8(Path(root))
            return split_source(Path(root), split, captions_per_image)
    raise DataFormatError(f"{display_path(spec)}: {path_kind(path)} (give a folder of pictures, a dataset directory, or "
                          "DATASET_DIR:SPLIT)")  # fmt: skip


def hash_pictures(root: Path, paths: list[str], progress: bool = False,
                  desc: str = "hash pictures") -> tuple[list[str | None], list[str]]:  # fmt: skip
    """The sha256 of each picture file's bytes (what pictures.jsonl records, so `vse index --refresh` can tell a
    changed picture from an unchanged one), and a problem naming each file that cannot be read (its hash None).

    Hashed before the pictures are embedded: a picture rewritten in between is then recorded with its older
    hash and seen as changed by the next refresh, never stored as unchanged with a stale embedding."""
    from vsekit.utils.progress import progress_bar

    hashes: list[str | None] = []
    problems: list[str] = []
    for rel in progress_bar(paths, desc=desc, unit="img", enabled=progress):
        path = root / rel
        try:
            hashes.append(sha256_file(path))
        except OSError as e:
            hashes.append(None)
            problems.append(f"{display_path(path)}: cannot read image ({e.strerror or e})")
    return hashes, problems


# ------------------------------------------------------------------------------ resumable encoding


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def chunk_batches(lo: int, hi: int, batch_size: int) -> list[range]:
    """The batches rows lo..hi-1 of one chunk are encoded in: runs of `batch_size` rows starting at the chunk's
    own first row. A batch never spans two chunks and a chunk's batches do not depend on which chunks were
    encoded before it, so a resumed run feeds the model exactly the tensors an uninterrupted run feeds it, and
    its embeddings are bit-identical on any CPU, given the same number of threads (float32 products of other
    shapes, or split over other thread counts, may round differently, e.g. with AVX-512 kernels). `vse index`
    and `vse embed` both batch through this."""
    return [range(b, min(hi, b + batch_size)) for b in range(lo, hi, batch_size)]


def _work_plan(work_dir: Path, n: int, chunk_size: int) -> int:
    """The chunk size of `work_dir`'s finished chunks: the one its plan.json records when a run with the same
    items was interrupted (finished chunks are only reusable with their own boundaries), else `chunk_size`,
    recorded for a later resume. Chunk files without a readable plan are removed (their rows are unknown)."""
    plan = work_dir / "plan.json"
    old = None
    if plan.is_file():
        with contextlib.suppress(OSError, ValueError):
            old = json.loads(plan.read_text(encoding="utf-8"))
    if isinstance(old, dict) and old.get("items") == n and isinstance(old.get("chunk_size"), int) and old["chunk_size"] > 0:
        if old["chunk_size"] != chunk_size:
            logger.info("%s: resuming with the chunk size this run started with (%d, not --chunk-size %d)",
                        work_dir, old["chunk_size"], chunk_size)  # fmt: skip
        return int(old["chunk_size"])
    for stale in work_dir.glob("chunk_*"):
        stale.unlink(missing_ok=True)
    atomic_write_json(plan, {"items": n, "chunk_size": chunk_size})
    return chunk_size


def encode_resumable(work_dir: Path, n: int, load: Callable[[int], Any], embed: Callable[[list], torch.Tensor],
                     chunk_size: int = 256, batch_size: int = 16, strict: bool = False, progress: bool = True,
                     desc: str = "index") -> tuple[np.ndarray, np.ndarray, list[str], list[int]]:  # fmt: skip
    """Embed items 0..n-1 chunk by chunk, saving each finished chunk, so a rerun skips finished work.

    Returns (embeddings flattened to [kept, F], kept item indices, problems, per-item embedding shape).
    An item whose `load` raises DataFormatError is skipped and reported (with `strict`, it stops the run).
    """
    from vsekit.utils.progress import progress_bar

    if chunk_size < 1 or batch_size < 1:
        raise VseInputError(f"--chunk-size and --batch-size must be >= 1, got {chunk_size} and {batch_size}")
    work_dir.mkdir(parents=True, exist_ok=True)
    chunk_size = _work_plan(work_dir, n, chunk_size)
    n_chunks = (n + chunk_size - 1) // chunk_size
    done = [c for c in range(n_chunks) if (work_dir / f"chunk_{c:06d}.npz").is_file()]
    start_count = sum(min(chunk_size, n - c * chunk_size) for c in done)
    bar = progress_bar(total=n, initial=start_count, desc=desc, unit="img", enabled=progress)
    for c in range(n_chunks):
        path = work_dir / f"chunk_{c:06d}.npz"
        if path.is_file():
            continue
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        embs, kept, problems, shape = [], [], [], []
        for batch in chunk_batches(lo, hi, batch_size):
            items = []
            for i in batch:
                try:
                    items.append(load(i))
                    kept.append(i)
                except DataFormatError as e:
                    if strict:
                        raise
                    problems.append(str(e))
            if items:
                out = embed(items)
                shape = list(out.shape[1:])
                embs.append(out.reshape(out.shape[0], -1).float().cpu())
            bar.update(len(batch))
        emb = torch.cat(embs).numpy() if embs else np.zeros((0, 0), dtype=np.float32)
        atomic_write_json(work_dir / f"chunk_{c:06d}.json", problems)
        _save_npz(path, emb=emb.astype(np.float32), kept=np.asarray(kept, dtype=np.int64),
                  shape=np.asarray(shape, dtype=np.int64))  # fmt: skip
    bar.close()
    embs, kept, problems, shape = [], [], [], []
    for c in range(n_chunks):
        with np.load(work_dir / f"chunk_{c:06d}.npz", allow_pickle=False) as z:
            if len(z["kept"]):
                embs.append(z["emb"])
                kept.append(z["kept"])
                shape = [int(v) for v in z["shape"]]
        problems += json.loads((work_dir / f"chunk_{c:06d}.json").read_text(encoding="utf-8"))
    if not embs:
        return np.zeros((0, 0), dtype=np.float32), np.zeros(0, dtype=np.int64), problems, shape
    return np.concatenate(embs), np.concatenate(kept), problems, shape


# ------------------------------------------------------------------------------------- the index


def run_weights(run_dir: Path, which: str) -> Path:
    """The weights file `load_run` reads for `which` (best falls back to last)."""
    path = run_dir / f"{which}.safetensors"
    if not path.is_file() and which == "best":
        path = run_dir / "last.safetensors"
    return path


def _missing(path: Path) -> str:
    """Why an index file is not there: "missing", or "is a folder, expected a file"."""
    return "missing" if not path.exists() else f"{path_kind(path)}, expected a file"


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise IndexFormatError(f"{path}: {_missing(path)} (the index directory is incomplete)")
    out = []
    for lineno, line in enumerate(read_lines(path), 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise IndexFormatError(f"{path}:{lineno}: not valid JSON ({e})") from e
        if not isinstance(item, dict):
            raise IndexFormatError(f"{path}:{lineno}: expected a JSON object")
        out.append(item)
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _load_emb(path: Path, rows: int, mmap: bool) -> np.ndarray:
    if not path.is_file():
        raise IndexFormatError(f"{path}: {_missing(path)} (the index directory is incomplete)")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise IndexFormatError(f"{path}: not a readable .npy array ({e})") from e
    if arr.ndim != 2 or arr.shape[0] != rows or arr.dtype != np.float32:
        raise IndexFormatError(f"{path}: expected float32 [{rows}, dim], got {arr.dtype} {list(arr.shape)}")
    return arr


class SearchIndex:
    """An index directory opened for searching: metadata in memory, embeddings memory-mapped."""

    def __init__(self, index_dir: str | Path, mmap: bool = True) -> None:
        self.dir = Path(index_dir)
        meta_path = self.dir / "index.json"
        if self.dir.exists() and not self.dir.is_dir():
            raise IndexFormatError(f"{self.dir}: {path_kind(self.dir)}, expected an index folder (built by `vse index`)")
        if meta_path.exists() and not meta_path.is_file():
            raise IndexFormatError(f"{meta_path}: {path_kind(meta_path)}, expected the index's JSON file")
        if not meta_path.is_file():
            raise IndexFormatError(f"{self.dir}: not a vsekit index (no index.json); build one with `vse index`")
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise IndexFormatError(f"{meta_path}: not valid JSON ({e})") from e
        if not isinstance(self.meta, dict) or self.meta.get("format") != INDEX_FORMAT:
            raise IndexFormatError(f"{meta_path}: format {self.meta.get('format') if isinstance(self.meta, dict) else None!r}; "
                                   f"this vsekit reads {INDEX_FORMAT}")  # fmt: skip
        try:
            self.roots = [Path(r) for r in self.meta["roots"]]
            self.params = FaissParams(**self.meta["faiss"])
            segments = self.meta["segments"]
            files = self.meta["files"]
        except (KeyError, TypeError) as e:
            raise IndexFormatError(f"{meta_path}: missing or malformed field ({e})") from e
        self.pictures: list[dict] = []
        self.captions: list[dict] = []
        self._img: list[np.ndarray] = []
        self._cap: list[np.ndarray] = []
        for seg in segments:
            sdir = self.dir / seg["dir"]
            pics = _read_jsonl(sdir / "pictures.jsonl")
            caps = _read_jsonl(sdir / "captions.jsonl")
            for lineno, p in enumerate(pics, 1):
                if not isinstance(p.get("path"), str) or not isinstance(p.get("root"), int) or not 0 <= p["root"] < len(self.roots):
                    raise IndexFormatError(f"{sdir / 'pictures.jsonl'}:{lineno}: needs a 'path' string and a valid 'root'")
            self.pictures += pics
            self.captions += caps
            self._img.append(_load_emb(sdir / "image_emb.npy", len(pics), mmap))
            self._cap.append(_load_emb(sdir / "caption_emb.npy", len(caps), mmap) if caps else None)
        self._img_offsets = np.cumsum([0] + [len(a) for a in self._img])
        self._cap_offsets = np.cumsum([0] + [0 if a is None else len(a) for a in self._cap])
        self.image_faiss = read_faiss(self.dir / files["images"])
        self.caption_faiss = read_faiss(self.dir / files["captions"]) if files.get("captions") else None
        if self.image_faiss.ntotal != len(self.pictures):
            raise IndexFormatError(f"{self.dir / files['images']}: holds {self.image_faiss.ntotal} vectors but the "
                                   f"segments list {len(self.pictures)} pictures")  # fmt: skip
        n_caps = 0 if self.caption_faiss is None else self.caption_faiss.ntotal
        if n_caps != len(self.captions):
            raise IndexFormatError(f"{self.dir}: caption index holds {n_caps} vectors for {len(self.captions)} captions")
        if self.params.kind == "ivfpq" and self.params.refine:
            shape = list(self.meta.get("image_emb_shape") or [])
            self.image_faiss = RefinedIndex(self.image_faiss, lambda ids: stored_proxies(self.image_emb(ids), shape),
                                            self.params.refine)  # fmt: skip
            if self.caption_faiss is not None and type(self.caption_faiss).__name__ == "IndexIVFPQ":
                self.caption_faiss = RefinedIndex(self.caption_faiss, self.caption_emb, self.params.refine)
        tune_faiss(self.image_faiss, self.params)
        if self.caption_faiss is not None:
            tune_faiss(self.caption_faiss, self.params)

    @property
    def n_pictures(self) -> int:
        return len(self.pictures)

    @property
    def n_captions(self) -> int:
        return len(self.captions)

    def set_search_params(self, nprobe: int | None = None, ef_search: int | None = None) -> None:
        if nprobe is not None:
            self.params.nprobe = nprobe
        if ef_search is not None:
            self.params.ef_search = ef_search
        self.params.validate()
        for idx in (self.image_faiss, self.caption_faiss):
            if idx is not None:
                tune_faiss(idx, self.params)

    def _gather(self, parts: list, offsets: np.ndarray, ids: np.ndarray) -> np.ndarray:
        seg = np.searchsorted(offsets, ids, side="right") - 1
        return np.stack([np.asarray(parts[s][i - offsets[s]]) for s, i in zip(seg, ids)]) if len(ids) else None

    def image_emb(self, ids: np.ndarray) -> np.ndarray:
        """Full image embeddings [len(ids), F] of pictures by global id."""
        return self._gather(self._img, self._img_offsets, np.asarray(ids, dtype=np.int64))

    def caption_emb(self, ids: np.ndarray) -> np.ndarray:
        return self._gather(self._cap, self._cap_offsets, np.asarray(ids, dtype=np.int64))

    def all_image_emb(self) -> np.ndarray:
        return np.concatenate([np.asarray(a) for a in self._img]) if self._img else np.zeros((0, 0), np.float32)

    def segment_spans(self) -> list[tuple[range, range]]:
        """Per segment (in index.json's order): the global ids of its pictures and of its captions."""
        return [(range(int(self._img_offsets[s]), int(self._img_offsets[s + 1])),
                 range(int(self._cap_offsets[s]), int(self._cap_offsets[s + 1]))) for s in range(len(self._img))]  # fmt: skip

    def segment_arrays(self, s: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Segment `s`'s stored (memory-mapped) image and caption embeddings (None: it has no captions)."""
        return self._img[s], self._cap[s]

    def picture_file(self, i: int) -> Path | None:
        """The picture's file, or None when it is missing or would resolve outside its recorded root."""
        if not 0 <= i < len(self.pictures):
            return None
        pic = self.pictures[i]
        root = self.roots[pic["root"]].resolve()
        try:
            path = (root / pic["path"]).resolve()
        except (OSError, RuntimeError):
            return None
        if not path.is_relative_to(root) or not path.is_file():
            return None
        return path


def _check_same_model(meta: dict, fingerprint: dict, out_dir: Path) -> None:
    old = meta.get("model", {})
    if old.get("weights_sha256") != fingerprint["weights_sha256"]:
        raise IndexFormatError(
            f"{out_dir / 'index.json'}: built with {old.get('run_dir')}/{old.get('weights')} "
            f"(sha256 {str(old.get('weights_sha256'))[:12]}), not with {fingerprint['run_dir']}/{fingerprint['weights']} "
            f"(sha256 {fingerprint['weights_sha256'][:12]}); embeddings of two models cannot share an index — use a new --out"
        )


def _lock_owner(path: Path) -> int | None:
    """The pid a lock file records (None: empty, unreadable or not a pid)."""
    try:
        return int(path.read_text(encoding="ascii").split()[0])
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        return None


def _pid_alive(pid: int) -> bool | None:
    """Whether process `pid` runs on this machine (None: cannot tell here)."""
    if os.name != "posix":  # os.kill(pid, 0) is not a probe on Windows
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # PermissionError: it exists, owned by someone else
        return True
    return True


def _lock_busy(lock: Path, pid: int | None) -> IndexFormatError:
    who = f" (pid {pid})" if pid is not None else ""
    return IndexFormatError(f"{lock}: another `vse index` is writing to this index right now{who}; wait for it to finish")


def _acquire_flock(lock: Path):
    """An flock on `lock` (the kernel drops it when its holder dies, so a dead writer never blocks); returns the fd."""
    import fcntl

    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise _lock_busy(lock, _lock_owner(lock)) from None
        except BaseException:
            os.close(fd)
            raise
        try:  # a writer that finished between our open and flock removed the file: lock the current one
            if os.path.samestat(os.fstat(fd), os.stat(lock)):
                return fd
        except FileNotFoundError:
            pass
        os.close(fd)


def _acquire_pidfile(lock: Path, log: Callable[[str], None]) -> int:
    """Without fcntl (Windows): the lock is the file itself, created exclusively; a leftover one whose pid
    is not running any more is taken over, one we cannot check is refused with how to clear it."""
    for _ in range(3):
        try:
            return os.open(lock, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            pid = _lock_owner(lock)
            alive = _pid_alive(pid) if pid is not None else None
            if alive:
                raise _lock_busy(lock, pid) from None
            if alive is None:
                by = f"`vse index` (pid {pid})" if pid is not None else "a `vse index` that recorded no pid"
                raise IndexFormatError(f"{lock}: held by {by}; if no `vse index` is writing to this index any "
                                       f"more, delete {lock} and run again") from None  # fmt: skip
            log(f"note: {lock}: its writer (pid {pid}) is not running any more; taking the lock over")
            lock.unlink(missing_ok=True)
    raise _lock_busy(lock, _lock_owner(lock))


@contextmanager
def writer_lock(out_dir: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """One writer per index directory: two `vse index` runs adding to the same index at once would both write
    segment N and one would be lost, so the second fails fast instead, naming the pid that holds the lock.

    The lock file records the holder's pid and is removed on every exit, error or Ctrl-C included; an
    `--out` folder this call created is removed too when nothing else was written in it. A lock left by a
    killed writer does not block: flock dies with its holder (elsewhere the recorded pid is checked).
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise IndexFormatError(f"{out_dir}: exists and is not a folder; choose another --out")
    created = not out_dir.exists()
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = out_dir / LOCK_NAME
    try:
        try:
            import fcntl  # noqa: F401

            flocked, fd = True, _acquire_flock(lock)
            prev = _lock_owner(lock)
            if prev is not None and prev != os.getpid():  # its holder is gone, or we would not hold the flock
                log(f"note: {lock}: left by a `vse index` (pid {prev}) that stopped without finishing; taking it over")
        except ImportError:
            flocked, fd = False, _acquire_pidfile(lock, log)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode("ascii"))
            yield
        finally:
            if flocked:
                lock.unlink(missing_ok=True)  # while still held, so no other writer can be holding this file
                os.close(fd)  # releases the flock
            else:  # Windows cannot delete an open file
                os.close(fd)
                lock.unlink(missing_ok=True)
    finally:
        if created:
            with contextlib.suppress(OSError):
                out_dir.rmdir()  # only when empty: a failed first run leaves no folder behind


_LEFTOVER = re.compile(r"(images|captions)\.g\d+\.faiss|\.(index\.json|(images|captions)\.g\d+\.faiss)\..+\.tmp")


def _first_build_leftovers(out_dir: Path) -> list[Path] | None:
    """What a first `vse index` killed outright (SIGKILL, power cut) leaves in a folder without index.json:
    segments/NNNN folders and FAISS / temp files no index.json lists. None when the folder holds anything
    else (then it is not ours to clear)."""
    found = []
    for p in out_dir.iterdir():
        if p.name in (".work", LOCK_NAME):
            continue
        if p.name == "segments" and p.is_dir() and all(q.name.isdigit() and q.is_dir() for q in p.iterdir()):
            found.append(p)
        elif _LEFTOVER.fullmatch(p.name) and p.is_file():
            found.append(p)
        else:
            return None
    return found


def _check_new_out(out_dir: Path, log: Callable[[str], None]) -> None:
    """A first build needs an empty folder (or one holding only its own .work/.lock): refuse anything else,
    and clear what a killed first build left, so its rerun is not refused."""
    if not out_dir.exists():
        return
    leftovers = _first_build_leftovers(out_dir)
    if leftovers is None:
        raise IndexFormatError(f"{out_dir}: exists, is not empty and holds no index.json; choose an empty or new --out")
    if leftovers:
        log(f"note: {out_dir}: removing what an unfinished first `vse index` left ({', '.join(sorted(p.name for p in leftovers))})")
        for p in leftovers:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


@contextmanager
def _undo_on_failure(out_dir: Path) -> Iterator[None]:
    """Remove what this run created in `out_dir` when it fails before switching index.json over, and never
    anything that was there before: new top-level files and folders, new segments/NNNN, new .work/JOB. After
    Ctrl-C the finished chunks in .work are kept (the rerun resumes from them); after an error they are not
    (the folder is left as it was, so a rerun is never refused because of this run)."""
    def listing(d: Path) -> set[str]:
        try:
            return set(os.listdir(d))
        except OSError:
            return set()

    before = {".": listing(out_dir), "segments": listing(out_dir / "segments"), ".work": listing(out_dir / ".work")}
    stamp = _stamp(out_dir / "index.json")
    try:
        yield
    except BaseException as e:
        if _stamp(out_dir / "index.json") == stamp:  # not committed: nothing of this run is listed anywhere
            keep_work = isinstance(e, KeyboardInterrupt)
            for sub in ("segments", ".work"):
                if sub in before["."] and not (sub == ".work" and keep_work):
                    for name in listing(out_dir / sub) - before[sub]:
                        shutil.rmtree(out_dir / sub / name, ignore_errors=True)
            for name in listing(out_dir) - before["."] - {LOCK_NAME}:
                if name == ".work" and keep_work:
                    continue
                path = out_dir / name
                with contextlib.suppress(OSError):
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        raise


def build_index(run_dir: str | Path, source: str, out_dir: str | Path, *, checkpoint: str = "best",
                params: FaissParams | None = None, device: str | torch.device = "cpu", batch_size: int = 16,
                chunk_size: int = 256, pixels: bool = False, strict: bool = False,
                captions_file: str | Path | None = None, progress: bool = True,
                log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """Embed the pictures of `source` with a trained run and write (or extend) the index in `out_dir`.

    Pictures already in the index are skipped, so rerunning after new files arrive only adds those. A run
    that is interrupted resumes from its last finished chunk. Returns the new index.json contents.
    """
    with writer_lock(Path(out_dir), log), _undo_on_failure(Path(out_dir)):
        return _build_index(run_dir, source, out_dir, checkpoint=checkpoint, params=params, device=device,
                            batch_size=batch_size, chunk_size=chunk_size, pixels=pixels, strict=strict,
                            captions_file=captions_file, progress=progress, log=log)  # fmt: skip


def read_extra_captions(captions_file: str | Path | None) -> list[str]:
    """`--captions FILE`: its non-empty lines, stripped (read before any picture is embedded)."""
    if not captions_file:
        return []
    expect_file(Path(captions_file), "a text file of captions (one per line)", DataFormatError)
    return [s.strip() for s in read_lines(Path(captions_file)) if s.strip()]


def _build_index(run_dir: str | Path, source: str, out_dir: str | Path, *, checkpoint: str, params: FaissParams | None,
                 device: str | torch.device, batch_size: int, chunk_size: int, pixels: bool, strict: bool,
                 captions_file: str | Path | None, progress: bool, log: Callable[[str], None]) -> dict:  # fmt: skip
    from vsekit.runs import load_run

    run_dir, out_dir = Path(run_dir), Path(out_dir)
    device = torch.device(device)
    weights = run_weights(run_dir, checkpoint)
    model, run_cfg = load_run(run_dir, checkpoint, device)
    fingerprint = {
        "run_dir": str(run_dir.resolve()), "checkpoint": checkpoint, "weights": weights.name,
        "weights_sha256": sha256_file(weights), "recipe": model.recipe.name,
        "similarity": model.recipe.model.similarity.name, "embed_dim": model.recipe.model.embed_dim,
        "rerank": needs_rerank(model),
    }  # fmt: skip
    meta_path = out_dir / "index.json"
    old = SearchIndex(out_dir) if meta_path.is_file() else None
    if old is not None:
        _check_same_model(old.meta, fingerprint, out_dir)
        if params is not None and params.kind != old.params.kind:
            log(f"note: {out_dir} is a {old.params.kind} index; new pictures are added to it as such")
        params = old.params
    params = params or FaissParams()
    params.validate()
    if old is None:
        _check_new_out(out_dir, log)

    src = resolve_source(source, model.recipe.data.captions_per_image)
    roots = [str(r) for r in (old.roots if old else [])]
    if str(src.root) not in roots:
        roots.append(str(src.root))
    root_id = roots.index(str(src.root))
    present = {(p["root"], p["path"]) for p in old.pictures} if old else set()
    todo = [i for i, p in enumerate(src.paths) if (root_id, p) not in present]
    if old is not None and len(todo) < len(src.paths):
        log(f"{len(src.paths) - len(todo)} of {len(src.paths)} pictures are already in the index; adding {len(todo)}")
    # everything that can be checked before the pictures are embedded is checked here, so no work is wasted
    if strict and src.problems:
        raise DataFormatError(src.problems[0])
    extra = read_extra_captions(captions_file)
    if old is None and todo:
        check_trainable(params, len(todo))

    use_features = use_stored_features(src, model, pixels, run_cfg, run_dir, log)
    sha: dict[int, str] = {}  # picture files: the sha256 of their bytes, recorded for `vse index --refresh`
    unread: list[str] = []
    if use_features:
        from vsekit.data.validate import check_split_features

        check_split_features(src.split)  # NaN/inf rows: name the file and row before anything is embedded
        mode = {"mode": "features", "dataset": src.label}
        split = src.split

        def load(j: int):
            return split.image_features(todo[j])

        def embed(items: list) -> torch.Tensor:
            return embed_features(model, items, device)
    else:
        embedder = ImageEmbedder(model, run_cfg, device)
        mode = embedder.describe()
        hashes, unread = hash_pictures(src.root, [src.paths[i] for i in todo], progress)
        if strict and unread:
            raise DataFormatError(unread[0])
        sha = {i: h for i, h in zip(todo, hashes) if h is not None}
        todo = [i for i in todo if i in sha]

        def load(j: int):
            return embedder.load(src.root / src.paths[todo[j]])

        def embed(items: list) -> torch.Tensor:
            return embedder.embed(torch.stack(items))

    # the job names what is embedded (and, for picture files, their bytes: a picture changed between an interrupted
    # run and its rerun gets a new job, so no chunk embedded from its old bytes is stored under its new hash)
    items = [[src.paths[i], sha[i]] for i in todo] if sha else [src.paths[i] for i in todo]
    job = hashlib.sha256(json.dumps([fingerprint["weights_sha256"], mode, str(src.root), items],
                                    sort_keys=True).encode()).hexdigest()[:16]  # fmt: skip
    work = out_dir / ".work" / job
    emb, kept_local, problems, shape = encode_resumable(work, len(todo), load, embed, chunk_size, batch_size, strict,
                                                        progress, desc="embed pictures")  # fmt: skip
    problems = src.problems + unread + problems
    for msg in problems[:10]:
        log(f"warning: skipped {msg}")
    if len(problems) > 10:
        log(f"warning: … and {len(problems) - 10} more unreadable pictures skipped")
    kept = [todo[j] for j in kept_local]
    if not kept:
        shutil.rmtree(work, ignore_errors=True)
        if old is None:
            raise DataFormatError(f"{source}: none of its {len(src.paths)} pictures could be embedded")
        log(f"nothing to add to {out_dir}")
        return old.meta
    if old is not None and old.meta.get("image_emb_shape") != shape:
        raise IndexFormatError(f"{meta_path}: pictures embed to shape {old.meta.get('image_emb_shape')}, the new ones to {shape}")

    base = old.n_pictures if old else 0
    first = src.first_caption()
    pictures = [{"root": root_id, "path": src.paths[i], "caption": first[i], "id": src.ids[i],
                 **({"sha256": sha[i]} if i in sha else {})} for i in kept]  # fmt: skip
    new_id = {i: base + n for n, i in enumerate(kept)}
    captions = [{"text": t, "image": new_id[i]} for t, i in src.captions if i in new_id]
    if extra:
        known = {c["text"] for c in (old.captions if old else [])} | {c["text"] for c in captions}
        captions += [{"text": s, "image": None} for s in dict.fromkeys(extra) if s not in known]
    cap_emb = TextEmbedder(model, device).embed([c["text"] for c in captions]).numpy().astype(np.float32)

    img_proxy = proxy_vectors(model, torch.from_numpy(emb)).numpy()
    segment = {"source": src.label, "embedded_from": mode, "skipped": problems}
    meta = append_segment(out_dir, old, fingerprint=fingerprint, params=params, roots=roots, pictures=pictures,
                          image_emb=emb, emb_shape=shape, proxies=img_proxy, captions=captions, caption_emb=cap_emb,
                          segment=segment)  # fmt: skip
    shutil.rmtree(work, ignore_errors=True)
    if (out_dir / ".work").is_dir() and not any((out_dir / ".work").iterdir()):
        (out_dir / ".work").rmdir()
    return meta


def stored_proxies(emb: np.ndarray, shape: list[int]) -> np.ndarray:
    """The inner-product vectors of stored image embeddings (what `proxy_vectors` gave when they were added):
    the embedding itself, or for several views [V, D] their mean, L2-normalised (the AEOM shortlist key)."""
    x = np.asarray(emb, dtype=np.float32)
    if len(shape) <= 1:
        return np.ascontiguousarray(x)
    v = x.reshape(len(x), -1, shape[-1]).mean(1)
    return np.ascontiguousarray(v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12), dtype=np.float32)


def model_fingerprint(run_dir: Path, checkpoint: str, model) -> dict:
    """What identifies the model of an index or an embeddings folder (its weights' sha256 above all)."""
    weights = run_weights(Path(run_dir), checkpoint)
    return {
        "run_dir": str(Path(run_dir).resolve()), "checkpoint": checkpoint, "weights": weights.name,
        "weights_sha256": sha256_file(weights), "recipe": model.recipe.name,
        "similarity": model.recipe.model.similarity.name, "embed_dim": model.recipe.model.embed_dim,
        "rerank": needs_rerank(model),
    }  # fmt: skip


def build_index_from_embeddings(emb_dir: str | Path, out_dir: str | Path, *, params: FaissParams | None = None,
                                run_dir: str | Path | None = None, checkpoint: str = "best",
                                log: Callable[[str], None] = print) -> dict:  # fmt: skip
    """`vse index --from-embeddings DIR`: an index from a `vse embed` folder, with no model forward.

    The vectors are taken as they are (img_emb rows -> pictures, text_emb rows -> their captions); the
    model fingerprint comes from DIR/embed.json, so `vse search` later embeds queries with the same run. A
    folder written by another tool (clip-retrieval's layout, no embed.json) needs `run_dir`: the run whose
    embeddings these are (only the dimension can be checked; that they come from it is the caller's word).
    Adding to an existing index follows `vse index`: same model, same dimension, pictures already present skipped.
    """
    with writer_lock(Path(out_dir), log), _undo_on_failure(Path(out_dir)):
        return _build_from_embeddings(Path(emb_dir), Path(out_dir), params, run_dir, checkpoint, log)


def _build_from_embeddings(emb_dir: Path, out_dir: Path, params: FaissParams | None, run_dir: str | Path | None,
                           checkpoint: str, log: Callable[[str], None]) -> dict:  # fmt: skip
    from vsekit.search.embedding_folder import open_embedding_folder

    folder = open_embedding_folder(emb_dir)
    info = folder.info
    fingerprint = info.get("model")
    recorded = isinstance(fingerprint, dict) and bool(fingerprint.get("weights_sha256"))
    if run_dir is not None:
        from vsekit.runs import load_run

        model, _ = load_run(Path(run_dir), checkpoint, torch.device("cpu"))
        theirs = model_fingerprint(Path(run_dir), checkpoint, model)
        if recorded and theirs["weights_sha256"] != fingerprint["weights_sha256"]:
            raise VseInputError(f"{emb_dir / 'embed.json'}: embedded with {fingerprint.get('run_dir')}, not with "
                                f"{run_dir} (weights differ); drop RUN_DIR or use the run that embedded them")  # fmt: skip
        if not recorded and folder.dim != model.recipe.model.embed_dim:
            raise VseInputError(f"{folder.img[0]}: {folder.dim}-d vectors, but {run_dir} embeds to "
                                f"{model.recipe.model.embed_dim} dimensions")  # fmt: skip
        fingerprint = theirs
    elif not recorded:
        raise VseInputError(f"{emb_dir / 'embed.json'}: missing or without a model record (not written by `vse embed`); "
                            "name the run whose embeddings these are: vse index RUN_DIR --from-embeddings DIR")  # fmt: skip
    shape = list(info.get("image_emb_shape") or [folder.dim])
    if int(np.prod(shape)) != folder.dim:
        raise VseInputError(f"{emb_dir / 'embed.json'}: image_emb_shape {shape} does not match the {folder.dim}-d "
                            f"vectors of {folder.img[0]}")  # fmt: skip
    meta_path = out_dir / "index.json"
    old = SearchIndex(out_dir) if meta_path.is_file() else None
    if old is not None:
        _check_same_model(old.meta, fingerprint, out_dir)
        if old.meta.get("image_emb_shape") != shape:
            raise IndexFormatError(f"{folder.img[0]}: {shape} image embeddings, but the index {meta_path} holds "
                                   f"{old.meta.get('image_emb_shape')}")  # fmt: skip
        params = old.params
    params = params or FaissParams()
    params.validate()
    if old is None:
        _check_new_out(out_dir, log)
        check_trainable(params, folder.n, shape[-1])  # the proxies: the embedding, or the mean of its views

    root = info.get("root") or str(emb_dir.resolve())
    roots = [str(r) for r in (old.roots if old else [])]
    if root not in roots:
        roots.append(root)
    root_id = roots.index(root)
    present = {(p["root"], p["path"]) for p in old.pictures} if old else set()
    base = old.n_pictures if old else 0
    pictures: list[dict] = []
    captions: list[dict] = []
    embs, caps = [], []
    for i in range(len(folder.img)):
        cols = folder.metadata(i)
        n = folder.rows[i]
        paths = cols.get("image_path") or [f"{folder.img[i].stem}:{r}" for r in range(n)]
        texts = cols.get("caption") or [None] * n
        ids = cols.get("id") or [Path(str(p)).stem for p in paths]
        rel = [_relative(str(p), root) for p in paths]
        keep = [r for r in range(n) if (root_id, rel[r]) not in present]
        if not keep:
            continue
        x = folder.image_chunk(i)
        embs.append(x[keep])
        t = folder.text_chunk(i)
        for j, r in enumerate(keep):
            pid = base + len(pictures) + j
            if t is not None and texts[r] is not None:
                captions.append({"text": texts[r], "image": pid})
        if t is not None:
            caps.append(t[[r for r in keep if texts[r] is not None]])
        pictures += [{"root": root_id, "path": rel[r], "caption": texts[r], "id": str(ids[r])} for r in keep]
        present.update((root_id, rel[r]) for r in keep)
    if not pictures:
        if old is None:
            raise VseInputError(f"{emb_dir}: no rows to index")
        log(f"nothing to add to {out_dir}: every row of {emb_dir} is already in it")
        return old.meta
    if old is not None and len(pictures) < folder.n:
        log(f"{folder.n - len(pictures)} of {folder.n} rows are already in the index; adding {len(pictures)}")
    emb = np.concatenate(embs)
    cap_emb = np.concatenate(caps) if caps else np.zeros((0, fingerprint.get("embed_dim") or folder.dim), np.float32)
    if old is not None and old.caption_faiss is not None and len(cap_emb) and cap_emb.shape[1] != old.caption_faiss.d:
        raise IndexFormatError(f"{folder.text[0]}: {cap_emb.shape[1]}-d caption embeddings, but the index holds "
                               f"{old.caption_faiss.d}-d ones")  # fmt: skip
    proxies = stored_proxies(emb, shape)
    segment = {"source": f"embeddings {emb_dir}", "embedded_from": {"mode": "embeddings", "folder": str(emb_dir.resolve()),
               **({"model_input": info["embedded_from"]} if info.get("embedded_from") else {})}, "skipped": []}  # fmt: skip
    return append_segment(out_dir, old, fingerprint=fingerprint, params=params, roots=roots, pictures=pictures,
                          image_emb=emb, emb_shape=shape, proxies=proxies, captions=captions, caption_emb=cap_emb,
                          segment=segment)  # fmt: skip


def _relative(path: str, root: str) -> str:
    """A picture path relative to its root (what pictures.jsonl stores); labels like SPLIT:ROW stay as they are."""
    p = Path(path)
    if p.is_absolute():
        try:
            return p.relative_to(root).as_posix()
        except ValueError:
            return p.as_posix()
    return path


def use_stored_features(src: Source, model, pixels: bool, run_cfg: dict, run_dir: Path,
                        log: Callable[[str], None] | None = None) -> bool:  # fmt: skip
    """Whether a split's stored features (not its pictures) are what the run embeds: the run takes features
    of that width and, where both sides record it, from the same extractor; `--pixels` says pictures. A split
    without pictures must pass (`_check_features_only`, which raises otherwise). `vse index` and `vse embed`
    decide alike."""
    if src.features_only:
        _check_features_only(src, model, pixels, run_cfg, run_dir)
    use = (src.split is not None and not pixels and model.recipe.model.image.kind == "precomp"
           and src.split.feature_shape[1] == model.spec.img_dim)  # fmt: skip
    if use and not src.features_only:
        theirs, ours = read_manifest_extractor(src.root), run_extractor_spec(run_cfg)
        if theirs and ours and not same_extractor(theirs, ours):
            if log is not None:
                log(f"note: {src.root}'s features come from another extractor ({theirs.get('name')}) than the "
                    f"run's ({ours.get('name')}); embedding its pictures instead")  # fmt: skip
            return False
    return use


def _check_features_only(src: Source, model, pixels: bool, run_cfg: dict, run_dir: Path) -> None:
    """A split without pictures can only be indexed from its features, by a model trained on such features."""
    missing = src.root / f"{src.split.split}_images.txt"
    if pixels:
        raise DataFormatError(f"{missing}: missing, so --pixels has no pictures to read; drop --pixels to index "
                              "the split's stored features")  # fmt: skip
    if model.recipe.model.image.kind != "precomp":
        raise DataFormatError(f"{missing}: missing, and this run embeds pictures ({model.recipe.model.image.kind} "
                              "image encoder), not stored features: the split has nothing it can index")  # fmt: skip
    src.split.require_width(model.spec.img_dim, f"the run {run_dir}")
    theirs, ours = read_manifest_extractor(src.root), run_extractor_spec(run_cfg)
    if theirs and ours and not same_extractor(theirs, ours):
        raise DataFormatError(f"{src.root}: its features come from another extractor ({theirs.get('name')}) than the "
                              f"run's ({ours.get('name')}), and {missing.name} is missing, so there are no pictures "
                              "to embed instead")  # fmt: skip


def segment_dir_name(number: int) -> str:
    """`segments/NNNN`: where segment `number` of an index lives."""
    return f"segments/{number:04d}"


def next_segment_number(meta: dict | None) -> int:
    """The number of the next new segment folder: one past every folder index.json lists (a refresh drops and
    renumbers segments, so their count is not enough: a new folder must never be one that is still listed)."""
    if not meta:
        return 0
    listed = [int(m.group(1)) for seg in meta["segments"] if (m := re.fullmatch(r"segments/(\d+)", str(seg.get("dir"))))]
    return max(len(meta["segments"]), max(listed, default=-1) + 1)


def build_caption_faiss(caption_emb: np.ndarray, params: FaissParams):
    """The caption index of a new (or rebuilt) index: the pictures' kind, except a flat one when there are too
    few captions to train IVF lists (or PQ codes) on."""
    small = params.kind in IVF_KINDS and len(caption_emb) < max(39 * max(1, params.nlist), 10_000 if params.kind == "ivfpq" else 0)
    return build_faiss(caption_emb, FaissParams("flat") if small else replace(params))


def append_segment(out_dir: Path, old: SearchIndex | None, *, fingerprint: dict, params: FaissParams, roots: list[str],
                   pictures: list[dict], image_emb: np.ndarray, emb_shape: list[int], proxies: np.ndarray,
                   captions: list[dict], caption_emb: np.ndarray, segment: dict) -> dict:  # fmt: skip
    """Write one segment, extend (or build) the FAISS indexes, then switch index.json over to them.

    Order: segment files (unlisted until index.json names them), new-generation FAISS files, index.json in
    one rename, then the old generation's files are deleted — a crash at any point leaves a readable index.
    """
    out_dir = Path(out_dir)
    seg_rel = segment_dir_name(next_segment_number(old.meta if old else None))
    seg_dir = out_dir / seg_rel
    if seg_dir.exists():
        shutil.rmtree(seg_dir)  # left by a run that crashed before index.json listed it
    seg_dir.mkdir(parents=True)
    _write_jsonl(seg_dir / "pictures.jsonl", pictures)
    atomic_save_npy(seg_dir / "image_emb.npy", np.asarray(image_emb, dtype=np.float32))
    _write_jsonl(seg_dir / "captions.jsonl", captions)
    atomic_save_npy(seg_dir / "caption_emb.npy", np.asarray(caption_emb, dtype=np.float32))

    if old is None:
        img_index = build_faiss(proxies, params)
    else:
        img_index = old.image_faiss
        total = img_index.ntotal + len(proxies)
        trained = params.trained_on or int(old.meta["segments"][0]["pictures"])  # indexes from before the rule
        if params.kind in IVF_KINDS and total > RETRAIN_GROWTH * trained:
            logger.info("%s: %d vectors, more than %g x the %d its IVF lists were trained on: re-training them on "
                        "a fresh sample and rebuilding the index", out_dir, total, RETRAIN_GROWTH, trained)  # fmt: skip
            stored = stored_proxies(old.all_image_emb(), old.meta.get("image_emb_shape") or [])
            img_index = build_faiss(np.concatenate([stored, np.asarray(proxies, dtype=np.float32)]), params)
        else:
            img_index.add(np.ascontiguousarray(proxies, dtype=np.float32))
    cap_index = old.caption_faiss if old else None
    if cap_index is None and captions:
        cap_index = build_caption_faiss(caption_emb, params)
    elif cap_index is not None and captions:
        cap_index.add(np.ascontiguousarray(caption_emb, dtype=np.float32))
    gen = int(old.meta["generation"]) + 1 if old else 1
    files = {"images": f"images.g{gen}.faiss", "captions": f"captions.g{gen}.faiss" if cap_index is not None else None}
    write_faiss(img_index, out_dir / files["images"])
    if cap_index is not None:
        write_faiss(cap_index, out_dir / files["captions"])

    now = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    segment = {"dir": seg_rel, "pictures": len(pictures), "captions": len(captions), **segment, "added": now}
    meta = {
        "format": INDEX_FORMAT,
        "generation": gen,
        "created": old.meta["created"] if old else now,
        "updated": now,
        "model": fingerprint,
        "image_emb_shape": list(emb_shape),
        "faiss": asdict(params),
        "roots": roots,
        "segments": (old.meta["segments"] if old else []) + [segment],
        "files": files,
        "counts": {"pictures": (old.n_pictures if old else 0) + len(pictures),
                   "captions": (old.n_captions if old else 0) + len(captions)},
    }  # fmt: skip
    atomic_write_json(out_dir / "index.json", meta)
    if old is not None:
        for name in old.meta["files"].values():
            if name and name not in files.values():
                (out_dir / name).unlink(missing_ok=True)
    return meta
