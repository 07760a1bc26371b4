"""Search benchmarks: FAISS query latency vs recall on synthetic vectors, and a loopback load test of `vse serve`.

    from vsekit_lab.bench.search import bench_search, bench_serve
    rows = bench_search(n=1_000_000, dim=1024)      # exact vs IVF: p50/p99 ms per query, recall@10
    load = bench_serve("runs/demo/index", requests=2000, concurrency=4, max_seconds=60)

From a shell: `vse bench search [OPTIONS]` (defaults: this function's) and `vse bench serve INDEX`.

`bench_search` draws a clustered set (a mixture of `clusters` Gaussian blobs on the unit sphere, like real
embeddings, where neighbours share a topic; unclustered Gaussian vectors have no near neighbours and are
the worst case for any ANN index — `clusters=0` measures that). Vectors are generated chunk by chunk from
seeded generators, so the exact index, the ground truth and each approximate index see identical data
without the full matrix ever being held twice; peak memory is about one fp32 copy (4 GB at 1M x 1024).
Latency is per single query (one at a time, as a server sees them), on `threads` FAISS threads.
"""

from __future__ import annotations

import inspect
import json
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from vsekit.errors import MissingPackageError, SetupError, VseInputError
from vsekit.utils.io import open_npy


def _faiss():
    try:
        import faiss
    except ImportError as e:
        raise MissingPackageError("the search benchmark needs faiss-cpu: pip install 'vsekit[search]'") from e
    return faiss


def _percentiles(ms: list[float]) -> dict:
    a = np.asarray(ms)
    return {
        "p50_ms": round(float(np.percentile(a, 50)), 3),
        "p99_ms": round(float(np.percentile(a, 99)), 3),
        "mean_ms": round(float(a.mean()), 3),
        "n": len(ms),
    }


class ClusteredVectors:
    """Deterministic synthetic embeddings: chunk c of the database always has the same rows."""

    def __init__(self, dim: int, clusters: int, spread: float, seed: int) -> None:
        self.dim, self.clusters, self.spread, self.seed = dim, clusters, spread, seed
        if clusters > 0:
            c = np.random.default_rng([seed, 0]).standard_normal((clusters, dim), dtype=np.float32)
            self.centers = c / np.linalg.norm(c, axis=1, keepdims=True)

    def draw(self, n: int, stream: int) -> np.ndarray:
        rng = np.random.default_rng([self.seed, 1, stream])
        noise = rng.standard_normal((n, self.dim), dtype=np.float32)
        if self.clusters > 0:
            noise *= self.spread / np.sqrt(
                self.dim
            )  # noise norm ~ spread; same-cluster cosine ~ 1/(1+spread^2)
            noise += self.centers[rng.integers(0, self.clusters, n)]
        noise /= np.linalg.norm(noise, axis=1, keepdims=True)
        return noise

    def queries(self, m: int) -> np.ndarray:
        return self.draw(m, stream=0)

    def chunks(self, n: int, chunk: int):
        for c, start in enumerate(range(0, n, chunk)):
            yield self.draw(min(chunk, n - start), stream=c + 1)


class NpyVectors:
    """Your own embeddings from a (N, D) `.npy` file, rows L2-normalised as `vse index` stores them.

    Queries come from `query_path` (e.g. caption embeddings against image embeddings) or, without one, are the
    last `holdout` rows of the file, which are then left out of the database so no query finds itself.
    """

    def __init__(self, path: str | Path, query_path: str | Path | None = None, holdout: int = 200) -> None:
        self.path = Path(path)
        self.base = self._open(self.path)
        self.dim = self.base.shape[1]
        if query_path is not None:
            q = self._open(Path(query_path))
            if q.shape[1] != self.dim:
                raise VseInputError(
                    f"{query_path}: queries are {q.shape[1]}-d but {self.path} holds {self.dim}-d vectors"
                )
            self._queries, self.size = q, len(self.base)
        else:
            if len(self.base) <= holdout:
                raise VseInputError(
                    f"{self.path}: {len(self.base)} rows leave nothing after holding out {holdout} queries"
                )
            self._queries, self.size = self.base[len(self.base) - holdout :], len(self.base) - holdout

    @staticmethod
    def _open(path: Path) -> np.ndarray:
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such file")
        a = open_npy(path)
        if a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
            raise VseInputError(f"{path}: expected a non-empty (N, D) array, got shape {a.shape}")
        if not np.issubdtype(a.dtype, np.floating):
            raise VseInputError(f"{path}: expected float vectors, got dtype {a.dtype}")
        return a

    def _normalise(self, x: np.ndarray, where: str) -> np.ndarray:
        x = np.ascontiguousarray(x, dtype=np.float32)
        if not np.isfinite(x).all():
            raise VseInputError(f"{self.path}: non-finite values in {where}")
        norm = np.linalg.norm(x, axis=1, keepdims=True)
        if (norm == 0).any():
            raise VseInputError(f"{self.path}: all-zero vectors in {where} (cosine is undefined)")
        return x / norm

    def queries(self, m: int) -> np.ndarray:
        return self._normalise(self._queries[:m], "the queries")

    def chunks(self, n: int, chunk: int):
        n = min(n, self.size)
        for start in range(0, n, chunk):
            yield self._normalise(
                self.base[start : min(n, start + chunk)], f"rows {start}..{min(n, start + chunk) - 1}"
            )


