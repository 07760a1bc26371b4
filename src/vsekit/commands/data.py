"""`vse data karpathy | link-images | folder | table | webdataset | show | check | noise | audit | relevance |
relevance-share`,
and the sub-verbs other packages register in the entry-point group `vsekit.data_commands` (vsekit_lab's builders
of particular sets: `openclipart | convert-video | synthetic | moving-shapes | wesnoth`)."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import at_least, between, checked, finite, fraction
from vsekit.commands.jsonout import add_json_args
from vsekit.commands.own_data import register_own
from vsekit.commands.plugins import DATA_COMMANDS_GROUP, register_verbs


def run_karpathy(args: argparse.Namespace) -> int:
    from vsekit.data.raw_images import convert_karpathy

    counts = convert_karpathy(args.json, args.out, image_root=args.images, splits=tuple(args.splits))
    print(f"wrote {args.out}: {counts} (pictures only: train a backbone recipe, e.g. vse_infty_grid_e2e)")
    return 0


def run_show(args: argparse.Namespace) -> int:
    from vsekit.datasets.show import show_dataset

    show_dataset(args.data, args.out, split=args.split, n=args.n, seed=args.seed)
    print(f"wrote {args.out}")
    return 0


def run_check(args: argparse.Namespace) -> int:
    from vsekit.data.validate import check_dataset

    report = check_dataset(args.data, captions_per_image=args.captions_per_image)
    print(report.format())
    return 0 if report.ok else 1


def run_noise(args: argparse.Namespace) -> int:
    """A copy of a dataset whose train split carries mismatched pairs (vsekit.data.noise), ground truth recorded."""
    from vsekit.data.noise import describe_noise, write_noisy_dataset

    record = write_noisy_dataset(
        args.data,
        args.out,
        rate=args.rate,
        level=args.level,
        seed=args.seed,
        from_file=args.from_file,
        captions_per_image=args.captions_per_image,
    )
    print(f"wrote {args.out}: {describe_noise(record)}")
    return 0


def spreadsheet_safe(cell: str) -> str:
    """A text cell a spreadsheet shows as text: one starting with `=`, `+`, `-`, `@`, a tab or a carriage return
    would be read as a formula (OWASP's CSV injection), so it gets a leading `'`."""
    return "'" + cell if cell[:1] in ("=", "+", "-", "@", "\t", "\r") else cell


def run_audit(args: argparse.Namespace) -> int:
    """Every pair of a split scored by a run (vsekit.evaluation.audit): a ranked CSV, the AUC / AP where the
    dataset records its noise, a montage of the least likely pairs. Every check runs before the encoding."""
    import csv
    import io
    import logging

    from vsekit.evaluation.audit import audit_split, prepare, scores_of
    from vsekit.runs import load_run
    from vsekit.utils.io import atomic_write_text, check_output_file
    from vsekit.utils.runtime import resolve_device

    inputs = [args.run, args.data]
    check_output_file(args.out, "--out", inputs)
    for option, path in (("--json-out", args.json_out), ("--png", args.png)):
        if path:
            check_output_file(path, option, inputs)
    device = resolve_device(args.device)
    model, _ = load_run(args.run, args.checkpoint, device)
    # the run fits the split: checked before any encoding
    prepared = prepare(model, args.run, args.data, args.split, args.checkpoint)
    split = prepared[0]
    png = args.png
    if png and split.image_paths is None:
        print(f"no montage: {args.data} split {args.split!r} has no {args.split}_images.txt (no pictures)")
        png = None
    elif png:
        from vsekit.datasets.show import picture_format

        picture_format(png)
    quiet = args.no_progress or getattr(args, "vse_log_level", None) == logging.WARNING
    audit = audit_split(
        model,
        args.run,
        args.data,
        args.split,
        None,  # the run's own seed
        args.batch_size,
        device,
        progress=not quiet,
        prepared=prepared,
        checkpoint=args.checkpoint,
    )
    ranked = audit.ranked()

    def picture(c: int) -> str:
        i = int(audit.cap2img[c])
        if split.image_paths is not None:
            return split.image_paths[i]
        return split.image_ids[i] if split.image_ids else str(i)

    if png:
        from vsekit.datasets.show import show_pairs

        show = [
            (int(audit.cap2img[c]), split.captions[c], f"pair {c}  p={audit.prob[c]:.3g}")
            for c in ranked[: args.n]
        ]
        show_pairs(split, show, png)
        print(f"wrote {png}")
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["pair", "picture", "caption", "probability"])
    for c in ranked:
        w.writerow(
            [
                int(c),
                spreadsheet_safe(picture(int(c))),
                spreadsheet_safe(split.captions[c]),
                repr(float(audit.prob[c])),
            ]
        )
    atomic_write_text(args.out, buf.getvalue())
    scores = scores_of(audit) | {"split": args.split, "run": str(args.run), "data": str(args.data)}
    found = f", AUC {scores['auc']:.4f}, AP {scores['average_precision']:.4f}" if "auc" in scores else ""
    print(f"wrote {args.out}: {scores['pairs']} pairs ranked, least likely first ({audit.source}{found})")
    from vsekit.commands.jsonout import emit_json

    emit_json(args, scores)
    return 0


def run_relevance(args: argparse.Namespace) -> int:
    from vsekit.relevance import cache_location, split_relevance

    for split in args.split:
        rel = split_relevance(args.data, split, cache_dir=args.cache_dir, device=args.device)
        print(f"{split}: relevance {rel.shape} in {cache_location(args.data, args.cache_dir)}")
    return 0


def run_relevance_share(args: argparse.Namespace) -> int:
    """Share of a split's different-image caption pairs at or above each θ, and the θ of a target share."""
    from vsekit.relevance import share_at_or_above, split_pair_relevance, threshold_for_share

    values = split_pair_relevance(
        args.data,
        args.split,
        args.captions_per_image,
        args.cache_dir,
        device=args.device,
        max_pairs=args.max_pairs,
    )
    how = (
        "every pair"
        if len(values) < args.max_pairs
        else f"a fixed-seed sample (--max-pairs {args.max_pairs:,})"
    )
    print(
        f"{args.split}: {len(values):,} caption pairs of different images ({how}), MiniLM relevance "
        f"mean {values.mean():.3f}"
    )
    out: dict = {"split": args.split, "pairs": len(values), "thresholds": {}, "shares": {}}
    print(f"  {'θ':>6}  {'share >= θ':>10}  {'per query, batch ' + str(args.batch):>22}")
    for theta, share in zip(args.theta, share_at_or_above(values, args.theta)):
        out["thresholds"][f"{theta:g}"] = float(share)
        print(f"  {theta:>6.3f}  {100 * share:>9.2f}%  {share * (args.batch - 1):>22.1f}")
    for share in args.share:
        theta = threshold_for_share(values, share)
        out["shares"][f"{share:g}"] = theta
        print(f"  share {100 * share:.1f}% -> θ = {theta:.4f}  (loss.ladder_threshold_share={share:g})")
    from vsekit.commands.jsonout import emit_json

    emit_json(args, out)
    return 0


def run_link_images(args: argparse.Namespace) -> int:
    from vsekit.data.link_images import link_images

    counts = link_images(args.data, args.images, args.splits, args.captions_per_image)
    for split, n in counts.items():
        print(f"{args.data}: {split}_images.txt lists {n:,} pictures under {args.images}")
    return 0


def register(sub) -> None:
    p = sub.add_parser("data", help="build, inspect and check datasets")
    dsub = p.add_subparsers(dest="data_command", required=True, metavar="ACTION")
    k = dsub.add_parser(
        "karpathy", help="convert a Karpathy JSON (dataset_coco.json / dataset_flickr30k.json)"
    )
    k.add_argument("json", help="dataset_flickr30k.json or dataset_coco.json")
    k.add_argument(
        "--images", help="folder the JSON's filepath/filename are relative to (default: the JSON's)"
    )
    k.add_argument("--out", required=True)
    k.add_argument("--splits", nargs="+", default=["train", "dev", "test"], help="dev = the JSON's 'val'")
    k.set_defaults(func=run_karpathy)
    li = dsub.add_parser(
        "link-images",
        help="write {split}_images.txt of a COCO / Flickr30K precomp folder from its "
        "{split}_ids.txt and a folder of the pictures (so vse serve shows them)",
    )
    li.add_argument("data", help="the precomp folder (with {split}_ids.txt)")
    li.add_argument("--images", required=True, help="folder holding the pictures (searched recursively)")
    li.add_argument("--splits", nargs="+", help="default: every split with a {split}_ids.txt")
    li.add_argument("--captions-per-image", type=int, action=at_least(1), default=5)
    li.set_defaults(func=run_link_images)
    register_own(dsub)  # folder | table | webdataset: vsekit.commands.own_data
    s = dsub.add_parser("show", help="a PNG montage of images with their captions")
    s.add_argument("data")
    s.add_argument("--out", default="montage.png")
    s.add_argument("--split", default="test")
    s.add_argument("--n", type=int, action=at_least(1), default=16)
    s.add_argument("--seed", type=int, action=at_least(0), default=0)
    s.set_defaults(func=run_show)
    c = dsub.add_parser("check", help="validate a dataset directory and report every problem")
    c.add_argument("data")
    c.add_argument("--captions-per-image", type=int, action=at_least(1), default=5)
    c.set_defaults(func=run_check)
    nz = dsub.add_parser(
        "noise",
        help="copy a dataset with mismatched train pairs (NCR/IN2R caption level or RCL image level), "
        "features linked, the ground truth recorded",
    )
    nz.add_argument("data", help="the clean dataset (SRC)")
    nz.add_argument("--out", required=True, help="a new folder for the noisy copy")
    nz.add_argument(
        "--rate",
        type=float,
        action=checked(lambda v: None if 0 <= v < 1 else "must lie in [0, 1)", "NoiseRate"),
        help="share of pairs to mismatch, in [0, 1)",
    )
    nz.add_argument("--level", help="caption (NCR/IN2R, default) or image (RCL)")
    nz.add_argument(
        "--seed", type=int, action=between(0, 2**32 - 1), default=0, help="numpy seed of the draw (default 0)"
    )
    nz.add_argument(
        "--from-file", help="apply a released noise index .npy instead (NCR's t2i or RCL's noise_inx)"
    )
    nz.add_argument("--captions-per-image", type=int, action=at_least(1), default=5)
    nz.set_defaults(func=run_noise)
    au = dsub.add_parser(
        "audit",
        help="score every pair of a split with a run (NCR's clean probability): a ranked CSV, AUC / AP where "
        "the dataset records its noise, a montage of the least likely pairs",
    )
    au.add_argument("run", help="a trained run folder")
    au.add_argument("--data", required=True, help="the dataset (a folder, table or shards built by vse data)")
    au.add_argument("--split", default="train")
    au.add_argument("--out", default="audit.csv", help="the ranked CSV (pair, picture, caption, probability)")
    add_json_args(au, "counts, and auc / average_precision where the dataset records its noise")
    au.add_argument(
        "--png", metavar="FILE", help="a montage of the least likely pairs (a split with pictures)"
    )
    au.add_argument("--n", type=int, action=at_least(1), default=16, help="pairs in the montage")
    au.add_argument("--checkpoint", default="best", choices=("best", "last"))
    au.add_argument("--batch-size", type=int, action=at_least(1), default=256, help="encoding batch size")
    au.add_argument("--device", default="auto")
    au.add_argument("--no-progress", action="store_true")
    au.set_defaults(func=run_audit)
    r = dsub.add_parser(
        "relevance", help="cache caption x caption relevance (MiniLM) for CS@K and the ladder loss"
    )
    r.add_argument("data")
    r.add_argument("--split", nargs="+", default=["test"])
    r.add_argument("--cache-dir", help="where to cache (default: the dataset directory when writable)")
    r.add_argument("--device", default="cpu")
    r.set_defaults(func=run_relevance)
    rs = dsub.add_parser(
        "relevance-share",
        help="share of caption pairs at or above a ladder threshold θ, and the "
        "θ of a given share (the rule of loss.ladder_threshold_share)",
    )
    rs.add_argument("data")
    rs.add_argument("--split", default="train")
    rs.add_argument("--theta", type=float, action=finite(), nargs="+", default=[0.2, 0.3, 0.4, 0.5])
    rs.add_argument("--share", type=float, action=fraction(), nargs="+", default=[0.15])
    rs.add_argument(
        "--batch", type=int, action=at_least(2), default=128, help="batch size for the per-query count"
    )
    rs.add_argument(
        "--captions-per-image",
        type=int,
        action=at_least(1),
        default=5,
        help="SCAN layout without a cap2img file",
    )
    rs.add_argument(
        "--max-pairs",
        type=int,
        action=at_least(1),
        default=20_000_000,
        help="above this many pairs, a sample of it",
    )
    rs.add_argument("--cache-dir", help="where the sentence embeddings are cached (as `vse data relevance`)")
    rs.add_argument("--device", default="cpu")
    add_json_args(rs, "the shares and thresholds", path_form=True)
    rs.set_defaults(func=run_relevance_share)
    register_verbs(DATA_COMMANDS_GROUP, dsub)  # openclipart, wesnoth, …: vsekit_lab.commands.data
