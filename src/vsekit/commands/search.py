"""`vse index` (embed pictures with a trained run), `vse search` (query an index), `vse serve` (HTTP + web page)."""

from __future__ import annotations

import argparse
import sys

from vsekit.commands.argtypes import PORT, POSITIVE, in_range
from vsekit.commands.jsonout import add_json_args, check_json_out, emit_json
from vsekit.errors import VseInputError


def refuse_set_runs(run: str) -> None:
    """An embeddings folder holds one vector per picture and per caption; a late-interaction run (CHAN: sets of
    region and word vectors) is indexed from its pictures or a split instead: one line."""
    from vsekit.runs import read_run_config
    from vsekit.similarity.parts import scores_sets

    recipe, _, _ = read_run_config(run)
    if scores_sets(recipe.model.similarity.name):
        raise VseInputError(
            f"{run}: scores by {recipe.model.similarity.name}, a late interaction of sets of region "
            "and word vectors, which an embeddings folder does not hold: index its pictures or a "
            "split with `vse index RUN_DIR SOURCE`"
        )


def run_index(args: argparse.Namespace) -> int:
    from vsekit.search.index import FaissParams, build_index, build_index_from_embeddings
    from vsekit.utils.runtime import resolve_device

    params = FaissParams(
        kind=args.index,
        nlist=args.nlist,
        nprobe=args.nprobe,
        hnsw_m=args.hnsw_m,
        ef_construction=args.ef_construction,
        ef_search=args.ef_search,
        pq_m=args.pq_m,
        refine=args.pq_refine,
    )
    if args.from_embeddings:
        if args.run is not None:
            refuse_set_runs(args.run)
        if args.refresh:
            raise VseInputError("--refresh re-reads a folder of pictures; it takes no --from-embeddings DIR")
        if args.source is not None:
            raise VseInputError(
                "--from-embeddings DIR takes no SOURCE (the folder is the source); RUN_DIR only for "
                "a folder without embed.json"
            )
        meta = build_index_from_embeddings(
            args.from_embeddings,
            args.out,
            params=params,
            run_dir=args.run,
            checkpoint=args.checkpoint,
            log=lambda msg: print(msg, file=sys.stderr),
            images_root=args.images_root,
        )
        c = meta["counts"]
        print(
            f"index {args.out}: {c['pictures']} pictures, {c['captions']} captions ({meta['faiss']['kind']})"
        )
        return 0
    if args.images_root is not None:
        raise VseInputError("--images-root goes with --from-embeddings DIR (a SOURCE names its own pictures)")
    if args.run is None or args.source is None:
        raise VseInputError("give RUN_DIR and SOURCE (or --from-embeddings DIR)")
    try:
        if args.refresh:
            from vsekit.search.refresh import refresh_index

            meta = refresh_index(
                args.run,
                args.source,
                args.out,
                checkpoint=args.checkpoint,
                params=params,
                device=resolve_device(args.device),
                batch_size=args.batch_size,
                chunk_size=args.chunk_size,
                strict=args.strict,
                captions_file=args.captions,
                progress=not args.no_progress,
                log=lambda msg: print(msg, file=sys.stderr),
                trust_links=args.trust_links,
            )
        else:
            meta = build_index(
                args.run,
                args.source,
                args.out,
                checkpoint=args.checkpoint,
                params=params,
                device=resolve_device(args.device),
                batch_size=args.batch_size,
                chunk_size=args.chunk_size,
                pixels=args.pixels,
                strict=args.strict,
                captions_file=args.captions,
                progress=not args.no_progress,
                log=lambda msg: print(msg, file=sys.stderr),
                trust_links=args.trust_links,
            )
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_index_interrupt_hint(args)) from None
    c = meta["counts"]
    print(f"index {args.out}: {c['pictures']} pictures, {c['captions']} captions ({meta['faiss']['kind']})")
    return 0


# (flag, attribute, default) of `vse index` options a resume must repeat; --out, RUN_DIR and SOURCE always
_INDEX_FLAGS = (
    ("--index", "index", "flat"),
    ("--nlist", "nlist", 0),
    ("--pq-m", "pq_m", 0),
    ("--pq-refine", "pq_refine", 10),
    ("--nprobe", "nprobe", 16),
    ("--hnsw-m", "hnsw_m", 32),
    ("--ef-construction", "ef_construction", 80),
    ("--ef-search", "ef_search", 64),
    ("--checkpoint", "checkpoint", "best"),
    ("--captions", "captions", None),
    ("--batch-size", "batch_size", 16),
    ("--chunk-size", "chunk_size", 256),
    ("--device", "device", "auto"),
)


