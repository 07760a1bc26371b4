"""The lab's `vse data` sub-verbs: `openclipart | convert-video | synthetic | moving-shapes | wesnoth`, each a
builder of a particular set (`vsekit_lab.datasets`). Registered through the entry-point group
`vsekit.data_commands`; the library's own sub-verbs (own data, karpathy, check, show, relevance) are in
`vsekit.commands.data`."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import at_least
from vsekit.errors import VseInputError


def run_openclipart(args: argparse.Namespace) -> int:
    from vsekit_lab.datasets.openclipart import build_openclipart

    manifest = build_openclipart(
        args.out, svg_root=args.svg_root, seed=args.seed, limit=args.limit, workers=args.workers
    )
    sizes = manifest.get("splits", manifest.get("split_sizes", {}))
    print(f"openclipart set ready in {args.out}: {sizes}")
    return 0


def run_convert_video(args: argparse.Namespace) -> int:
    from vsekit_lab.datasets.video_convert import convert_video

    summary = convert_video(
        args.features,
        args.captions,
        args.out,
        fmt=args.format,
        split_files=args.split_file,
        splits=args.splits,
        dtype=args.dtype,
        lmdb_dim=args.lmdb_dim,
        overwrite=args.overwrite,
    )
    for name, s in summary.items():
        lo, mid, hi = s["frames_per_clip"]
        print(
            f"{name}: {s['clips']} clips, {s['captions']} captions, {s['frames']} x {s['dim']} frames "
            f"(per clip min {lo} / median {mid:g} / max {hi})"
        )
    print(f"wrote {args.out} (check it with: vse data check {args.out})")
    return 0


def run_synthetic(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vsekit.data.manifest import MANIFEST
    from vsekit.utils.io import prepare_dataset_dir
    from vsekit_lab.datasets.synthetic import SPLIT_FILES, SPLITS, make_synthetic_precomp

    if args.n_train < 1:  # checked before an --overwrite clears anything
        raise VseInputError(f"--n-train must be at least 1 (training images to generate), got {args.n_train}")
    prepare_dataset_dir(Path(args.out), args.overwrite, SPLITS, SPLIT_FILES, (MANIFEST,))
    make_synthetic_precomp(
        args.out, n_train=args.n_train, seed=args.seed, variable_captions=args.variable_captions
    )
    print(f"wrote a synthetic precomp dataset to {args.out}")
    return 0


def run_moving_shapes(args: argparse.Namespace) -> int:
    from vsekit_lab.datasets.moving_shapes import SPLITS, build_moving_shapes

    if len(args.clips) not in (1, 3):
        raise VseInputError(
            f"--clips takes TRAIN or TRAIN DEV TEST clip counts, got {len(args.clips)} values"
        )
    counts = (
        args.clips
        if len(args.clips) == 3
        else [args.clips[0], max(1, args.clips[0] // 4), max(1, args.clips[0] // 4)]
    )
    clips = {s: n for s, n in zip(SPLITS, counts) if s in args.splits}
    manifest = build_moving_shapes(
        args.out,
        clips=clips,
        frames=tuple(args.frames),
        captions=tuple(args.captions),
        features=args.features,
        seed=args.seed,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        device=args.device,
    )
    print(f"moving-shapes set ready in {args.out}: {manifest['splits']}")
    return 0


def run_wesnoth(args: argparse.Namespace) -> int:
    from vsekit_lab.datasets.wesnoth import build_wesnoth

    manifest = build_wesnoth(
        args.out,
        source=args.source,
        campaigns=args.campaigns,
        descriptions=args.descriptions,
        all_takes=args.all_takes,
        overwrite=args.overwrite,
        progress=not args.no_progress,
    )
    sizes = {s: v["clips"] for s, v in manifest["splits"].items()}
    print(f"wesnoth set ready in {args.out}: clips {sizes} (check it with: vse data check {args.out})")
    return 0


def register_openclipart(dsub) -> None:
    o = dsub.add_parser(
        "openclipart", help="build the openclipart retrieval set from Debian's openclipart-svg"
    )
    o.add_argument("--out", required=True)
    o.add_argument("--svg-root", default="/usr/share/openclipart/svg")
    o.add_argument("--seed", type=int, action=at_least(0), default=0)
    o.add_argument("--limit", type=int, action=at_least(1), help="only the first N drawings (smoke tests)")
    o.add_argument("--workers", type=int, action=at_least(1), default=2)
    o.set_defaults(func=run_openclipart)


def register_convert_video(dsub) -> None:
    cv = dsub.add_parser(
        "convert-video",
        help="convert MSR-VTT / VATEX frame features (npy folder, HDF5, LMDB) "
        "and captions into the ragged clip layout",
    )
    cv.add_argument("--features", required=True, help="a folder of <video_id>.npy, an HDF5 file or an LMDB")
    cv.add_argument(
        "--captions",
        required=True,
        action="append",
        help="videodatainfo.json, {id: [captions]} "
        "JSON, VATEX JSON or id<TAB>caption text; repeat for several files",
    )
    cv.add_argument(
        "--split-file",
        action="append",
        metavar="NAME:FILE",
        help="video ids of split NAME (one per "
        "line, JSON list or .npy of names); repeat per split; overrides the JSON's split field",
    )
    cv.add_argument("--splits", nargs="+", help="write only these splits")
    cv.add_argument("--format", choices=["auto", "npy-dir", "hdf5", "lmdb"], default="auto")
    cv.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    cv.add_argument(
        "--lmdb-dim",
        type=int,
        action=at_least(1),
        help="feature size of raw float32 LMDB values (not needed for .npy values)",
    )
    cv.add_argument("--out", required=True)
    cv.add_argument("--overwrite", action="store_true", help="replace the files of these splits in --out")
    cv.set_defaults(func=run_convert_video)


def register_synthetic(dsub) -> None:
    y = dsub.add_parser("synthetic", help="write a small synthetic precomp dataset (tests, smoke runs)")
    y.add_argument("--out", required=True)
    y.add_argument("--n-train", type=int, action=at_least(1), default=400)
    y.add_argument("--seed", type=int, action=at_least(0), default=0)
    y.add_argument("--variable-captions", action="store_true")
    y.add_argument("--overwrite", action="store_true", help="replace the dataset in a non-empty --out")
    y.set_defaults(func=run_synthetic)


def register_moving_shapes(dsub) -> None:
    ms = dsub.add_parser(
        "moving-shapes", help="generate the moving-shapes video-text set (clips of frames; docs/video.md)"
    )
    ms.add_argument("--out", required=True)
    ms.add_argument(
        "--clips",
        type=int,
        action=at_least(1),
        nargs="+",
        default=[600, 150, 150],
        metavar="N",
        help="clips per split: TRAIN DEV TEST, or TRAIN alone (dev and test TRAIN/4 each)",
    )
    ms.add_argument(
        "--frames",
        type=int,
        action=at_least(1),
        nargs=2,
        default=[6, 16],
        metavar=("MIN", "MAX"),
        help="frames per clip",
    )
    ms.add_argument(
        "--captions",
        type=int,
        action=at_least(1),
        nargs=2,
        default=[5, 10],
        metavar=("MIN", "MAX"),
        help="captions per clip",
    )
    ms.add_argument(
        "--features",
        choices=("efficientnet", "random-projection"),
        default="efficientnet",
        help="efficientnet: Lite0 grid averaged, 1280-d a frame; random-projection: a fixed random ReLU "
        "projection of the pixels, 256-d, no CNN (tests, smoke runs)",
    )
    ms.add_argument(
        "--splits",
        nargs="+",
        choices=("train", "dev", "test"),
        default=["train", "dev", "test"],
        help="build only these (clip i of a split is the same whatever else is built)",
    )
    ms.add_argument("--seed", type=int, action=at_least(0), default=0)
    ms.add_argument("--overwrite", action="store_true", help="replace the dataset in a non-empty --out")
    ms.add_argument("--device", default="cpu", help="where the CNN runs (efficientnet features)")
    ms.add_argument("--no-progress", action="store_true")
    ms.set_defaults(func=run_moving_shapes)


def register_wesnoth(dsub) -> None:
    wn = dsub.add_parser(
        "wesnoth", help="build the Battle for Wesnoth unit-animation video-text set (docs/wesnoth.md)"
    )
    wn.add_argument("--out", required=True)
    wn.add_argument(
        "--source",
        help="a wesnoth-1.16-data .deb, an extracted package root or its data folder "
        "(default: an installed /usr/share/games/wesnoth/*/data, else `apt-get download`)",
    )
    wn.add_argument(
        "--campaigns", action="store_true", help="also the unit types under data/campaigns/*/units"
    )
    wn.add_argument(
        "--descriptions",
        action="store_true",
        help="add each unit's description as a second caption (shared by all its clips)",
    )
    wn.add_argument(
        "--all-takes",
        action="store_true",
        help="keep in dev/test the clips whose caption repeats another clip's (dropped by default)",
    )
    wn.add_argument("--overwrite", action="store_true", help="replace the dataset in a non-empty --out")
    wn.add_argument("--no-progress", action="store_true")
    wn.set_defaults(func=run_wesnoth)
