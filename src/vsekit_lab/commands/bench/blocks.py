"""`vse bench` sub-verbs that measure one building block on random data: pool (each pooling), aeom (AVSE's
similarity) and view-reg (the view regulariser's gradient)."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import POSITIVE, at_least, finite, in_range
from vsekit.commands.jsonout import add_json_args
from vsekit_lab.commands.bench.rows import AddVerb, emit, write_json


def run_pool(args: argparse.Namespace) -> int:
    import torch

    from vsekit_lab.bench.pool import POOLINGS, bench_pool

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    rows = bench_pool(
        batch=args.batch,
        n=args.n,
        dim=args.dim,
        device=args.device,
        repeats=args.repeats,
        warmup=args.warmup,
        poolings=tuple(args.poolings or POOLINGS),
        variable_lengths=args.variable_lengths,
    )
    for r in rows:
        r["shape"] = f"{r['batch']}x{r['n']}x{r['dim']}" + (
            " (variable sizes)" if r["variable_lengths"] else ""
        )
    emit(
        args,
        [
            ("pooling", "pooling"),
            ("shape", "B x N x D"),
            ("params", "params"),
            ("ms_median", "fwd+bwd ms (median)"),
            ("ms_std", "std"),
            ("vs_avg", "x avg"),
        ],
        rows,
        args.device,
    )
    write_json(args, {"rows": rows})
    return 0


def run_aeom(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.aeom import bench_aeom, bench_aeom_eval

    if args.model_eval:
        row = bench_aeom_eval(args.images, max(1, args.captions // args.images), args.device, args.repeats)
        emit(
            args,
            [
                ("n_images", "images"),
                ("n_captions", "captions"),
                ("views", "views"),
                ("block_dim", "d2"),
                ("iters", "c"),
                ("cosine_eval_s", "vse_infty eval (s)"),
                ("aeom_eval_s", "avse eval (s)"),
                ("ratio_eval", "ratio"),
            ],
            [row],
            args.device,
        )
        return 0
    row = bench_aeom(
        args.images,
        args.captions,
        args.dim,
        args.device,
        args.repeats,
        views=args.views,
        block_dim=args.block_dim,
        iters=args.iters,
    )
    emit(
        args,
        [
            ("n_images", "images"),
            ("n_captions", "captions"),
            ("dim", "d1"),
            ("views", "views"),
            ("block_dim", "d2"),
            ("iters", "c"),
            ("cosine_s", "cosine (s)"),
            ("aeom_s", "AEOM (s)"),
            ("aeom_nosinkhorn_s", "AEOM no Sinkhorn (s)"),
            ("ratio", "ratio"),
            ("cosine_e2e_s", "cosine + metrics (s)"),
            ("aeom_e2e_s", "AEOM + metrics (s)"),
            ("ratio_end_to_end", "ratio + metrics"),
        ],
        [row],
        args.device,
    )
    return 0


def run_view_reg(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.view_reg import format_table, random_grad_ratios

    print(
        format_table(
            random_grad_ratios(args.dim, args.batch, args.views, args.block_dim, args.readout, args.weight)
        )
    )
    return 0


def add_pool(add: AddVerb) -> None:
    """`vse bench pool` and its options."""
    po = add("pool", "forward+backward time of each pooling", run_pool)
    po.add_argument("--batch", type=int, action=POSITIVE, default=128)
    po.add_argument("--n", type=int, action=POSITIVE, default=36, help="set size (regions / tokens)")
    po.add_argument("--dim", type=int, action=POSITIVE, default=1024)
    po.add_argument("--device", default="cpu", help="cpu | cuda | cuda:1 ...")
    po.add_argument("--repeats", type=int, action=POSITIVE, default=20)
    po.add_argument("--warmup", type=int, action=at_least(0), default=3, help="untimed runs first")
    po.add_argument(
        "--threads",
        type=int,
        action=in_range(0, note="0 = leave as is"),
        default=0,
        help="torch CPU threads (0 = leave as is)",
    )
    po.add_argument(
        "--poolings", nargs="+", help="a subset of avg max kmax gpo adpool adpool-ref (default: all)"
    )
    po.add_argument("--variable-lengths", action="store_true", help="set sizes drawn in [1, n] (text-like)")
    add_json_args(po, "the rows", path_form=True)


def add_aeom(add: AddVerb) -> None:
    """`vse bench aeom` and its options."""
    ae = add("aeom", "AVSE's asymmetric embedding optimal matching (vsekit_lab.bench.aeom)", run_aeom)
    ae.add_argument("--images", type=int, action=POSITIVE, default=1000)
    ae.add_argument("--captions", type=int, action=POSITIVE, default=5000)
    ae.add_argument(
        "--dim",
        type=int,
        action=POSITIVE,
        default=1024,
        help="caption embedding size d1 (images: views x d1)",
    )
    ae.add_argument("--views", type=int, action=POSITIVE, default=2)
    ae.add_argument("--block-dim", type=int, action=POSITIVE, default=512)
    ae.add_argument("--iters", type=int, action=POSITIVE, default=20)
    ae.add_argument("--device", default="cpu")
    ae.add_argument("--repeats", type=int, action=POSITIVE, default=3)
    ae.add_argument(
        "--model-eval",
        action="store_true",
        help="time `vse eval` end to end (encoders + scoring + metrics), avse vs vse_infty recipe",
    )


def add_view_reg(add: AddVerb) -> None:
    """`vse bench view-reg` and its options."""
    vr = add(
        "view-reg",
        "AVSE: gradient-norm ratio of the view regulariser vs the ranking loss (random embeddings)",
        run_view_reg,
    )
    vr.add_argument("--dim", type=int, action=POSITIVE, default=1024)
    vr.add_argument("--batch", type=int, action=POSITIVE, default=128)
    vr.add_argument("--views", type=int, action=POSITIVE, default=2)
    vr.add_argument("--block-dim", type=int, action=POSITIVE, default=512)
    vr.add_argument("--readout", default="log_plan", choices=["log_plan", "plan", "maxsum"])
    vr.add_argument("--weight", type=float, action=finite(), default=1.0)