def index_command(args: argparse.Namespace) -> str:
    """The `vse index` command line that repeats this one (what a Ctrl-C hint tells the user to run)."""
    import shlex

    parts = [
        "vse",
        "index",
        *([str(args.run)] if args.run else []),
        *([str(args.source)] if args.source else []),
        "--out",
        str(args.out),
    ]
    for flag, attr, default in _INDEX_FLAGS:
        value = getattr(args, attr, default)
        if value != default and value is not None:
            parts += [flag, str(value)]
    for flag, attr in (
        ("--pixels", "pixels"),
        ("--refresh", "refresh"),
        ("--strict", "strict"),
        ("--trust-links", "trust_links"),
        ("--no-progress", "no_progress"),
    ):
        parts += [flag] if getattr(args, attr, False) else []
    return shlex.join(parts)


def _index_interrupt_hint(args: argparse.Namespace) -> str:
    """What Ctrl-C during `vse index` kept, and the command that resumes (or restarts) it."""
    from pathlib import Path

    out = Path(args.out)
    chunks = len(list(out.glob(".work/*/chunk_*.npz"))) if out.is_dir() else 0
    index = "the index there is unchanged; " if (out / "index.json").is_file() else ""
    if chunks:
        return (
            f"{index}{chunks} finished chunk(s) of embeddings are kept in {out / '.work'}; resume with the same "
            f"command: {index_command(args)}"
        )
    return f"{index}nothing was embedded yet; start again with: {index_command(args)}"


def run_search(args: argparse.Namespace) -> int:
    from vsekit.search.engine import SearchEngine
    from vsekit.utils.runtime import resolve_device

    if args.k < 1:
        raise VseInputError(f"-k must be at least 1, got {args.k}")
    if args.query is None and args.image is None:
        raise VseInputError("give a text query, or --image PATH to find captions for a picture")
    if args.query is not None and args.image is not None:
        raise VseInputError("give either a text query or --image PATH, not both")
    if args.images and args.image is None:
        raise VseInputError(
            "--images finds the indexed pictures most like a picture: give the picture with --image PATH"
        )
    engine = SearchEngine.open(
        args.index, resolve_device(args.device), run_dir=args.run, shortlist=args.shortlist
    )
    check_json_out(args, engine.index.meta["model"].get("run_dir"))  # the index's own run is an input too
    engine.index.set_search_params(nprobe=args.nprobe, ef_search=args.ef_search)
    if args.image is not None and (why := engine.picture_query_problem()):
        raise VseInputError(f"--image: {args.index} cannot answer picture queries: {why}")
    if args.image is not None and args.images:
        hits = engine.search_image_to_images(args.image, args.k)
    elif args.image is not None:
        hits = engine.search_image(args.image, args.k)
    else:
        if not args.query.strip():
            raise VseInputError("the query is empty")
        hits = engine.search_text(args.query, args.k)
        unknown = engine.text.unknown_words(args.query)
        if unknown:
            print(f"note: the model does not know: {', '.join(unknown)}", file=sys.stderr)
    emit_json(args, [h.public() for h in hits])
    if args.json:
        return 0
    if not hits:
        print("no results")
    for rank, h in enumerate(hits, 1):
        where = h.file or h.path or "-"
        print(f"{rank:3d}  {h.score:8.4f}  {where}  {h.caption or ''}")
    return 0


def run_serve(args: argparse.Namespace) -> int:
    import ipaddress
    import logging

    import torch
    import uvicorn

    from vsekit.search.connections import uvicorn_config
    from vsekit.search.server import ServerLimits, create_app, json_log_handler
    from vsekit.utils.runtime import resolve_device

    try:
        loopback = ipaddress.ip_address(args.host).is_loopback
    except ValueError:
        loopback = args.host == "localhost"
    allowed = args.allowed_host or (["127.0.0.1", "localhost"] if loopback else ["*"])
    if not loopback:
        print(
            f"warning: serving on {args.host}, reachable from other machines; there is no authentication",
            file=sys.stderr,
        )
    if args.threads:
        torch.set_num_threads(
            args.threads
        )  # this process only serves; small queries run best single-threaded
    logger = logging.getLogger("vsekit.search.server")
    logger.setLevel(args.log_level.upper())
    if not logger.handlers:
        logger.addHandler(json_log_handler())
    limits = ServerLimits(
        max_k=args.max_k,
        max_query_chars=args.max_query_chars,
        max_body_bytes=args.max_body_mb << 20,
        rate_per_s=args.rate_limit,
        rate_burst=args.rate_burst,
        timeout_s=args.timeout,
    )
    sock = listen_socket(args.host, args.port)  # before the index is loaded: a taken port fails fast
    try:
        app = create_app(
            args.index,
            device=resolve_device(args.device),
            run_dir=args.run,
            limits=limits,
            cors_origins=args.cors_origin,
            allowed_hosts=allowed,
            logger=logger,
            shortlist=args.shortlist,
        )
        port = sock.getsockname()[1]  # the port bound: --port 0 gets a free one from the system
        where = f"[{args.host}]" if ":" in args.host else args.host
        print(f"serving {args.index} on http://{where}:{port}  (Ctrl-C stops)", file=sys.stderr, flush=True)
        config = uvicorn_config(
            app,
            args.host,
            port,
            max_connections=args.max_connections,
            log_level=args.log_level,
            head_timeout_s=limits.head_timeout_s,
            logger=logger,
            body_timeout_s=limits.body_timeout_s,
            body_min_rate=limits.body_min_rate,
        )
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        sock.close()
    return 0


