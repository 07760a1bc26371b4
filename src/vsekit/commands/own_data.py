"""`vse data folder | table | webdataset`: users' own pictures and captions as a training set (registered by
`vsekit.commands.data`; the builder is `vsekit.datasets.own_pairs`, the readers `vsekit.datasets.own_sources`
and `vsekit.datasets.own_shards`)."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import at_least, between, finite
from vsekit.errors import VseInputError

MAX_IMAGE_SIZE = (
    1024  # pixels a side: a grid of 32 x 32 regions a picture for EfficientNet-Lite0 (7 x 7 at 224)
)


def _own_options(args: argparse.Namespace):
    """BuildOptions of `vse data folder | table | webdataset` (the shared flags of _add_own_args)."""
    import logging

    from vsekit.datasets.own_features import FeatureOptions
    from vsekit.datasets.own_pairs import BuildOptions

    declared = getattr(args, "split_by_folder", False) or getattr(args, "split_col", None) is not None
    if declared and (args.dev is not None or args.test is not None):
        raise VseInputError(
            "--dev / --test split by fractions; the input already declares its splits "
            "(--split-col / --split-by-folder): give one or the other"
        )
    features = FeatureOptions(
        backbone=args.backbone,
        weights=args.backbone_weights,
        device=args.device,
        image_size=args.image_size,
        batch_size=args.batch_size,
    )
    quiet = args.no_progress or getattr(args, "vse_log_level", None) == logging.WARNING
    return BuildOptions(
        dev=0.1 if args.dev is None else args.dev,
        test=0.1 if args.test is None else args.test,
        seed=args.seed,
        pixels=args.pixels,
        copy_images=args.copy_images,
        strict=args.strict,
        overwrite=args.overwrite,
        workers=args.workers,
        progress=not quiet,
        features=features,
    )


def _build_own(args: argparse.Namespace, collected, input_root=None) -> int:
    from vsekit.datasets.own_pairs import build_own_dataset, summary_line

    try:
        manifest = build_own_dataset(collected, args.out, _own_options(args), input_root=input_root)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(
            f"the checks and feature parts done so far are kept in {args.out}/.cache; run the "
            "same command again to resume"
        ) from None
    print(summary_line(manifest, args.out))
    return 0


def run_own_folder(args: argparse.Namespace) -> int:
    from vsekit.datasets.own_sources import read_folder

    _own_options(args)  # option conflicts before the folder is walked
    collected = read_folder(
        args.folder, split_by_folder=args.split_by_folder, exclude=[args.out], trust_links=args.trust_links
    )
    return _build_own(args, collected, input_root=args.folder)


def run_own_table(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vsekit.datasets.own_sources import read_table

    _own_options(args)
    collected = read_table(
        args.table,
        image_col=args.image_col,
        caption_col=args.caption_col,
        split_col=args.split_col,
        images_root=args.images_root,
        fmt=args.format,
        trust_links=args.trust_links,
    )
    return _build_own(args, collected, input_root=args.images_root or Path(args.table).parent)


def run_own_webdataset(args: argparse.Namespace) -> int:
    from vsekit.datasets.own_shards import read_webdataset

    _own_options(args)
    return _build_own(args, read_webdataset(args.shards))


def _add_own_args(p: argparse.ArgumentParser) -> None:
    """Flags shared by `vse data folder | table | webdataset` (one builder: vsekit.datasets.own_pairs)."""
    p.add_argument("--out", required=True, help="dataset folder to write (a stopped build there is resumed)")
    p.add_argument(
        "--dev", type=float, action=finite(), help="dev pictures: a fraction below 1 or a count (default 0.1)"
    )
    p.add_argument(
        "--test",
        type=float,
        action=finite(),
        help="test pictures: a fraction below 1 or a count (default 0.1)",
    )
    p.add_argument("--seed", type=int, action=at_least(0), default=0, help="seed of the split")
    p.add_argument("--pixels", action="store_true", help="keep pictures only, no features (backbone recipes)")
    p.add_argument(
        "--copy-images",
        action="store_true",
        help="copy the pictures into OUT/images (always done for shards)",
    )
    p.add_argument(
        "--backbone",
        default="efficientnet_lite0",
        help="feature extractor: efficientnet_lite0 (default), "
        "torchvision:<arch>, timm:<name> or python:<module>:<function> (with --backbone-weights)",
    )
    p.add_argument("--backbone-weights", help="local weights file of --backbone (nothing is downloaded)")
    p.add_argument(
        "--image-size",
        type=int,
        action=between(32, MAX_IMAGE_SIZE),
        default=224,
        help=f"input size of the extractor (32 to {MAX_IMAGE_SIZE} pixels)",
    )
    p.add_argument(
        "--batch-size", type=int, action=at_least(1), default=8, help="pictures per extractor batch"
    )
    p.add_argument("--device", default="auto", help="where the extractor runs (auto: cuda when present)")
    p.add_argument(
        "--workers", type=int, action=at_least(1), default=2, help="threads reading and decoding pictures"
    )
    p.add_argument(
        "--strict", action="store_true", help="stop on any problem (naming them all) and write nothing"
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace another dataset's files in a non-empty --out"
    )
    p.add_argument("--no-progress", action="store_true")


TRUST_LINKS_HELP = (
    "read files that have several names (hard links); refused by default, since a hard link in a folder "
    "from elsewhere can be a second name of any file of yours (docs/security.md)"
)


def register_own(dsub) -> None:
    """Add `folder`, `table` and `webdataset` to the `vse data` subparsers."""
    of = dsub.add_parser(
        "folder",
        help="your own pictures: x.jpg + x.txt (one caption per line) under a folder -> a "
        "training set (docs/data.md)",
    )
    of.add_argument("folder", help="folder of pictures with their caption files (nested folders allowed)")
    of.add_argument(
        "--split-by-folder",
        action="store_true",
        help="top-level train/, dev/ (or val/), test/ folders give the split instead of --dev / --test",
    )
    of.add_argument("--trust-links", action="store_true", help=TRUST_LINKS_HELP)
    _add_own_args(of)
    of.set_defaults(func=run_own_folder)
    ot = dsub.add_parser(
        "table",
        help="your own pictures from a CSV / TSV / parquet table of picture paths and "
        "captions -> a training set",
    )
    ot.add_argument("table", help="a .csv, .tsv or .parquet file (several rows per picture allowed)")
    ot.add_argument(
        "--image-col", help="column of picture paths (default: image, filepath, path, file, url, ...)"
    )
    ot.add_argument("--caption-col", help="column of captions (default: caption, text, title, ...)")
    ot.add_argument("--split-col", help="column giving each row's split (train / dev or val / test)")
    ot.add_argument("--images-root", help="folder relative picture paths start from (default: the table's)")
    ot.add_argument("--format", choices=["auto", "csv", "tsv", "parquet"], default="auto")
    ot.add_argument("--trust-links", action="store_true", help=TRUST_LINKS_HELP)
    _add_own_args(ot)
    ot.set_defaults(func=run_own_table)
    ow = dsub.add_parser(
        "webdataset",
        help="your own pictures from webdataset tar shards (img2dataset layout) -> a training set",
    )
    ow.add_argument("shards", nargs="+", help="shard paths or patterns: 'shards-{000..009}.tar', globs")
    _add_own_args(ow)
    ow.set_defaults(func=run_own_webdataset)
