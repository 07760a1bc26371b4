"""`vse bench` sub-verbs that time or measure training: train-step, amp (bf16 numerics), grad-cache (peak
memory), data (the data path alone), ladder (the ladder loss's cost) and epoch (one epoch of `vse train`, end
to end)."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import POSITIVE, at_least, in_range
from vsekit.commands.jsonout import add_json_args
from vsekit_lab.commands.bench.rows import AddVerb, emit, write_json


def run_train_step(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.train_step import bench_train_step_variants

    sets = list(args.set)
    if args.amp:
        sets.append(f"train.amp={args.amp}")
    if args.tf32:
        sets.append("train.tf32=true")
    if args.compile:
        sets.append("train.compile=true")
    if args.data_on_device is not None:
        sets.append(f"train.data_on_device={args.data_on_device}")
    if args.length_bucketing:
        sets.append("train.length_bucketing=true")
    if args.cuda_graph:
        sets.append("train.cuda_graph=true")
    # variants timed in one run (before / after): each --variant, then each --caption-buckets value
    variants = [[s for s in v.split(",") if s] for v in args.variant]
    variants += [[f"train.caption_buckets={n}"] for n in args.caption_buckets or []]
    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    rows = bench_train_step_variants(
        args.recipe,
        batch=args.batch,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        overrides=sets,
        variants=variants or [[]],
        rounds=args.rounds,
        text=args.text,
        text_model=args.text_model,
        regions=args.regions,
        img_dim=args.img_dim,
        embed_dim=args.embed_dim,
        vocab=args.vocab,
        n_images=args.n,
    )
    for row in rows:
        row["peak"] = f"{row['peak_gib']:.2f} GiB ({row['peak_kind']})"
        row["precision"] = (
            f"{row['amp']}{', tf32' if row['tf32'] else ''}{', compiled' if row['compile'] else ''}"
            f"{', CUDA graph' if row['cuda_graph'] else ''}"
        )
        row["data_share_pct"] = 100 * row["data_share"]
        row["captions"] = (
            f"{row['caption_buckets']} bucket(s) {row['caption_widths']}"
            f"{', length-bucketed' if row['length_bucketing'] else ''}: mean {row['mean_caption_width']:.1f}"
        )
    columns = [
        ("recipe", "recipe"),
        ("text", "text"),
        ("shapes", "shapes"),
        ("device_name", "device"),
        ("precision", "precision"),
        ("batch", "batch"),
        ("data_path", "data path"),
        ("captions", "caption widths (mean)"),
        ("ms_median", "ms/step (median)"),
        ("samples_per_s", "samples/s"),
        ("data_share_pct", "data path % of step"),
        ("peak", "peak memory"),
    ]
    if len(rows) > 1:
        columns[1:1] = [("variant", "variant")]
        columns.append(("speedup", "speed-up vs first row"))
    emit(args, columns, rows, args.device)
    write_json(args, rows[0] if len(rows) == 1 else {"rows": rows})
    return 0


def run_amp(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.amp import bf16_numerics

    if args.threads > 0:
        import torch

        torch.set_num_threads(args.threads)
    rows = []
    for warmup in (False, True):
        rows += bf16_numerics(
            args.recipe,
            batch=args.batch,
            regions=args.regions,
            img_dim=args.img_dim,
            embed_dim=args.embed_dim,
            vocab=args.vocab,
            seeds=range(args.seeds),
            device=args.device,
            overrides=args.set,
            warmup=warmup,
        )
    emit(
        args,
        [
            ("recipe", "recipe"),
            ("loss_kind", "loss"),
            ("shapes", "shapes"),
            ("batch", "batch"),
            ("seeds", "seeds"),
            ("loss_rel", "loss rel. error"),
            ("image_emb_rel", "image emb."),
            ("text_emb_rel", "caption emb."),
            ("grads_rel", "gradients (all)"),
            ("grad_median_rel", "gradients (median tensor)"),
            ("grad_worst_rel", "worst tensor"),
            ("grad_worst_tensor", "which"),
            ("left_out", "left out (zero in exact arithmetic)"),
        ],
        rows,
        args.device,
    )
    for row in rows[: len(args.recipe)]:
        print(
            f"{row['recipe']}: bf16 outputs: {', '.join(row['bf16_modules'])}; float32 outputs: "
            f"{', '.join(row['fp32_modules']) or '-'}"
        )
    write_json(args, {"rows": rows})
    return 0


def run_grad_cache(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.grad_cache import bench_grad_cache

    rows = bench_grad_cache(
        args.recipe,
        batch=args.batch,
        chunks=args.chunks,
        device=args.device,
        overrides=args.set,
        regions=args.regions,
        img_dim=args.img_dim,
        embed_dim=args.embed_dim,
        vocab=args.vocab,
        threads=args.threads,
    )
    for r in rows:
        r["step"] = f"{r['step_gib']:.2f} GiB" + (
            "" if r["step_peak_observed"] else " (below the setup's peak)"
        )
    emit(
        args,
        [
            ("recipe", "recipe"),
            ("shapes", "shapes"),
            ("batch", "batch"),
            ("setting", "setting"),
            ("step", "step peak above before"),
            ("step_ratio", "ratio"),
            ("peak_gib", "process/device peak GiB"),
            ("measure", "measured by"),
            ("seconds", "s/step"),
            ("encoder_calls", "encoder calls"),
            ("loss", "loss"),
            ("loss_diff", "loss diff to whole batch"),
        ],
        rows,
        args.device,
    )
    write_json(args, {"rows": rows})
    return 0


def run_data(args: argparse.Namespace) -> int:
    import torch

    from vsekit_lab.bench.data_path import bench_data

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    res = bench_data(
        n=args.n,
        regions=args.regions,
        img_dim=args.img_dim,
        batch=args.batch,
        device=args.device,
        steps=args.steps,
        warmup=args.warmup,
        rounds=args.rounds,
        recipe=args.recipe,
        overrides=args.set,
        paths=args.paths,
        data_dir=args.data,
    )
    rows = []
    for r in res["rows"]:
        rows.append(
            {
                **r,
                "shapes": f"{res['n']:,} x {res['regions']}x{res['img_dim']} float16",
                "batch": res["batch"],
                "threads": res["threads"],
                "what": f"{r['path']} (data_on_device={r['setting']})",
            }
        )
    emit(
        args,
        [
            ("what", "data path"),
            ("shapes", "images x set"),
            ("batch", "batch"),
            ("samples_per_s", "samples/s"),
            ("bare_gather_samples_per_s", "bare `features[idx].float()` samples/s"),
            ("ratio", "ratio"),
            ("bare_index_select_samples_per_s", "bare `index_select` samples/s"),
            ("ratio_index_select", "ratio to it"),
        ],
        rows,
        args.device,
    )
    for r in res["rows"]:
        print(f"{r['path']}: {r['reason']}")
    write_json(args, res)
    return 0


def run_epoch(args: argparse.Namespace) -> int:
    import sys

    from vsekit_lab.bench.epoch import EpochRunError, bench_epoch

    try:
        res = bench_epoch(
            n=args.n,
            recipe=args.recipe,
            device=args.device,
            overrides=args.set,
            regions=args.regions,
            img_dim=args.img_dim,
            dev_images=args.dev_images,
            batch=args.batch,
            data_dir=args.data,
            timeout=args.timeout or None,
            # the run's log lines while it trains, for a person watching
            echo=(lambda line: print(f"  | {line}", file=sys.stderr, flush=True))
            if sys.stderr.isatty()
            else None,
        )
    except EpochRunError as e:
        print(f"vse bench epoch: {e}", file=sys.stderr)
        return 1
    row = {
        **res,
        "what": " ".join([res["recipe"], *res["overrides"]]),
        "set": f"{res['images']:,} x {res['regions']}x{res['img_dim']} float16, {res['captions']:,} captions",
    }
    emit(
        args,
        [
            ("what", "recipe and keys"),
            ("set", "train split"),
            ("batch", "batch"),
            ("data_path", "data path"),
            ("write_s", "writing the set, s"),
            ("wall_s", "`vse train` wall, s"),
            ("train_s", "epoch's training, s"),
            ("outside_epoch_s", "start-up + validation + checkpoint, s"),
            ("samples_per_s", "samples/s (training)"),
            ("wall_samples_per_s", "samples/s (wall)"),
            ("peak_memory_gib", "peak memory, GiB"),
        ],
        [row],
        args.device,
    )
    write_json(args, res)
    return 0


def run_co_teaching(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.co_teaching import bench_co_teaching
    from vsekit_lab.demo import DEMO_OVERRIDES

    overrides = (DEMO_OVERRIDES if args.demo_settings else []) + args.set
    res = bench_co_teaching(args.data, args.epochs, args.device, overrides, pair_recipe=args.recipe)
    emit(
        args,
        [
            ("data", "dataset"),
            ("pair_recipe", "two-network recipe"),
            ("one_network_epoch_s", "one network (VSE∞), s/epoch"),
            ("two_network_epoch_s", "two networks, s/epoch"),
            ("two_over_one", "two / one"),
            ("split_pass_s", "split pass (both networks), s"),
            ("split_over_phase", "split pass per network / its phase"),
            ("split_per_network_over_one_epoch", "split pass per network / one-network epoch"),
        ],
        [res],
        args.device,
    )
    write_json(args, res)
    return 0


def run_ladder(args: argparse.Namespace) -> int:
    from vsekit_lab.bench.ladder import bench_ladder_step

    row = bench_ladder_step(
        batch=args.batch,
        device=args.device,
        repeats=args.repeats,
        embed_dim=args.embed_dim,
        regions=args.regions,
        img_dim=args.img_dim,
        vocab=args.vocab,
    )
    emit(
        args,
        [
            ("batch", "batch"),
            ("vsepp_step_ms", "VSE++ step ms"),
            ("ladder_step_ms", "ladder step ms"),
            ("ladder_auto_step_ms", "adaptive ladder step ms"),
            ("ratio_fixed", "ladder / VSE++"),
            ("ratio_auto", "adaptive / VSE++"),
        ],
        [row],
        args.device,
    )
    return 0


def add_train_step(add: AddVerb) -> None:
    """`vse bench train-step` and its options."""
    t = add("train-step", "one training step (forward+backward+AdamW) on synthetic data", run_train_step)
    t.add_argument("--recipe", default="vse_infty")
    t.add_argument("--batch", type=int, action=POSITIVE, default=128)
    t.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    t.add_argument("--steps", type=int, action=POSITIVE, default=10, help="timed steps (median reported)")
    t.add_argument("--warmup", type=int, action=at_least(0), default=3, help="untimed steps first")
    t.add_argument("--text", choices=("bigru", "transformer"), default="bigru")
    t.add_argument(
        "--text-model",
        default="bert-base",
        help="transformer text: a local HF directory, or bert-base / tiny (random weights)",
    )
    t.add_argument("--regions", type=int, action=POSITIVE, default=36)
    t.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    t.add_argument("--embed-dim", type=int, action=POSITIVE, default=1024)
    t.add_argument("--vocab", type=int, action=POSITIVE, default=10_000)
    t.add_argument("--amp", choices=("none", "bf16"), help="override train.amp")
    t.add_argument("--tf32", action="store_true", help="TF32 matmuls (CUDA)")
    t.add_argument("--compile", action="store_true", help="torch.compile the encoders")
    t.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    t.add_argument(
        "--data-on-device",
        choices=("auto", "true", "false"),
        help="override train.data_on_device: where the batches are made (vse bench data)",
    )
    t.add_argument(
        "--n",
        type=int,
        action=POSITIVE,
        default=None,
        metavar="N",
        help="images of the synthetic set the batches are drawn from (default: enough for every step)",
    )
    t.add_argument(
        "--threads",
        type=int,
        action=in_range(0, note="0 = leave as is"),
        default=0,
        help="torch CPU threads (0 = leave as is)",
    )
    t.add_argument(
        "--length-bucketing",
        action="store_true",
        help="train.length_bucketing=true (similar lengths per batch)",
    )
    t.add_argument(
        "--cuda-graph", action="store_true", help="train.cuda_graph=true: the step as CUDA graphs (CUDA only)"
    )
    t.add_argument(
        "--caption-buckets",
        type=int,
        action=POSITIVE,
        nargs="+",
        metavar="N",
        help="time one variant per value of train.caption_buckets, in one run (e.g. 1 4: before / after)",
    )
    t.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="a variant timed in the same run (repeat it; rows keep the order, --caption-buckets last)",
    )
    t.add_argument(
        "--rounds",
        type=int,
        action=POSITIVE,
        default=1,
        help="rounds of --steps steps per variant, alternated",
    )
    add_json_args(t, "the row (several variants: {'rows': [...]})")


def add_amp(add: AddVerb) -> None:
    """`vse bench amp` and its options."""
    am = add("amp", "bf16 autocast vs float32: relative error of one step's loss and gradients", run_amp)
    am.add_argument("--recipe", nargs="+", default=["vsepp", "vse_infty"])
    am.add_argument("--batch", type=int, action=POSITIVE, default=64)
    am.add_argument("--regions", type=int, action=POSITIVE, default=36)
    am.add_argument("--img-dim", type=int, action=POSITIVE, default=512)
    am.add_argument("--embed-dim", type=int, action=POSITIVE, default=256)
    am.add_argument("--vocab", type=int, action=POSITIVE, default=2000)
    am.add_argument(
        "--seeds",
        type=int,
        action=POSITIVE,
        default=3,
        help="seeds 0..N-1 (weights and batch); the worst is reported",
    )
    am.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    am.add_argument(
        "--threads",
        type=int,
        action=in_range(0, note="0 = leave as is"),
        default=0,
        help="torch CPU threads (0 = leave as is)",
    )
    am.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(am, "the rows")


def add_grad_cache(add: AddVerb) -> None:
    """`vse bench grad-cache` and its options."""
    gc = add(
        "grad-cache",
        "peak memory of one training step, whole batch vs gradient caching (train.grad_cache_chunk)",
        run_grad_cache,
    )
    gc.add_argument("--recipe", default="vse_infty")
    gc.add_argument("--batch", type=int, action=POSITIVE, default=1024)
    gc.add_argument(
        "--chunks",
        type=int,
        action=POSITIVE,
        nargs="+",
        default=[128],
        help="chunk sizes to compare with the whole batch",
    )
    gc.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    gc.add_argument("--regions", type=int, action=POSITIVE, default=36)
    gc.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    gc.add_argument("--embed-dim", type=int, action=POSITIVE, default=1024)
    gc.add_argument("--vocab", type=int, action=POSITIVE, default=10_000)
    gc.add_argument(
        "--threads",
        type=int,
        action=in_range(0, note="0 = default"),
        default=0,
        help="torch CPU threads in each measuring process (0 = default)",
    )
    gc.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(gc, "the rows")


def add_data(add: AddVerb) -> None:
    """`vse bench data` and its options."""
    da = add("data", "the training data path alone (batches ready on the device) vs a bare gather", run_data)
    da.add_argument(
        "--n",
        type=int,
        action=POSITIVE,
        default=20_000,
        help="images of the synthetic COCO-shaped set (5 captions each)",
    )
    da.add_argument("--regions", type=int, action=POSITIVE, default=36)
    da.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    da.add_argument("--batch", type=int, action=POSITIVE, default=128)
    da.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    da.add_argument("--steps", type=int, action=POSITIVE, default=20, help="timed batches per round")
    da.add_argument(
        "--rounds",
        type=int,
        action=POSITIVE,
        default=5,
        help="rounds; each times every path, then the bare gathers",
    )
    da.add_argument("--warmup", type=int, action=at_least(0), default=3, help="untimed batches first")
    da.add_argument("--recipe", default="vse_infty")
    da.add_argument(
        "--paths",
        nargs="+",
        choices=("auto", "true", "false"),
        default=["auto"],
        help="train.data_on_device values to time, one row each (false: the DataLoader)",
    )
    da.add_argument(
        "--data", metavar="DIR", help="time a precomp dataset's train split instead of a synthetic one"
    )
    da.add_argument(
        "--threads",
        type=int,
        action=in_range(0, note="0 = leave as is"),
        default=0,
        help="torch CPU threads (0 = leave as is)",
    )
    da.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(da, "the result")


def add_epoch(add: AddVerb) -> None:
    """`vse bench epoch` and its options."""
    ep = add("epoch", "one epoch of `vse train` end to end on a synthetic COCO-sized set", run_epoch)
    ep.add_argument(
        "--n",
        type=int,
        action=at_least(2),
        default=113_287,
        help="train images of the synthetic set, 5 captions each (default: COCO's 113,287)",
    )
    ep.add_argument(
        "--dev-images", type=int, action=at_least(2), default=1_000, help="dev images (validation)"
    )
    ep.add_argument("--regions", type=int, action=POSITIVE, default=36)
    ep.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    ep.add_argument("--batch", type=int, action=at_least(2), default=128)
    ep.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    ep.add_argument("--recipe", default="vse_infty")
    ep.add_argument("--data", metavar="DIR", help="train on this precomp set (train and dev splits) instead")
    ep.add_argument(
        "--timeout",
        type=float,
        action=at_least(0),
        default=0,
        help="give up on `vse train` after this many seconds (0 = no limit)",
    )
    ep.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(ep, "the result")


def add_co_teaching(add: AddVerb) -> None:
    """`vse bench co-teaching` and its options."""
    co = add("co-teaching", "NCR's two networks against one: epoch time and the split pass", run_co_teaching)
    co.add_argument(
        "--data", required=True, metavar="DIR", help="a precomp dataset (e.g. a `vse data noise` copy)"
    )
    co.add_argument("--epochs", type=int, action=at_least(2), default=2, help="epochs of each run (>= 2)")
    co.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1 …")
    co.add_argument(
        "--recipe",
        default="ncr",
        choices=("ncr", "in2r"),
        help="the two-network recipe timed against VSE∞ (default ncr)",
    )
    co.add_argument(
        "--demo-settings",
        action="store_true",
        help="the demo's overrides (512-d, grid features, batch 128, …)",
    )
    co.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="any recipe key")
    add_json_args(co, "the result")


def add_ladder(add: AddVerb) -> None:
    """`vse bench ladder` and its options."""
    la = add("ladder", "training step with the (adaptive) ladder loss vs VSE++", run_ladder)
    la.add_argument("--batch", type=int, action=POSITIVE, default=128)
    la.add_argument("--device", default="cpu")
    la.add_argument("--repeats", type=int, action=POSITIVE, default=10)
    la.add_argument("--embed-dim", type=int, action=POSITIVE, default=1024)
    la.add_argument("--regions", type=int, action=POSITIVE, default=36)
    la.add_argument("--img-dim", type=int, action=POSITIVE, default=2048)
    la.add_argument("--vocab", type=int, action=POSITIVE, default=10_000)