def listen_socket(host: str, port: int):
    """A TCP socket bound to host:port (as uvicorn binds it), or a one-line error naming both: a port in use,
    one this user may not open, an address not on this machine, a host name that does not resolve."""
    import socket

    if not 0 <= port <= 65535:
        raise VseInputError(f"--port {port}: not a TCP port (0..65535; 0 = any free port)")
    sock = socket.socket(family=socket.AF_INET6 if ":" in host else socket.AF_INET)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except (OSError, OverflowError, UnicodeError) as e:
        sock.close()
        why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise VseInputError(f"--host {host} --port {port}: cannot listen there ({why})") from None
    sock.set_inheritable(True)
    return sock


def register(sub) -> None:
    p = sub.add_parser(
        "index", help="embed pictures with a trained run into a search index (resumable, incremental)"
    )
    p.add_argument("run", metavar="RUN_DIR", nargs="?")
    p.add_argument(
        "source",
        metavar="SOURCE",
        nargs="?",
        help="a folder of pictures (x.txt beside x.png = its caption), DATASET_DIR:SPLIT, or one picture",
    )
    p.add_argument(
        "--out", required=True, metavar="INDEX_DIR", help="new index, or an existing one to add pictures to"
    )
    p.add_argument(
        "--from-embeddings",
        metavar="DIR",
        help="build from a `vse embed` folder (img_emb/, text_emb/, metadata/) instead: no model forward",
    )
    p.add_argument(
        "--images-root",
        metavar="DIR",
        help="with --from-embeddings: the folder its pictures may be read from (the root its embed.json "
        "records must lie inside it; default: the embeddings folder itself)",
    )
    p.add_argument(
        "--index",
        default="flat",
        choices=("flat", "ivf", "ivfpq", "hnsw"),
        help="flat = exact (default); ivf / ivfpq / hnsw = approximate, faster on large sets (docs/search.md)",
    )
    p.add_argument(
        "--nlist",
        type=int,
        action=in_range(0, note="0 = automatic"),
        default=0,
        help="ivf/ivfpq: number of lists (0 = about 4*sqrt(n))",
    )
    p.add_argument(
        "--pq-m",
        type=int,
        action=in_range(0, note="0 = automatic"),
        default=0,
        help="ivfpq: bytes per code (0 = about dim/8, dividing dim)",
    )
    p.add_argument(
        "--pq-refine",
        type=int,
        action=in_range(0, note="0 = PQ scores only"),
        default=10,
        metavar="F",
        help="ivfpq: re-score the top F*k exactly with the stored embeddings (0 = PQ scores only)",
    )
    p.add_argument("--nprobe", type=int, action=POSITIVE, default=16, help="ivf: lists visited per query")
    p.add_argument("--hnsw-m", type=int, action=in_range(2, 4096), default=32, help="hnsw: graph degree")
    p.add_argument("--ef-construction", type=int, action=POSITIVE, default=80, help="hnsw: build beam")
    p.add_argument("--ef-search", type=int, action=POSITIVE, default=64, help="hnsw: query beam")
    p.add_argument("--checkpoint", default="best", choices=("best", "last"))
    p.add_argument(
        "--pixels",
        action="store_true",
        help="embed a dataset split from its pictures even when it has precomputed features",
    )
    p.add_argument(
        "--refresh",
        action="store_true",
        help="bring the index up to date with the folder SOURCE: re-embed pictures whose bytes changed "
        "(sha256), add new ones, drop deleted ones, keep the rest (docs/search.md)",
    )
    p.add_argument(
        "--captions", metavar="FILE", help="extra captions (one per line) for picture -> text search"
    )
    p.add_argument(
        "--strict", action="store_true", help="stop at the first unreadable picture instead of skipping it"
    )
    p.add_argument(
        "--trust-links",
        action="store_true",
        help="index files of the folder SOURCE that have several names (hard links); refused by default "
        "(docs/security.md)",
    )
    p.add_argument("--batch-size", type=int, action=POSITIVE, default=16)
    p.add_argument(
        "--chunk-size",
        type=int,
        action=POSITIVE,
        default=256,
        help="pictures per saved chunk (the resume granularity)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument(  # the verbs' one name for it; --quiet: its older name here (`vse -q` is the log level)
        "--no-progress",
        "--quiet",
        dest="no_progress",
        action="store_true",
        help="no progress bar (alias: --quiet)",
    )
    p.set_defaults(func=run_index)

    s = sub.add_parser(
        "search", help="query an index: text -> pictures, --image -> captions, --image --images -> pictures"
    )
    s.add_argument("index", metavar="INDEX_DIR")
    s.add_argument("query", nargs="?", help="text to find pictures for")
    s.add_argument("--image", metavar="PATH", help="find indexed captions that describe this picture")
    s.add_argument(
        "--images",
        action="store_true",
        help="with --image: find the indexed pictures most like it instead (cosine of the picture vectors)",
    )
    s.add_argument("-k", type=int, action=POSITIVE, default=10, help="number of results")
    add_json_args(s, 'the results (a list of {"path", "score", "caption"}, best first)')
    s.add_argument("--nprobe", type=int, action=POSITIVE, help="ivf: override the lists visited per query")
    s.add_argument("--ef-search", type=int, action=POSITIVE, help="hnsw: override the query beam")
    s.add_argument(
        "--run", metavar="RUN_DIR", help="the run, if it moved since indexing (weights are checked)"
    )
    add_shortlist_arg(s)
    s.add_argument("--device", default="auto")
    s.set_defaults(func=run_search)

    v = sub.add_parser("serve", help="HTTP API and web page over an index (127.0.0.1 by default)")
    v.add_argument("index", metavar="INDEX_DIR")
    v.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    v.add_argument(
        "--port",
        type=int,
        action=PORT,
        default=8000,
        help="TCP port (0 = any free port; the one bound is printed)",
    )
    v.add_argument("--max-k", type=int, action=POSITIVE, default=100, help="largest k a request may ask for")
    v.add_argument("--max-query-chars", type=int, action=POSITIVE, default=256)
    v.add_argument(
        "--max-body-mb",
        type=int,
        action=in_range(1, 1 << 20),
        default=8,
        help="largest request body (picture uploads)",
    )
    v.add_argument(
        "--max-connections",
        type=int,
        action=POSITIVE,
        default=64,
        help="open connections; when all are taken, a new one closes the one idle longest "
        "(503 only when all are busy)",
    )
    v.add_argument(
        "--rate-limit",
        type=float,
        action=in_range(0, None, "0 = no limit", finite=True),
        default=100.0,
        help="requests per second per client address, then 429 (0 = no limit)",
    )
    v.add_argument(
        "--rate-burst", type=int, action=POSITIVE, default=200, help="requests a client may send at once"
    )
    v.add_argument(
        "--timeout",
        type=float,
        action=in_range(0, None, "0 = none", finite=True),
        default=30.0,
        help="seconds before a request is answered 504 (0 = none)",
    )
    v.add_argument(
        "--cors-origin",
        action="append",
        default=[],
        metavar="ORIGIN",
        help="allow cross-origin requests from ORIGIN (repeatable; CORS is off by default)",
    )
    v.add_argument(
        "--allowed-host",
        action="append",
        metavar="HOST",
        help="Host headers to accept (default: 127.0.0.1 and localhost on loopback)",
    )
    v.add_argument(
        "--threads",
        type=int,
        action=in_range(0, 4096, "0 = torch's default"),
        default=1,
        help="torch threads per query (default 1: concurrent requests already use the cores; 0 = torch's default)",
    )
    add_shortlist_arg(v)
    v.add_argument("--run", metavar="RUN_DIR", help="the run, if it moved since indexing")
    v.add_argument("--device", default="auto")
    v.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))
    v.set_defaults(func=run_serve)


def add_shortlist_arg(p: argparse.ArgumentParser) -> None:
    """`--shortlist N` of `vse search` and `vse serve`."""
    p.add_argument(
        "--shortlist",
        type=int,
        action=POSITIVE,
        default=None,
        metavar="N",
        help="runs whose similarity is not an inner product (AVSE, CHAN): the N pictures the first stage "
        "ranks by one vector each that the model's own similarity re-scores (default max(10*k, 100), "
        "for CHAN's sets max(50*k, 500); more = closer to exhaustive scoring, slower)",
    )