class EmbeddingFolderVectors(NpyVectors):
    """The image embeddings of a `vse embed` / clip-retrieval folder (img_emb/img_emb_N.npy in order), read chunk
    file by chunk file. Queries: its text_emb rows when it has them (caption -> picture search), else the last
    `holdout` image rows, left out of the database."""

    def __init__(self, folder: str | Path, holdout: int = 200) -> None:
        from vsekit.search.embed import open_embedding_folder

        self.folder = open_embedding_folder(folder)
        self.path = self.folder.dir
        self.dim = self.folder.dim
        texts = [t for t in self.folder.text if t is not None]
        if texts:
            q = open_npy(texts[0])
            if q.shape[1] != self.dim:
                raise VseInputError(
                    f"{texts[0]}: {q.shape[1]}-d captions but {self.folder.img[0]} holds {self.dim}-d vectors"
                )
            self._queries, self.size = q[:holdout], self.folder.n
        else:
            if self.folder.n <= holdout:
                raise VseInputError(
                    f"{self.path}: {self.folder.n} rows leave nothing after holding out {holdout} queries"
                )
            last = self.folder.img[-1]
            tail = open_npy(last)
            if len(tail) < holdout:
                raise VseInputError(
                    f"{last}: fewer than {holdout} rows to hold out as queries; give fewer --queries"
                )
            self._queries, self.size = tail[len(tail) - holdout :], self.folder.n - holdout

    def chunks(self, n: int, chunk: int):
        n = min(n, self.size)
        start = 0
        for path, rows in zip(self.folder.img, self.folder.rows):
            if start >= n:
                return
            x = open_npy(path)[: min(rows, n - start)]
            yield self._normalise(x, f"{path.name}")
            start += len(x)


