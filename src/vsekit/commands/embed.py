"""`vse embed RUN INPUT --out DIR`: embeddings of pictures / captions in clip-retrieval's folder layout
(resumable chunks; data-parallel under `torchrun --nproc_per_node N vse embed …`, gloo on CPU)."""

from __future__ import annotations

import argparse
import sys

from vsekit.commands.argtypes import POSITIVE, in_range


def run_embed(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from vsekit.commands.search import refuse_set_runs
    from vsekit.distributed import barrier, init_from_env, rank_device
    from vsekit.search.embed import embed_to_folder
    from vsekit.utils.runtime import resolve_device

    if (Path(args.run) / "config.json").is_file():  # a late-interaction run: one line (else the usual checks)
        refuse_set_runs(args.run)
    device = resolve_device(args.device)
    ctx = init_from_env(device.type)
    device = rank_device(device, ctx)
    try:
        meta = embed_to_folder(
            args.run,
            args.input,
            args.out,
            checkpoint=args.checkpoint,
            device=device,
            batch_size=args.batch_size,
            chunk_size=args.chunk_size,
            workers=args.workers,
            pixels=args.pixels,
            strict=args.strict,
            progress=not args.no_progress,
            rank=ctx.rank,
            world_size=ctx.world_size,
            barrier=lambda: barrier(ctx),
        )
    except KeyboardInterrupt:
        raise KeyboardInterrupt(_interrupt_hint(args)) from None
    finally:
        if ctx.enabled and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    if meta is not None:
        skipped = f", {len(meta['skipped'])} unreadable skipped" if meta["skipped"] else ""
        what = "pictures" if meta["with_image"] else "captions"
        print(
            f"embeddings {args.out}: {meta['written_rows']} {what} in {meta['chunks']} chunk(s)"
            f"{', with caption embeddings' if meta['with_image'] and meta['with_text'] else ''}"
            f"{skipped}",
            file=sys.stdout,
        )
    return 0


def embed_command(args: argparse.Namespace) -> str:
    """The `vse embed` command line that repeats this one: the same plan (--chunk-size) resumes the folder."""
    import shlex

    parts = ["vse", "embed", str(args.run), str(args.input), "--out", str(args.out)]
    for flag, attr, default in (
        ("--chunk-size", "chunk_size", 10_000),
        ("--batch-size", "batch_size", 64),
        ("--workers", "workers", 0),
        ("--checkpoint", "checkpoint", "best"),
        ("--device", "device", "auto"),
    ):
        if getattr(args, attr, default) != default:
            parts += [flag, str(getattr(args, attr))]
    for flag, attr in (("--pixels", "pixels"), ("--strict", "strict"), ("--no-progress", "no_progress")):
        parts += [flag] if getattr(args, attr, False) else []
    return shlex.join(parts)


def _interrupt_hint(args: argparse.Namespace) -> str:
    """What Ctrl-C during `vse embed` kept, and the command that resumes it."""
    from pathlib import Path

    done = len(list(Path(args.out).glob(".manifest/chunk_*.json"))) if Path(args.out).is_dir() else 0
    if done:
        return f"{done} finished chunk(s) are kept in {args.out}; resume with the same command: {embed_command(args)}"
    return f"no chunk was finished yet; start again with: {embed_command(args)}"


def register(sub) -> None:
    p = sub.add_parser(
        "embed",
        help="export a run's embeddings of pictures / captions (clip-retrieval layout; "
        "resumable; torchrun for several processes)",
    )
    p.add_argument("run", metavar="RUN_DIR")
    p.add_argument(
        "input",
        metavar="INPUT",
        help="a folder of pictures (x.txt beside x.png = its caption), DATASET_DIR:SPLIT (stored features "
        "when the run takes them), one picture, or a .txt file of captions (one per line)",
    )
    p.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="DIR/img_emb/img_emb_N.npy, DIR/text_emb/text_emb_N.npy, DIR/metadata/metadata_N.parquet",
    )
    p.add_argument(
        "--chunk-size",
        type=int,
        action=POSITIVE,
        default=10_000,
        help="rows per file (the resume and sharding unit)",
    )
    p.add_argument("--batch-size", type=int, action=POSITIVE, default=64)
    p.add_argument(
        "--workers",
        type=int,
        action=in_range(0, 1024),
        default=0,
        help="DataLoader workers decoding pictures",
    )
    p.add_argument("--checkpoint", default="best", choices=("best", "last"))
    p.add_argument(
        "--pixels", action="store_true", help="embed a split from its pictures even when it has features"
    )
    p.add_argument(
        "--strict", action="store_true", help="stop at the first unreadable picture instead of skipping it"
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_embed)
