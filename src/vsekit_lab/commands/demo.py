"""`vse demo`: the embedded default (openclipart), end to end."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import POSITIVE


def run_demo(args: argparse.Namespace) -> int:
    from vsekit_lab.demo import run_demo as demo

    demo(
        data_dir=args.data,
        out_dir=args.out,
        seeds=args.seeds,
        epochs=args.epochs,
        device=args.device,
        variants=args.variants,
    )
    return 0


def register(sub) -> None:
    p = sub.add_parser("demo", help="build the openclipart set, train VSE++ and VSE∞, evaluate, report")
    p.add_argument(
        "--data", default="data/openclipart", help="where the openclipart set is (built if missing)"
    )
    p.add_argument("--out", default="runs/demo")
    p.add_argument(
        "--seeds",
        type=int,
        action=POSITIVE,
        default=1,
        help="repeat each recipe with this many seeds (mean ± std)",
    )
    p.add_argument(
        "--epochs", type=int, action=POSITIVE, default=None, help="override the demo's epoch count"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--variants", nargs="+", default=None, help="subset of the demo's recipes to run")
    p.set_defaults(func=run_demo)
