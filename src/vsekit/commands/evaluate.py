"""`vse eval` (trained runs, ensembles) and `vse eval-sims` (any similarity matrix)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import numpy as np

from vsekit.commands.argtypes import at_least
from vsekit.commands.jsonout import add_json_args, check_json_out, command_inputs, emit_json
from vsekit.data.sims import load_sims, read_cap2img
from vsekit.errors import VseInputError
from vsekit.metrics import CS_PROTOCOLS, MetricsInputError, cap2img_for_k, evaluate_sims, format_table
from vsekit.metrics.retrieval import NonFiniteScoresError
from vsekit.utils.io import atomic_save_npy, check_output_file, open_npy


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
    if any(k.startswith("eccv_") for k in metrics):
        from vsekit.metrics.eccv import format_eccv

        print(format_eccv(metrics))
    emit_json(args, metrics, ensure_ascii=True)


def eccv_preflight(sims_shape: tuple[int, ...], source: str, cap2img: np.ndarray | None = None) -> None:
    """Before any other work: the eccv-caption package is there (its ids load), the matrix is 5K x 25K and
    captions are 5 per image in image order, as the package's ids require; else a one-line error naming
    `source`."""
    from vsekit.metrics.eccv import CAPTIONS_PER_IMAGE, N_CAPTIONS, check_shape, ground_truth

    ground_truth()  # MissingPackageError: pip install 'vsekit[eccv]'
    check_shape(sims_shape, source)
    if cap2img is not None and not np.array_equal(cap2img, np.arange(N_CAPTIONS) // CAPTIONS_PER_IMAGE):
        bad = int(np.flatnonzero(cap2img != np.arange(N_CAPTIONS) // CAPTIONS_PER_IMAGE)[0])
        raise MetricsInputError(
            f"{source}: caption {bad} belongs to image {int(cap2img[bad])}; --eccv needs image i "
            f"to own captions 5i..5i+4 (eccv_caption's coco_test_ids.npy order)"
        )


def check_eccv_split(data: str, split: str, captions_per_image: int = 5) -> None:
    """`vse eval --eccv`, before the model runs: the split is COCO 5K test in the package's order, i.e. 5,000
    images x 25,000 captions, image i owning captions 5i..5i+4, and, where the dataset has `{split}_ids.txt`,
    the same COCO image ids in the same order as eccv_caption's coco_test_ids.npy."""
    from vsekit.data.precomp import load_precomp_split
    from vsekit.metrics.eccv import N_CAPTIONS, N_IMAGES, standard_image_ids

    where = f"{data} split {split!r}"
    sp = load_precomp_split(data, split, captions_per_image)
    if (sp.n_images, sp.n_captions) != (N_IMAGES, N_CAPTIONS):
        raise VseInputError(
            f"--eccv: {where} has {sp.n_images:,} images x {sp.n_captions:,} captions, not COCO 5K "
            f"test's {N_IMAGES:,} x {N_CAPTIONS:,} (coco_precomp: --split testall)"
        )
    eccv_preflight((sp.n_images, sp.n_captions), where, sp.cap2img)
    ids_file = Path(data) / f"{split}_ids.txt"
    if not ids_file.is_file():
        return  # nothing to compare: the order is taken on trust, as for `vse eval-sims`
    expected = [str(i) for i in standard_image_ids().tolist()]
    got = [s.strip() for s in sp.image_ids]
    if got != expected:
        row = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        how = "the same images in another order" if sorted(got) == sorted(expected) else "not the same images"
        raise VseInputError(
            f"--eccv: {ids_file}: image row {row} has id {got[row]!r} where eccv_caption's COCO 5K "
            f"test order has {expected[row]!r} ({how}); ECCV Caption / CxC need that order"
        )


def sims_source(paths: list[str]) -> str:
    return paths[0] if len(paths) == 1 else f"the mean of {', '.join(paths)}"