def write_embedding_folder(data, n: int, out: str | Path, chunk: int = 100_000) -> Path:
    """Write `data`'s first n database vectors (chunk by chunk) as a clip-retrieval-layout folder: img_emb_N.npy +
    metadata_N.parquet (image_path = "synthetic:ROW"), no text_emb, so the benchmark holds out its last rows as
    queries. Used by `vse bench search --save-embeddings`."""
    from vsekit.search.embed import chunk_name, write_chunk

    out = Path(out)
    n_chunks = -(-n // chunk)
    start = 0
    for c, x in enumerate(data.chunks(n, chunk)):
        cols = {"image_path": [f"synthetic:{start + i}" for i in range(len(x))], "caption": [None] * len(x)}
        write_chunk(
            out, chunk_name(c, n_chunks), x, None, cols, {"chunk": c, "first_row": start, "rows": len(x)}
        )
        start += len(x)
    return out


class _Reranked:
    """An index's top `factor`*k shortlist re-scored exactly against the float32 vectors (what vsekit's segments
    store beside a compressed index), best k returned: the cost and the recall of a refine step."""

    def __init__(self, index, vectors: np.ndarray, factor: int) -> None:
        self.index, self.vectors, self.factor = index, vectors, factor

    def search(self, q: np.ndarray, k: int):
        _, cand = self.index.search(q, k * self.factor)
        out = np.full((len(q), k), -1, dtype=np.int64)
        for i, (row, c) in enumerate(zip(q, cand)):
            c = c[c >= 0]
            top = np.argsort(-(self.vectors[c] @ row), kind="stable")[:k]
            out[i, : len(top)] = c[top]
        return None, out


def _time_single(index, queries: np.ndarray, k: int, warmup: int = 3) -> tuple[list[float], np.ndarray]:
    for q in queries[:warmup]:
        index.search(q[None], k)
    ms, ids = [], []
    for q in queries:
        t0 = time.perf_counter()
        _, i = index.search(q[None], k)
        ms.append((time.perf_counter() - t0) * 1000)
        ids.append(i[0])
    return ms, np.stack(ids)


def _recall(ids: np.ndarray, truth: np.ndarray) -> float:
    k = truth.shape[1]
    return float(np.mean([len(set(a[:k]) & set(b)) / k for a, b in zip(ids, truth)]))


def bench_search(
    n: int = 1_000_000,
    dim: int = 1024,
    k: int = 10,
    queries: int = 200,
    exact_queries: int = 30,
    clusters: int = 10_000,
    spread: float = 1.0,
    nlist: int = 0,
    nprobes: tuple[int, ...] = (4, 8, 16, 32),
    sq8: bool = True,
    hnsw_m: int = 0,
    ef_searches: tuple[int, ...] = (32, 64, 128),
    train_size: int = 0,
    kmeans_iters: int = 10,
    threads: int = 1,
    chunk: int = 50_000,
    seed: int = 0,
    vectors: str | Path | None = None,
    query_vectors: str | Path | None = None,
    ivfpq: bool = False,
    pq_ms: tuple[int, ...] = (),
    rerank: int = 0,
    ivf_flat: bool = True,
    embeddings: str | Path | None = None,
    save_embeddings: str | Path | None = None,
    log=print,
) -> dict:
    """Exact (flat) vs IVF (and optionally IVF-SQ8 / HNSW) on `n` synthetic `dim`-d unit vectors.

    With `vectors` (a (N, D) .npy of your own embeddings) the database is that file's first min(n, N) rows
    instead (minus held-out queries when no `query_vectors` file is given; see `NpyVectors`).

    Returns {"setup": ..., "rows": [{"index", "params", "build_s", "bytes_per_vector", "p50_ms", "p99_ms",
    "recall_at_k"}, ...]}; recall is against the exact top-k of the same queries. `nlist=0` picks the
    number of lists as `vse index --index ivf` does (autofaiss' rule, about 4*sqrt(n): 4096 at 1M);
    `train_size=0` trains k-means on max(65,536, 40*nlist) vectors (FAISS wants at least 39 per list).

    `ivfpq` adds IVF-PQ rows with the code `vse index --index ivfpq` picks (`auto_pq`: d/8 bytes, 8-bit codes);
    `pq_ms` overrides that code size (one IVF-PQ build per m); `rerank=F` adds rows where the IVF-PQ top F*k
    is re-scored exactly against the float32 vectors (held in memory: one fp32 copy of the database).
    `ivf_flat=False` leaves out the IVF-Flat rows. `embeddings`: the database is a `vse embed` folder's
    img_emb files (`EmbeddingFolderVectors`); `save_embeddings`: first write the synthetic set as such a folder
    and benchmark from it (the index is then built from files on disk, as `vse index --from-embeddings` does).
    """
    faiss = _faiss()
    if n < 1 or dim < 1 or k < 1 or queries < 1:
        raise VseInputError("n, dim, k and queries must be positive")
    faiss.omp_set_num_threads(threads)
    if save_embeddings is not None:
        if vectors is not None or embeddings is not None:
            raise VseInputError(
                "--save-embeddings writes the synthetic set; it does not go with --vectors / --from-embeddings"
            )
        t0 = time.perf_counter()
        synthetic = ClusteredVectors(dim, clusters, spread, seed)
        embeddings = write_embedding_folder(synthetic, n + queries, save_embeddings, chunk)
        log(
            json.dumps(
                {"wrote": str(embeddings), "rows": n + queries, "s": round(time.perf_counter() - t0, 1)}
            )
        )
    if embeddings is not None:
        data = EmbeddingFolderVectors(embeddings, holdout=queries)
        n, dim = min(n, data.size), data.dim
        if save_embeddings is None:
            clusters, spread = 0, 0.0
        vectors = embeddings
    elif vectors is not None:
        data = NpyVectors(vectors, query_vectors, holdout=queries)
        n, dim, clusters, spread = min(n, data.size), data.dim, 0, 0.0
    else:
        data = ClusteredVectors(dim, clusters, spread, seed)
    if nlist <= 0:
        from vsekit.search.index import auto_nlist

        nlist = auto_nlist(n)
    train_size = min(n, train_size if train_size > 0 else max(65_536, 40 * nlist))
    q = data.queries(queries)
    queries = len(q)
    rows = []
    setup = {
        "n": n,
        "dim": dim,
        "k": k,
        "queries": queries,
        "clusters": clusters,
        "spread": spread,
        "threads": threads,
        "seed": seed,
        "faiss": faiss.__version__,
        "nlist": nlist,
        "train_size": train_size,
        "kmeans_iters": kmeans_iters,
        "vectors": str(vectors) if vectors is not None else None,
    }

    t0 = time.perf_counter()
    flat = faiss.IndexFlatIP(dim)
    for x in data.chunks(n, chunk):
        flat.add(x)
    build = time.perf_counter() - t0
    _, truth = flat.search(q, k)  # batched: ground truth for every approximate index
    ms, ids = _time_single(flat, q[:exact_queries], k)
    rows.append(
        {
            "index": "flat (exact)",
            "params": "",
            "build_s": round(build, 1),
            "bytes_per_vector": 4 * dim,
            **_percentiles(ms),
            "recall_at_k": round(_recall(ids, truth[:exact_queries]), 4),
        }
    )
    log(json.dumps(rows[-1]))
    del flat

    def ivf_rows(label: str, make) -> None:
        t0 = time.perf_counter()
        index = make()
        train = np.concatenate([x for _, x in zip(range(-(-train_size // chunk)), data.chunks(n, chunk))])[
            :train_size
        ]
        index.cp.niter = kmeans_iters
        index.cp.seed = seed
        index.train(train)
        del train
        for x in data.chunks(n, chunk):
            index.add(x)
        build = time.perf_counter() - t0
        for nprobe in nprobes:
            index.nprobe = nprobe
            ms, ids = _time_single(index, q, k)
            code = index.code_size if hasattr(index, "code_size") else 4 * dim
            rows.append(
                {
                    "index": label,
                    "params": f"nlist={nlist} nprobe={nprobe}",
                    "build_s": round(build, 1),
                    "bytes_per_vector": code + 8,
                    **_percentiles(ms),
                    "recall_at_k": round(_recall(ids, truth), 4),
                }
            )
            log(json.dumps(rows[-1]))
        if rerank and "PQ" in label:
            exact = np.concatenate(list(data.chunks(n, chunk)))
            for nprobe in nprobes:
                index.nprobe = nprobe
                ms, ids = _time_single(_Reranked(index, exact, rerank), q, k)
                rows.append(
                    {
                        "index": f"{label} + exact re-rank",
                        "params": f"nlist={nlist} nprobe={nprobe} shortlist={rerank}k",
                        "build_s": round(build, 1),
                        "bytes_per_vector": code + 8,
                        **_percentiles(ms),
                        "recall_at_k": round(_recall(ids, truth), 4),
                    }
                )
                log(json.dumps(rows[-1]))
            del exact

    if ivf_flat:
        ivf_rows(
            "IVF-Flat",
            lambda: faiss.IndexIVFFlat(faiss.IndexFlatIP(dim), dim, nlist, faiss.METRIC_INNER_PRODUCT),
        )
    if ivfpq:
        from vsekit.search.index import auto_pq

        auto_m, nbits = auto_pq(dim, n)
        setup["pq"] = f"m={auto_m} nbits={nbits}"
        for m in pq_ms or (auto_m,):
            if dim % m:
                raise VseInputError(f"--pq-m {m} must divide the vector dimension {dim}")
            ivf_rows(
                f"IVF-PQ{m}",
                lambda m=m: faiss.IndexIVFPQ(
                    faiss.IndexFlatIP(dim), dim, nlist, m, nbits, faiss.METRIC_INNER_PRODUCT
                ),
            )
    if sq8:
        ivf_rows(
            "IVF-SQ8",
            lambda: faiss.IndexIVFScalarQuantizer(
                faiss.IndexFlatIP(dim), dim, nlist, faiss.ScalarQuantizer.QT_8bit, faiss.METRIC_INNER_PRODUCT
            ),
        )
    if hnsw_m:
        t0 = time.perf_counter()
        index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        for x in data.chunks(n, chunk):
            index.add(x)
        build = time.perf_counter() - t0
        for ef in ef_searches:
            index.hnsw.efSearch = ef
            ms, ids = _time_single(index, q, k)
            rows.append(
                {
                    "index": "HNSW-Flat",
                    "params": f"M={hnsw_m} efSearch={ef}",
                    "build_s": round(build, 1),
                    "bytes_per_vector": 4 * dim + 8 * hnsw_m,
                    **_percentiles(ms),
                    "recall_at_k": round(_recall(ids, truth), 4),
                }
            )
            log(json.dumps(rows[-1]))
    return {"setup": setup, "rows": rows}


SEARCH_DEFAULTS = {k: p.default for k, p in inspect.signature(bench_search).parameters.items()}  # the CLI's


def format_search_table(result: dict) -> str:
    s = result["setup"]
    source = (
        f"from {s['vectors']}" if s.get("vectors") else f"({s['clusters']:,} clusters, spread {s['spread']})"
    )
    head = (
        f"{s['n']:,} x {s['dim']}-d unit vectors {source}, "
        f"{s['queries']} single queries, k={s['k']}, {s['threads']} FAISS thread(s), faiss {s['faiss']}\n\n"
    )
    lines = [
        "| index | params | build (s) | bytes/vector | p50 (ms) | p99 (ms) | recall@k vs exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        lines.append(
            f"| {r['index']} | {r['params']} | {r['build_s']} | {r['bytes_per_vector']} | {r['p50_ms']} | "
            f"{r['p99_ms']} | {r['recall_at_k']} |"
        )
    return head + "\n".join(lines)


# ------------------------------------------------------------------------------------- load test


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_serve(
    index_dir: str | Path,
    requests: int = 2000,
    concurrency: int = 4,
    max_seconds: float = 60.0,
    k: int = 10,
    queries: list[str] | None = None,
    device: str = "cpu",
    startup_timeout: float = 120.0,
) -> dict:
    """Bounded loopback load test: starts `vse serve` on 127.0.0.1 in a child process, sends at most
    `requests` GET /search calls from `concurrency` client threads for at most `max_seconds`, stops it.

    Returns requests done, seconds, requests/s, latency p50/p99 (ms, client side) and the error count
    (any non-200 answer or failed connection).
    """
    import httpx

    if requests < 1 or concurrency < 1 or max_seconds <= 0:
        raise VseInputError("requests, concurrency and max_seconds must be positive")
    queries = queries or [
        "a red apple",
        "a cat",
        "a house with a tree",
        "a blue car",
        "a flower",
        "a man",
        "a green triangle",
        "a musical note",
        "a map of the world",
        "a smiling sun",
    ]
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [
        sys.executable,
        "-m",
        "vsekit.cli",
        "serve",
        str(index_dir),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--device",
        device,
        "--max-connections",
        str(max(64, 4 * concurrency)),
        "--rate-limit",
        "0",
    ]  # measures capacity: one loopback client would otherwise hit the rate limit
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + startup_timeout
        while True:
            if proc.poll() is not None:
                raise SetupError(
                    f"`vse serve` exited with {proc.returncode}: {proc.stderr.read().decode()[-2000:]}"
                )
            try:
                if httpx.get(base + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise SetupError(f"`vse serve` did not answer /healthz within {startup_timeout} s")
            time.sleep(0.2)
        lat: list[float] = []
        errors: list[str] = []
        lock = threading.Lock()
        counter = {"next": 0}
        stop_at = time.monotonic() + max_seconds

        def worker() -> None:
            with httpx.Client(base_url=base, timeout=30) as client:
                while time.monotonic() < stop_at:
                    with lock:
                        i = counter["next"]
                        if i >= requests:
                            return
                        counter["next"] += 1
                    t0 = time.perf_counter()
                    try:
                        r = client.get("/search", params={"q": queries[i % len(queries)], "k": k})
                        ok = r.status_code == 200 and len(r.json()["results"]) > 0
                        err = None if ok else f"HTTP {r.status_code}"
                    except (httpx.HTTPError, ValueError, KeyError) as e:
                        err = f"{type(e).__name__}: {e}"
                    dt = (time.perf_counter() - t0) * 1000
                    with lock:
                        lat.append(dt)
                        if err:
                            errors.append(err)

        t0 = time.perf_counter()
        pool = [threading.Thread(target=worker) for _ in range(concurrency)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        wall = time.perf_counter() - t0
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return {
        "requests": len(lat),
        "concurrency": concurrency,
        "seconds": round(wall, 2),
        "requests_per_s": round(len(lat) / wall, 1),
        **_percentiles(lat),
        "errors": len(errors),
        "first_errors": errors[:5],
    }
