"""`vse bench search` (FAISS latency and recall), `vse bench serve` (a load test of `vse serve`) and `vse bench
late-interaction` (two-stage CHAN search against exhaustive scoring)."""

from __future__ import annotations

import argparse
from pathlib import Path

from vsekit.commands.argtypes import POSITIVE, checked, in_range, positive_number
from vsekit.commands.jsonout import add_json_args
from vsekit_lab.commands.bench.rows import AddVerb, emit, write_json


def run_search(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.search import bench_search, format_search_table

    res = bench_search(
        n=args.n,
        dim=args.dim,
        queries=args.queries,
        exact_queries=args.exact_queries,
        clusters=args.clusters,
        spread=args.spread,
        nlist=args.nlist,
        nprobes=tuple(args.nprobe),
        sq8=not args.no_sq8,
        hnsw_m=args.hnsw_m,
        ef_searches=tuple(args.ef_search),
        train_size=args.train_size,
        kmeans_iters=args.kmeans_iters,
        threads=args.threads,
        vectors=args.vectors,
        query_vectors=args.query_vectors,
        ivfpq=args.ivfpq,
        pq_ms=tuple(args.pq_m),
        rerank=args.rerank,
        ivf_flat=not args.no_ivf_flat,
        embeddings=args.from_embeddings,
        save_embeddings=args.save_embeddings,
        log=lambda *_: None,
    )
    write_json(args, res)
    print(format_search_table(res).split("\n\n", 1)[0] + "\n")
    s = res["setup"]
    source = Path(s["vectors"]).name if s["vectors"] else f"{s['clusters']:,} clusters"
    for r in res["rows"]:
        r["setup"] = f"{s['n']:,} x {s['dim']}, {source}, k={s['k']}"
    emit(
        args,
        [
            ("setup", "vectors"),
            ("index", "index"),
            ("params", "params"),
            ("build_s", "build s"),
            ("p50_ms", "p50 ms"),
            ("p99_ms", "p99 ms"),
            ("recall_at_k", "recall@k"),
        ],
        res["rows"],
    )
    return 0


def run_serve_load(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.search import bench_serve

    row = bench_serve(
        args.index,
        requests=args.requests,
        concurrency=args.concurrency,
        max_seconds=args.max_seconds,
        k=args.k,
    )
    write_json(args, row)
    row["index"] = args.index
    emit(
        args,
        [
            ("index", "index"),
            ("n", "requests"),
            ("concurrency", "concurrency"),
            ("errors", "errors"),
            ("requests_per_s", "requests/s"),
            ("p50_ms", "p50 ms"),
            ("p99_ms", "p99 ms"),
        ],
        [row],
    )
    return 0 if row["errors"] == 0 else 1


# FAISS crashes building an HNSW graph of degree 1; 0 builds none
HNSW_M = checked(lambda v: None if v == 0 or v >= 2 else "must be 0 (no HNSW rows) or at least 2", "HnswM")


def add_search_verbs(add: AddVerb) -> None:
    """`vse bench search`, `vse bench serve` and `vse bench late-interaction`.
    The search defaults are `bench_search`'s own: the documented 1M x 1024 run (docs/benchmarks.md)."""
    from vsekit_lab.bench.search import SEARCH_DEFAULTS as d

    se = add(
        "search",
        "FAISS exact vs IVF (and HNSW) latency and recall on synthetic vectors or your own (--vectors)",
        run_search,
    )
    se.add_argument(
        "--n",
        type=int,
        action=POSITIVE,
        default=d["n"],
        help="database vectors (with --vectors: the most rows used)",
    )
    se.add_argument("--dim", type=int, action=POSITIVE, default=d["dim"])
    se.add_argument("--queries", type=int, action=POSITIVE, default=d["queries"])
    se.add_argument(
        "--exact-queries",
        type=int,
        action=POSITIVE,
        default=d["exact_queries"],
        help="single queries timed on the flat index",
    )
    se.add_argument(
        "--clusters",
        type=int,
        action=in_range(0, note="0 = none"),
        default=d["clusters"],
        help="Gaussian clusters of the synthetic set (0 = none)",
    )
    se.add_argument("--spread", type=float, action=in_range(0, None, finite=True), default=d["spread"])
    se.add_argument(
        "--nlist",
        type=int,
        action=in_range(0, note="0 = automatic"),
        default=d["nlist"],
        help="IVF lists (0 = about 4*sqrt(n), as `vse index` picks)",
    )
    se.add_argument("--nprobe", type=int, action=POSITIVE, nargs="+", default=list(d["nprobes"]))
    se.add_argument(
        "--train-size",
        type=int,
        action=in_range(0, note="0 = automatic"),
        default=d["train_size"],
        help="k-means training vectors (0 = max(65536, 40*nlist))",
    )
    se.add_argument("--kmeans-iters", type=int, action=POSITIVE, default=d["kmeans_iters"])
    se.add_argument("--no-sq8", action="store_true", help="skip the IVF-SQ8 rows")
    se.add_argument("--no-ivf-flat", action="store_true", help="skip the IVF-Flat rows")
    se.add_argument(
        "--ivfpq",
        action="store_true",
        help="add IVF-PQ rows (the code `vse index --index ivfpq` picks: dim/8 bytes, 8-bit)",
    )
    se.add_argument(
        "--pq-m",
        type=int,
        action=POSITIVE,
        nargs="+",
        default=[],
        help="IVF-PQ code sizes to build (default: the automatic one)",
    )
    se.add_argument(
        "--rerank",
        type=int,
        action=in_range(0, note="0 = no such rows"),
        default=0,
        metavar="F",
        help="also re-score the IVF-PQ top F*k exactly against the float32 vectors (0 = no such rows)",
    )
    se.add_argument(
        "--from-embeddings",
        metavar="DIR",
        help="index a `vse embed` folder's img_emb files (queries: its text_emb, else its last rows)",
    )
    se.add_argument(
        "--save-embeddings",
        metavar="DIR",
        help="write the synthetic set (n + queries rows) as an embeddings folder first, then index from it",
    )
    se.add_argument(
        "--hnsw-m",
        type=int,
        action=HNSW_M,
        default=d["hnsw_m"],
        help="also build HNSW with this M (slow to build at 1M)",
    )
    se.add_argument("--ef-search", type=int, action=POSITIVE, nargs="+", default=list(d["ef_searches"]))
    se.add_argument("--threads", type=int, action=POSITIVE, default=d["threads"], help="FAISS threads")
    se.add_argument(
        "--vectors",
        metavar="DB.npy",
        help="(N, D) embeddings to index instead of synthetic vectors (--n caps the rows used)",
    )
    se.add_argument(
        "--query-vectors",
        metavar="Q.npy",
        help="(M, D) query embeddings; default: hold out the last --queries rows of --vectors",
    )
    add_json_args(se, "the full result (setup and rows)", path_form=True)

    sv = add(
        "serve",
        "bounded loopback load test of `vse serve INDEX` (GET /search from N client threads)",
        run_serve_load,
    )
    sv.add_argument("index", metavar="INDEX_DIR")
    sv.add_argument("--requests", type=int, action=POSITIVE, default=2000)
    sv.add_argument("--concurrency", type=int, action=POSITIVE, default=32)
    sv.add_argument(
        "--max-seconds",
        type=float,
        action=positive_number(),
        default=120.0,
        help="stop sending after this long",
    )
    sv.add_argument("-k", type=int, action=POSITIVE, default=10)
    add_json_args(sv, "the result", path_form=True)

    li = add(
        "late-interaction",
        "two-stage search of a CHAN index (one-vector shortlist, then the model's late interaction) against "
        "exhaustive scoring: recall of the exhaustive top-k and latency per shortlist size",
        run_late_interaction,
    )
    li.add_argument(
        "index",
        nargs="?",
        metavar="INDEX_DIR",
        help="a CHAN index (default: build a synthetic one in --work)",
    )
    li.add_argument("--work", metavar="DIR", help="where the synthetic set, its CHAN run and index are built")
    li.add_argument("--pictures", type=int, action=POSITIVE, default=5000, help="synthetic: indexed pictures")
    li.add_argument("--epochs", type=int, action=POSITIVE, default=3, help="synthetic: CHAN training epochs")
    li.add_argument("--queries", type=int, action=POSITIVE, default=200, help="captions of the index queried")
    li.add_argument("--shortlist", type=int, action=POSITIVE, nargs="+", default=[10, 20, 50, 100, 200, 500])
    li.add_argument("-k", type=int, action=POSITIVE, default=10)
    li.add_argument("--threads", type=int, action=POSITIVE, default=1, help="torch and FAISS threads")
    add_json_args(li, "the full result (setup, exhaustive, rows)", path_form=True)


def run_late_interaction(args: argparse.Namespace) -> int:
    from vsekit.errors import VseInputError
    from vsekit_lab.bench.late_interaction import bench_late_interaction, build_synthetic_chan_index

    if (args.index is None) == (args.work is None):
        raise VseInputError("give a CHAN INDEX_DIR, or --work DIR to build a synthetic one there")
    index = args.index or build_synthetic_chan_index(args.work, pictures=args.pictures, epochs=args.epochs)
    res = bench_late_interaction(
        index, queries=args.queries, shortlists=args.shortlist, k=args.k, threads=args.threads
    )
    write_json(args, res)
    s, ex = res["setup"], res["exhaustive"]
    for r in res["rows"]:
        r["setup"] = (
            f"{s['pictures']:,} pictures, sets {s['set_shape']}, {s['queries']} queries, k={s['k']}, "
            f"{s['threads']} thread(s)"
        )
        r["shortlist"] = f"{r['shortlist']}{' (default)' if r['default'] else ''}"
        r["exhaustive_p50_ms"] = ex["p50_ms"]
    emit(
        args,
        [
            ("setup", "index"),
            ("shortlist", "shortlist"),
            ("recall_at_k", "recall of exhaustive top-k"),
            ("min_recall", "worst query"),
            ("p50_ms", "two-stage p50 ms"),
            ("p99_ms", "two-stage p99 ms"),
            ("exhaustive_p50_ms", "exhaustive p50 ms"),
        ],
        res["rows"],
    )
    return 0