def non_finite_source(paths: list[str], e: NonFiniteScoresError) -> NonFiniteScoresError:
    """The NaN/inf error naming the file(s) whose score at that entry is not finite (of an ensemble: those of
    the averaged files; none of them when only their mean overflowed)."""
    if len(paths) > 1:
        culprits = [
            p for p in paths if not np.isfinite(open_npy(Path(p), MetricsInputError)[e.image, e.caption])
        ]
        where = ", ".join(culprits) if culprits else f"{sims_source(paths)} (their sum overflows)"
    else:
        where = paths[0]
    return NonFiniteScoresError(f"{where}: {e}", e.image, e.caption)


def run_eval_sims(args: argparse.Namespace) -> int:
    sims = load_sims(args.sims)
    n_img, n_cap = sims.shape
    if args.eccv:  # the package and the shape first: a wrong matrix is named as such, before any other check
        eccv_preflight(sims.shape, sims_source(args.sims))
    if args.cap2img:
        cap2img = read_cap2img(args.cap2img, n_cap)
    else:
        cap2img = cap2img_for_k(n_img, n_cap, args.captions_per_image)
    if args.eccv:
        eccv_preflight(sims.shape, sims_source(args.sims), cap2img)
    # the relevance path (not a loaded array) so that a missing or malformed file is a clear error naming it
    try:
        metrics = evaluate_sims(
            sims,
            cap2img,
            fold5=args.fold5,
            relevance=args.relevance,
            cs_k=args.cs_k,
            cs_protocol=args.cs_protocol,
        )
    except NonFiniteScoresError as e:
        raise non_finite_source(args.sims, e) from None
    if args.eccv:
        from vsekit.metrics.eccv import eccv_metrics

        metrics.update(eccv_metrics(sims, sims_source(args.sims)))
    write_report(metrics, args)
    return 0


def eval_preflight(args: argparse.Namespace) -> str:
    """Before any model is built or any split encoded: each run's recipe reads, the runs are scored on one
    dataset (`--data`, else the one every run records), the split reads the same for each (images, captions,
    caption->image map) and fits each run's input (feature width); `--eccv` checks the split. Returns the
    dataset directory."""
    from vsekit.data.precomp import load_precomp_split
    from vsekit.models.image_parts import reads_pixels
    from vsekit.runs import read_run_config

    runs = []
    for run in args.runs:
        recipe, spec, cfg = read_run_config(run)
        data = args.data or cfg.get("data_dir")
        if not data:
            raise VseInputError(f"{run}: no --data given and the run does not record its dataset")
        runs.append((run, str(data), recipe, spec))
    run0, data0 = runs[0][0], runs[0][1]
    for run, data, _, _ in runs[1:]:
        if Path(data).resolve() != Path(data0).resolve():
            raise VseInputError(
                f"{run} was trained on {data} and {run0} on {data0}: an ensemble scores every run "
                f"on one split; choose its dataset with --data DIR"
            )
    layout = None
    for run, data, recipe, spec in runs:
        split = load_precomp_split(data, args.split, recipe.data.captions_per_image)
        if not reads_pixels(recipe.model.image.kind):
            split.require_width(spec.img_dim, f"the run in {run}")
        elif split.image_paths is None:
            raise VseInputError(
                f"{Path(data) / f'{args.split}_images.txt'}: missing; {run} encodes pictures "
                f"(model.image.kind={recipe.model.image.kind}) and this split lists none"
            )
        if layout is None:
            layout = (run, recipe.data.captions_per_image, split.n_images, split.cap2img)
        elif split.n_images != layout[2] or not np.array_equal(split.cap2img, layout[3]):
            raise VseInputError(
                f"{data} split {args.split!r}: {run} reads it as {split.n_images:,} images x "
                f"{split.n_captions:,} captions ({recipe.data.captions_per_image} per image) and "
                f"{layout[0]} as {layout[2]:,} x {len(layout[3]):,} ({layout[1]} per image); an "
                f"ensemble needs one caption->image map: add {args.split}_cap2img.txt"
            )
        if args.eccv:  # checked before the encoding, which takes minutes
            check_eccv_split(data, args.split, recipe.data.captions_per_image)
    if getattr(args, "fold5", False) and layout is not None:  # COCO 1K sizes, before the encoding too
        from vsekit.metrics.retrieval import check_fold5_protocol

        check_fold5_protocol(layout[2], layout[3], f"{data0} split {args.split!r}")
    note = coco_split_note(data0, args.split, layout[2] if layout else 0)
    if note:
        logging.getLogger(__name__).warning(note)
    return data0


