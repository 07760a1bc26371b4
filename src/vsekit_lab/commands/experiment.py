"""`vse experiment …`: dataset-free experiments from the papers (`gpo-synthetic`: VSE∞ supplement Table 11)."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import POSITIVE, in_range, positive_number
from vsekit.errors import VseInputError


def run_gpo_synthetic(args: argparse.Namespace) -> int:
    import torch

    from vsekit_lab.experiments.gpo_synthetic import (
        DESIGNS,
        PATTERNS,
        format_table,
        ranking_summary,
        true_weights,
    )
    from vsekit_lab.experiments.gpo_synthetic import run_gpo_synthetic as run

    designs = tuple(args.designs or DESIGNS)
    patterns = tuple(args.patterns or PATTERNS)
    bad = [d for d in designs if d not in DESIGNS]
    if bad:
        raise VseInputError(f"unknown design(s) {bad}; choose from {', '.join(DESIGNS)}")
    for p in patterns:
        true_weights(p, 10)  # a clear error for an unknown pattern before any training
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(
        designs,
        patterns,
        steps=args.steps,
        sets_per_size=args.sets_per_size,
        dim=args.dim,
        lr=args.lr,
        seeds=tuple(range(args.seeds)),
        device=args.device,
        jobs=args.jobs,
        log=None if args.no_progress else print,
    )
    table = format_table(result)
    summary = ranking_summary(result)
    print(f"settings: {result['settings']}")
    print(table)
    print(f"\nbest overall (mean RMSE over patterns and size groups): {summary['best_overall']}")
    if "interp_worst_on_kmax" in summary:
        print(f"Index+Interp. worst on K-Max: {summary['interp_worst_on_kmax']}")
    print(
        "unseen smaller sizes harder than larger: "
        + ", ".join(f"{d} {v}" for d, v in summary["smaller_harder_than_larger"].items())
    )
    from vsekit.commands.jsonout import emit_json

    emit_json(args, {**result, "summary": summary}, ensure_ascii=True)
    return 0


def register(sub) -> None:
    p = sub.add_parser("experiment", help="dataset-free experiments from the papers")
    es = p.add_subparsers(dest="experiment", required=True, metavar="EXPERIMENT")
    g = es.add_parser(
        "gpo-synthetic", help="GPO coefficient-generator designs on synthetic poolings (RMSE table)"
    )
    g.add_argument(
        "--steps", type=int, action=POSITIVE, default=300, help="training steps per (design, pattern, seed)"
    )
    g.add_argument(
        "--sets-per-size",
        type=int,
        action=POSITIVE,
        default=1,
        help="random sets of each training size per step",
    )
    g.add_argument(
        "--dim", type=int, action=POSITIVE, default=16, help="feature dimensions of each random set"
    )
    g.add_argument("--lr", type=float, action=positive_number(), default=3e-3)
    g.add_argument("--seeds", type=int, action=POSITIVE, default=1, help="average over seeds 0..S-1")
    g.add_argument("--device", default="cpu")
    g.add_argument(
        "--threads",
        type=int,
        action=in_range(0, note="0 = leave as is"),
        default=1,
        help="torch CPU threads (tiny recurrent nets: 1 is fastest)",
    )
    g.add_argument(
        "--jobs", type=int, action=POSITIVE, default=1, help="run the independent trainings in N processes"
    )
    g.add_argument("--designs", nargs="+", metavar="DESIGN", help="subset of the four designs")
    g.add_argument("--patterns", nargs="+", metavar="PATTERN", help="e.g. A M-1 M-10 T-50%% L")
    from vsekit.commands.jsonout import add_json_args

    add_json_args(g, "the results", path_form=True)
    g.add_argument(  # the verbs' one name for it; --quiet: its older name here
        "--no-progress", "--quiet", dest="no_progress", action="store_true", help="no per-run progress lines"
    )
    g.set_defaults(func=run_gpo_synthetic)
