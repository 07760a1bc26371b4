"""FAISS, the inner-product indexes of a search index: which kind and its knobs (`FaissParams`), the automatic
sizes (autofaiss' rules), training and building one, the search-time knobs, IVF-PQ's exact re-check, and
writing one atomically. Knows no index folder: `search.store` decides which file holds which index."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from vsekit.errors import MissingPackageError, VseInputError
from vsekit.utils.io import atomic_path

INDEX_KINDS = ("flat", "ivf", "hnsw", "ivfpq")
IVF_KINDS = ("ivf", "ivfpq")

logger = logging.getLogger(__name__)


@dataclass
class FaissParams:
    """Which FAISS index and its knobs. `flat` is exact; `ivf` and `hnsw` trade recall for speed
    (docs/search.md has the measured trade-off)."""

    kind: str = "flat"
    nlist: int = (
        0  # ivf: number of lists; 0 = about 4*sqrt(n) (autofaiss' rule), at least 39 vectors per list
    )
    nprobe: int = 16  # ivf: lists visited per query (search time; more = higher recall, slower)
    hnsw_m: int = 32  # hnsw: graph degree (memory: 8*M bytes per vector on top of the vector)
    ef_construction: int = 80  # hnsw: build-time beam
    ef_search: int = 64  # hnsw: query-time beam (search time; more = higher recall, slower)
    pq_m: int = 0  # ivfpq: sub-quantizers (bytes per code); 0 = auto_pq(d): about d/8, dividing d
    trained_on: int = 0  # ivf/ivfpq: vectors in the index when its lists were last trained (the retrain rule)
    refine: int = (
        10  # ivfpq: re-score the top refine*k of the PQ codes exactly with the stored embeddings (0 = off)
    )

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


def import_faiss():
    """The faiss module, or one line saying how to install it (search is an optional extra)."""
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
        raise VseInputError(
            f"--nlist {nlist}: an IVF index with {nlist} lists needs at least {nlist} vectors to "
            f"train, got {n}; use a smaller --nlist (0 = automatic) or --index flat"
        )
    if params.kind == "ivfpq":
        if d is not None and params.pq_m and d % params.pq_m:
            raise VseInputError(f"--pq-m {params.pq_m} must divide the vector dimension {d}")
        _, nbits = auto_pq(d or 8, n)
        if n < 2**nbits:
            raise VseInputError(
                f"--index ivfpq: an IVF-PQ index needs at least {2**nbits} vectors to train its "
                f"codes, got {n}; use --index flat or ivf"
            )


def build_faiss(vectors: np.ndarray, params: FaissParams, seed: int = 0):
    """A FAISS inner-product index over `vectors` [N, D] (trained first when the kind needs it)."""
    faiss = import_faiss()
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
            logger.info(
                "IVF-PQ: %d lists, %d x %d-bit codes, trained on %d of %d vectors",
                nlist,
                m,
                nbits,
                min(n, max_train),
                n,
            )
        else:
            index = faiss.IndexIVFFlat(faiss.IndexFlatIP(d), d, nlist, faiss.METRIC_INNER_PRODUCT)
            max_train = 256 * nlist
        index.cp.seed = seed
        train = (
            x
            if n <= max_train
            else x[np.sort(np.random.default_rng(seed).choice(n, max_train, replace=False))]
        )
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
    """Temp file + fsync + rename, streamed in blocks through a Python file (not through memory): FAISS's own
    file writer ignores an error when it closes the file, so a disk that fills at the last flush would leave
    a truncated index; Python's `write` and `close` raise instead, and the old index stays."""
    faiss = import_faiss()
    if isinstance(index, RefinedIndex):
        index = index.base
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        faiss.write_index(index, faiss.PyCallbackIOWriter(f.write))


def build_caption_faiss(caption_emb: np.ndarray, params: FaissParams):
    """The caption index of a new (or rebuilt) index: the pictures' kind, except a flat one when there are too
    few captions to train IVF lists (or PQ codes) on."""
    small = params.kind in IVF_KINDS and len(caption_emb) < max(
        39 * max(1, params.nlist), 10_000 if params.kind == "ivfpq" else 0
    )
    return build_faiss(caption_emb, FaissParams("flat") if small else replace(params))