def coco_split_note(data: str | Path, split: str, n_images: int) -> str | None:
    """SCAN's COCO layout has `test` (the first 1K fold of the 5K test images) beside `testall` (all 5K): a
    score on `test` alone matches no paper's table (SCAN #14, vsepp #26). Say so, naming what papers report."""
    if split != "test" or not (Path(data) / "testall_caps.txt").is_file():
        return None
    return (
        f"{data}: split 'test' ({n_images:,} images) is only the first 1K fold of COCO's 5K test images, and "
        f"its scores match no paper's table: papers report COCO 1K as the mean over the five 1K folds "
        f"(--split testall --fold5) and COCO 5K on all of them (--split testall)"
    )


def check_result_files(args: argparse.Namespace, data: str) -> None:
    """`--json-out` and `--save-sims` can be written (their folders exist) and overwrite none of the inputs: the
    runs, the dataset they are scored on; two different files. One-line errors before any encoding."""
    check_json_out(args, data)
    if args.save_sims:
        check_output_file(args.save_sims, "--save-sims", command_inputs(args, data))
        if args.json_out and Path(args.json_out).resolve() == Path(args.save_sims).resolve():
            raise VseInputError(
                f"--save-sims {args.save_sims} and --json-out {args.json_out}: the same file; name two"
            )


def run_eval(args: argparse.Namespace) -> int:
    from vsekit.evaluation import evaluate_model
    from vsekit.models.pair import ModelPair
    from vsekit.runs import load_run
    from vsekit.utils.runtime import resolve_device

    if args.probe:  # a compositional probe instead of recall (vsekit.commands.probes, docs/probes.md)
        from vsekit.commands.probes import run_probe

        return run_probe(args, eval_preflight, check_result_files)
    device = resolve_device(args.device)
    data = eval_preflight(args)
    check_result_files(args, data)  # before the encoding, which takes minutes: nothing to lose at the end
    sims_sum, cap2img, per_run = None, None, []
    for run in args.runs:
        model, _ = load_run(run, args.checkpoint, device, getattr(args, "member", None))
        if isinstance(model, ModelPair):
            print(f"{run}: two networks, scored as the mean of their similarities (--member A|B: one alone)")
        metrics, sims, cap2img = evaluate_model(
            model, data, args.split, fold5=args.fold5, device=device, batch_size=args.batch_size
        )
        per_run.append(metrics)
        if len(args.runs) > 1:
            print(f"{run}: {format_table(metrics)}")
        sims_sum = sims if sims_sum is None else sims_sum + sims
    if len(args.runs) > 1:
        sims_sum /= len(args.runs)
        metrics = evaluate_sims(sims_sum, cap2img, fold5=args.fold5)
        metrics["ensemble_of"] = list(args.runs)
        print("ensemble (mean similarity):")
    else:
        metrics = per_run[0]
    if args.save_sims:
        atomic_save_npy(
            args.save_sims, sims_sum
        )  # exactly the named file, in .npy format whatever its suffix
        print(
            f"wrote {args.save_sims} ({sims_sum.shape[0]:,} images x {sims_sum.shape[1]:,} captions, .npy format)"
        )
    from vsekit.relevance import cached_relevance

    relevance = cached_relevance(data, args.split)  # prepared by `vse data relevance DIR --split SPLIT`
    if relevance is not None:
        from vsekit.metrics.retrieval import add_coherence

        add_coherence(metrics, sims_sum, cap2img, relevance, args.cs_k, args.cs_protocol, args.fold5)
    else:
        print(
            f"(no CS@K / mAP: run `vse data relevance {data} --split {args.split}` to prepare the relevance)"
        )
    if args.eccv:
        from vsekit.metrics.eccv import eccv_metrics

        metrics.update(eccv_metrics(sims_sum, f"{data} split {args.split!r}"))
    write_report(metrics, args)
    return 0


