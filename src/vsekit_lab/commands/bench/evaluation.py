"""`vse bench` sub-verbs that time scoring and whole processes: eval and eval-sims (`vse eval-sims`), eccv
(`vse eval-sims --eccv`) and startup (the verbs that need no model)."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import POSITIVE
from vsekit.commands.jsonout import add_json_args
from vsekit_lab.commands.bench.rows import AddVerb, emit, write_json


def run_eval(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.eval import bench_eval

    row = bench_eval(
        args.images, args.captions_per_image, repeats=args.repeats, reference=not args.no_reference
    )
    row["shape"] = f"{row['images']:,} x {row['captions']:,}"
    emit(
        args,
        [
            ("shape", "images x captions"),
            ("eval_sims_s", "`vse eval-sims` (s, median, load included)"),
            ("in_memory_s", "evaluate_sims in memory (s)"),
            ("reference_s", "reference argsort loop (s)"),
            ("speedup", "speed-up"),
            ("max_abs_diff", "max metric difference"),
        ],
        [row],
    )
    return 0


def run_eval_sims_process(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.eval import bench_eval_sims_process

    row = bench_eval_sims_process(args.images, args.captions_per_image, repeats=args.repeats)
    row["shape"] = f"{row['images']:,} x {row['captions']:,}"
    emit(
        args,
        [
            ("shape", "images x captions"),
            ("eval_sims_s", "`vse eval-sims` process (s, median)"),
            ("minimal_s", "minimal numpy script process (s, median)"),
            ("ratio", "ratio"),
            ("max_abs_diff", "max metric difference"),
        ],
        [row],
    )
    return 0


def run_eccv(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.eccv import bench_eccv

    row = bench_eccv(repeats=args.repeats, reference=not args.no_reference, sims_path=args.sims)
    row["shape"] = f"{row['images']:,} x {row['captions']:,} ({row['matrix']})"
    row["k"] = f"{row['k_i2t']} / {row['k_t2i']}"
    emit(
        args,
        [
            ("shape", "images x captions"),
            ("k", "top-k i2t / t2i"),
            ("eccv_s", "`--eccv` adds (s, median, load included)"),
            ("lists_s", "lists (s)"),
            ("package_s", "eccv_caption metrics (s)"),
            ("reference_s", "full-sort reference (s)"),
            ("speedup", "speed-up"),
            ("max_abs_diff", "max metric difference"),
        ],
        [row],
    )
    return 0


def run_startup(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.startup import bench_startup

    rows = bench_startup(repeats=args.repeats)
    for r in rows:
        r["torch"] = "yes" if r["imports_torch"] else "no"
    emit(
        args,
        [
            ("verb", "process"),
            ("median_s", "wall s (median)"),
            ("min_s", "min"),
            ("over_python_s", "s over `python -c pass`"),
            ("torch", "imports torch"),
        ],
        rows,
    )
    write_json(args, {"rows": rows})
    return 0


def add_eval(add: AddVerb) -> None:
    """`vse bench eval` and its options."""
    e = add("eval", "`vse eval-sims` on an N x 5N random matrix vs the reference argsort loop", run_eval)
    e.add_argument("--images", type=int, action=POSITIVE, default=5000)
    e.add_argument("--captions-per-image", type=int, action=POSITIVE, default=5)
    e.add_argument("--repeats", type=int, action=POSITIVE, default=3)
    e.add_argument("--no-reference", action="store_true", help="skip the (slow) reference loop")


def add_eval_sims(add: AddVerb) -> None:
    """`vse bench eval-sims` and its options."""
    es = add(
        "eval-sims",
        "`vse eval-sims` vs a minimal vectorised numpy script, both timed as whole processes",
        run_eval_sims_process,
    )
    es.add_argument("--images", type=int, action=POSITIVE, default=5000)
    es.add_argument("--captions-per-image", type=int, action=POSITIVE, default=5)
    es.add_argument(
        "--repeats",
        type=int,
        action=POSITIVE,
        default=5,
        help="timed runs of each, alternated (median reported)",
    )


def add_eccv(add: AddVerb) -> None:
    """`vse bench eccv` and its options."""
    ec = add(
        "eccv",
        "`vse eval-sims --eccv` on COCO 5K test (5,000 x 25,000) vs full sorts fed to eccv-caption",
        run_eccv,
    )
    ec.add_argument("--repeats", type=int, action=POSITIVE, default=3)
    ec.add_argument("--no-reference", action="store_true", help="skip the (slow) full-sort reference")
    ec.add_argument(
        "--sims", metavar="S.npy", help="time your own 5,000 x 25,000 matrix instead of a planted one"
    )


def add_startup(add: AddVerb) -> None:
    """`vse bench startup` and its options."""
    st = add(
        "startup",
        "wall time of `vse --help`, `vse recipes`, `vse eval-sims --help` as processes",
        run_startup,
    )
    st.add_argument(
        "--repeats",
        type=int,
        action=POSITIVE,
        default=5,
        help="timed runs of each, alternated (median reported)",
    )
    add_json_args(st, "the rows")
