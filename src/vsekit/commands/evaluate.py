"""`vse eval` (trained runs, ensembles) and `vse eval-sims` (any similarity matrix)."""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from vsekit.commands.jsonout import add_json_args, emit_json
from vsekit.errors import VseInputError
from vsekit.metrics import CS_PROTOCOLS, MetricsInputError, cap2img_for_k, evaluate_sims, format_table
from vsekit.utils.io import open_npy


def load_sims(paths: list[str]) -> np.ndarray:
    """Average of one or more [images, captions] .npy matrices (an ensemble = mean similarity), as float32.

    One float32 file is returned memory-mapped, not copied: the metrics read it once, in row blocks, from the
    page cache (a 5K x 25K matrix is 500 MB that need not be allocated and filled first).
    """
    total = None
    for p in paths:
        path = Path(p)
        if not path.is_file():
            raise FileNotFoundError(f"{path}: similarity file does not exist")
        arr = open_npy(path, MetricsInputError)
        if arr.ndim != 2:
            raise MetricsInputError(f"{path}: expected a 2-D (images x captions) matrix, got shape {arr.shape}")
        if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
            raise MetricsInputError(f"{path}: expected numbers, got dtype {arr.dtype}")
        if total is None and len(paths) == 1 and arr.dtype == np.float32:
            return arr
        if total is None:
            total = np.array(arr, dtype=np.float32)
        elif arr.shape != total.shape:
            raise MetricsInputError(f"{path}: shape {arr.shape} differs from {paths[0]}'s {total.shape}")
        else:
            total += arr
    assert total is not None
    if len(paths) > 1:
        total /= len(paths)
    return total


def read_cap2img(path: str, n_cap: int) -> np.ndarray:
    from vsekit.data.precomp import read_int_lines

    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{p}: caption->image file does not exist")
    c2i = read_int_lines(p)
    if len(c2i) != n_cap:
        raise MetricsInputError(f"{p}: {len(c2i)} lines but the similarity matrix has {n_cap} caption columns")
    return c2i


def write_report(metrics: dict, args: argparse.Namespace) -> None:
    """The metrics as a table (stdout; stderr under --json), and as JSON where --json / --json-out ask."""
    from vsekit.metrics.coherence import format_coherence

    print(format_table(metrics))
    if any(k.startswith(("i2t_cs", "t2i_cs")) for k in metrics):
        print(format_coherence(metrics) + ("  (mean of the 1K folds)" if "folds" in metrics else ""))
    if "folds" in metrics:
        for i, f in enumerate(metrics["folds"]):
            cs = format_coherence(f)
            print(f"  fold {i + 1}: {format_table(f)}" + (f" | {cs}" if cs else ""))
    emit_json(args, metrics, ensure_ascii=True)


def run_eval_sims(args: argparse.Namespace) -> int:
    sims = load_sims(args.sims)
    n_img, n_cap = sims.shape
    if args.cap2img:
        cap2img = read_cap2img(args.cap2img, n_cap)
    else:
        cap2img = cap2img_for_k(n_img, n_cap, args.captions_per_image)
    # the relevance path (not a loaded array) so that a missing or malformed file is a clear error naming it
    metrics = evaluate_sims(sims, cap2img, fold5=args.fold5, relevance=args.relevance, cs_k=args.cs_k,
                            cs_protocol=args.cs_protocol)  # fmt: skip
    write_report(metrics, args)
    return 0


def run_eval(args: argparse.Namespace) -> int:
    from vsekit.evaluation import evaluate_model
    from vsekit.training.checkpoint import load_run
    from vsekit.utils.runtime import resolve_device

    device = resolve_device(args.device)
    sims_sum, cap2img, per_run = None, None, []
    for run in args.runs:
        model, cfg = load_run(run, args.checkpoint, device)
        data = args.data or cfg.get("data_dir")
        if not data:
            raise VseInputError(f"{run}: no --data given and the run does not record its dataset")
        metrics, sims, cap2img = evaluate_model(model, data, args.split, fold5=args.fold5, device=device,
                                                batch_size=args.batch_size)  # fmt: skip
        per_run.append(metrics)
        if len(args.runs) > 1:
            print(f"{run}: {format_table(metrics)}")
        sims_sum = sims if sims_sum is None else sims_sum + sims
        if args.save_sims and len(args.runs) == 1:
            np.save(args.save_sims, sims)
    if len(args.runs) > 1:
        sims_sum /= len(args.runs)
        metrics = evaluate_sims(sims_sum, cap2img, fold5=args.fold5)
        metrics["ensemble_of"] = list(args.runs)
        if args.save_sims:
            np.save(args.save_sims, sims_sum)
        print("ensemble (mean similarity):")
    else:
        metrics = per_run[0]
    from vsekit.relevance import cached_relevance

    relevance = cached_relevance(data, args.split)  # prepared by `vse data relevance DIR --split SPLIT`
    if relevance is not None:
        from vsekit.metrics.retrieval import add_coherence

        add_coherence(metrics, sims_sum, cap2img, relevance, args.cs_k, args.cs_protocol, args.fold5)
    else:
        print(f"(no CS@K / mAP: run `vse data relevance {data} --split {args.split}` to prepare the relevance)")
    write_report(metrics, args)
    return 0


CS_PROTOCOL_HELP = ("paper: one caption per image (the first), as the paper's CS@100/CS@1000 on 1K images "
                    "(keys i2t_cs@K); all_captions: every caption ranked (keys i2t_cs_allcap@K). With --fold5 "
                    "both are means over the 1K folds")  # fmt: skip


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate trained run(s) on a split; several runs = ensemble")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--data", help="dataset directory (default: the one the run was trained on)")
    p.add_argument("--split", default="test")
    p.add_argument("--fold5", action="store_true", help="COCO 1K: mean over five 1K-image folds")
    p.add_argument("--checkpoint", default="best", choices=("best", "last"))
    add_json_args(p, "the metrics", path_form=True)
    p.add_argument("--save-sims", help="save the (ensemble) similarity matrix as .npy")
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--cs-k", type=int, nargs="+", default=[100, 1000],
                   help="K of CS@K, reported when the split's relevance is cached (vse data relevance)")
    p.add_argument("--cs-protocol", choices=CS_PROTOCOLS, default="paper", help=CS_PROTOCOL_HELP)
    p.set_defaults(func=run_eval)
    s = sub.add_parser("eval-sims", help="evaluate similarity matrices (rows = images, columns = captions)")
    s.add_argument("sims", nargs="+", metavar="SIMS.npy", help="several files are averaged (an ensemble)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--cap2img", help="text file: one 0-based image row per caption")
    g.add_argument("--captions-per-image", type=int, default=5)
    s.add_argument("--fold5", action="store_true")
    s.add_argument("--relevance", help="caption x caption relevance matrix (.npy) for CS@K and mAP")
    s.add_argument("--cs-k", type=int, nargs="+", default=[100, 1000])
    s.add_argument("--cs-protocol", choices=CS_PROTOCOLS, default="paper", help=CS_PROTOCOL_HELP)
    add_json_args(s, "the metrics", path_form=True)
    s.set_defaults(func=run_eval_sims)