CS_PROTOCOL_HELP = (
    "paper: one caption per image (the first), as the paper's CS@100/CS@1000 on 1K images "
    "(keys i2t_cs@K); all_captions: every caption ranked (keys i2t_cs_allcap@K). With --fold5 "
    "both are means over the 1K folds"
)
ECCV_HELP = (
    "COCO 5K test only: add COCO 1K/5K, CxC and ECCV Caption keys (mAP@R, R-Precision, R@1) computed "
    "with the eccv-caption package, pip install 'vsekit[eccv]'; docs/evaluation.md"
)


def register(sub) -> None:
    p = sub.add_parser("eval", help="evaluate trained run(s) on a split; several runs = ensemble")
    p.add_argument("runs", nargs="+", metavar="RUN_DIR")
    p.add_argument("--data", help="dataset directory (default: the one the run was trained on)")
    p.add_argument("--split", default="test")
    p.add_argument("--fold5", action="store_true", help="COCO 1K: mean over five 1K-image folds")
    p.add_argument("--checkpoint", default="best", choices=("best", "last"))
    p.add_argument(
        "--member",
        choices=("A", "B"),
        help="a two-network run (NCR): score network A or B alone (default: the pair, the mean of both "
        "networks' similarities)",
    )
    add_json_args(p, "the metrics", path_form=True)
    p.add_argument(
        "--save-sims",
        metavar="FILE",
        help="save the (ensemble) similarity matrix to FILE, exactly that name, in .npy format "
        "(its folder must exist; not inside a run or the dataset)",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--batch-size", type=int, action=at_least(1), default=256)
    p.add_argument(
        "--cs-k",
        type=int,
        action=at_least(1),
        nargs="+",
        default=[100, 1000],
        help="K of CS@K, reported when the split's relevance is cached (vse data relevance)",
    )
    p.add_argument("--cs-protocol", choices=CS_PROTOCOLS, default="paper", help=CS_PROTOCOL_HELP)
    p.add_argument("--eccv", action="store_true", help=ECCV_HELP + " (--split testall)")
    from vsekit.commands.probes import add_probe_args

    add_probe_args(p)
    p.set_defaults(func=run_eval)
    s = sub.add_parser("eval-sims", help="evaluate similarity matrices (rows = images, columns = captions)")
    s.add_argument("sims", nargs="+", metavar="SIMS.npy", help="several files are averaged (an ensemble)")
    g = s.add_mutually_exclusive_group()
    g.add_argument("--cap2img", help="text file: one 0-based image row per caption")
    g.add_argument("--captions-per-image", type=int, action=at_least(1), default=5)
    s.add_argument("--fold5", action="store_true")
    s.add_argument("--relevance", help="caption x caption relevance matrix (.npy) for CS@K and mAP")
    s.add_argument("--cs-k", type=int, action=at_least(1), nargs="+", default=[100, 1000])
    s.add_argument("--cs-protocol", choices=CS_PROTOCOLS, default="paper", help=CS_PROTOCOL_HELP)
    s.add_argument(
        "--eccv",
        action="store_true",
        help=ECCV_HELP + " (SIMS: 5,000 x 25,000, image i owns captions 5i..5i+4)",
    )
    add_json_args(s, "the metrics", path_form=True)
    s.set_defaults(func=run_eval_sims)
