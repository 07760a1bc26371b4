"""`vse data openclipart | karpathy | folder | table | webdataset | convert-video | moving-shapes | wesnoth |
show | check | synthetic | relevance | relevance-share`."""

from __future__ import annotations

import argparse

from vsekit.commands.argtypes import at_least, finite, fraction
from vsekit.commands.jsonout import add_json_args
from vsekit.commands.own_data import register_own
from vsekit.errors import VseInputError


def run_openclipart(args: argparse.Namespace) -> int:
    from vsekit.datasets.openclipart import build_openclipart

    manifest = build_openclipart(args.out, svg_root=args.svg_root, seed=args.seed, limit=args.limit, workers=args.workers)
    sizes = manifest.get("splits", manifest.get("split_sizes", {}))
    print(f"openclipart set ready in {args.out}: {sizes}")
    return 0


def run_karpathy(args: argparse.Namespace) -> int:
    from vsekit.data.raw_images import convert_karpathy

    counts = convert_karpathy(args.json, args.out, image_root=args.images, splits=tuple(args.splits))
    print(f"wrote {args.out}: {counts} (pictures only: train a backbone recipe, e.g. vse_infty_grid_e2e)")
    return 0


def run_convert_video(args: argparse.Namespace) -> int:
    from vsekit.datasets.video_convert import convert_video

    summary = convert_video(args.features, args.captions, args.out, fmt=args.format, split_files=args.split_file,
                            splits=args.splits, dtype=args.dtype, lmdb_dim=args.lmdb_dim, overwrite=args.overwrite)  # fmt: skip
    for name, s in summary.items():
        lo, mid, hi = s["frames_per_clip"]
        print(f"{name}: {s['clips']} clips, {s['captions']} captions, {s['frames']} x {s['dim']} frames "
              f"(per clip min {lo} / median {mid:g} / max {hi})")  # fmt: skip
    print(f"wrote {args.out} (check it with: vse data check {args.out})")
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


def run_synthetic(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vsekit.datasets.synthetic import SPLIT_FILES, SPLITS, make_synthetic_precomp
    from vsekit.utils.io import prepare_dataset_dir

    if args.n_train < 1:  # checked before an --overwrite clears anything
        raise VseInputError(f"--n-train must be at least 1 (training images to generate), got {args.n_train}")
    prepare_dataset_dir(Path(args.out), args.overwrite, SPLITS, SPLIT_FILES, ("manifest.json",))
    make_synthetic_precomp(args.out, n_train=args.n_train, seed=args.seed, variable_captions=args.variable_captions)
    print(f"wrote a synthetic precomp dataset to {args.out}")
    return 0


def run_moving_shapes(args: argparse.Namespace) -> int:
    from vsekit.datasets.moving_shapes import SPLITS, build_moving_shapes

    if len(args.clips) not in (1, 3):
        raise VseInputError(f"--clips takes TRAIN or TRAIN DEV TEST clip counts, got {len(args.clips)} values")
    counts = args.clips if len(args.clips) == 3 else [args.clips[0], max(1, args.clips[0] // 4), max(1, args.clips[0] // 4)]
    clips = {s: n for s, n in zip(SPLITS, counts) if s in args.splits}
    manifest = build_moving_shapes(args.out, clips=clips, frames=tuple(args.frames), captions=tuple(args.captions),
                                   features=args.features, seed=args.seed, overwrite=args.overwrite,
                                   progress=not args.no_progress, device=args.device)  # fmt: skip
    print(f"moving-shapes set ready in {args.out}: {manifest['splits']}")
    return 0


def run_wesnoth(args: argparse.Namespace) -> int:
    from vsekit.datasets.wesnoth import build_wesnoth

    manifest = build_wesnoth(args.out, source=args.source, campaigns=args.campaigns, descriptions=args.descriptions,
                             all_takes=args.all_takes, overwrite=args.overwrite, progress=not args.no_progress)  # fmt: skip
    sizes = {s: v["clips"] for s, v in manifest["splits"].items()}
    print(f"wesnoth set ready in {args.out}: clips {sizes} (check it with: vse data check {args.out})")
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

    values = split_pair_relevance(args.data, args.split, args.captions_per_image, args.cache_dir,
                                  device=args.device, max_pairs=args.max_pairs)  # fmt: skip
    how = "every pair" if len(values) < args.max_pairs else f"a fixed-seed sample (--max-pairs {args.max_pairs:,})"
    print(f"{args.split}: {len(values):,} caption pairs of different images ({how}), MiniLM relevance "
          f"mean {values.mean():.3f}")  # fmt: skip
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
    o = dsub.add_parser("openclipart", help="build the openclipart retrieval set from Debian's openclipart-svg")
    o.add_argument("--out", required=True)
    o.add_argument("--svg-root", default="/usr/share/openclipart/svg")
    o.add_argument("--seed", type=int, action=at_least(0), default=0)
    o.add_argument("--limit", type=int, action=at_least(1), help="only the first N drawings (smoke tests)")
    o.add_argument("--workers", type=int, action=at_least(1), default=2)
    o.set_defaults(func=run_openclipart)
    k = dsub.add_parser("karpathy", help="convert a Karpathy JSON (dataset_coco.json / dataset_flickr30k.json)")
    k.add_argument("json", help="dataset_flickr30k.json or dataset_coco.json")
    k.add_argument("--images", help="folder the JSON's filepath/filename are relative to (default: the JSON's)")
    k.add_argument("--out", required=True)
    k.add_argument("--splits", nargs="+", default=["train", "dev", "test"], help="dev = the JSON's 'val'")
    k.set_defaults(func=run_karpathy)
    li = dsub.add_parser("link-images", help="write {split}_images.txt of a COCO / Flickr30K precomp folder from its "
                         "{split}_ids.txt and a folder of the pictures (so vse serve shows them)")  # fmt: skip
    li.add_argument("data", help="the precomp folder (with {split}_ids.txt)")
    li.add_argument("--images", required=True, help="folder holding the pictures (searched recursively)")
    li.add_argument("--splits", nargs="+", help="default: every split with a {split}_ids.txt")
    li.add_argument("--captions-per-image", type=int, action=at_least(1), default=5)
    li.set_defaults(func=run_link_images)
    register_own(dsub)  # folder | table | webdataset: vsekit.commands.own_data
    cv = dsub.add_parser("convert-video", help="convert MSR-VTT / VATEX frame features (npy folder, HDF5, LMDB) "
                         "and captions into the ragged clip layout")  # fmt: skip
    cv.add_argument("--features", required=True, help="a folder of <video_id>.npy, an HDF5 file or an LMDB")
    cv.add_argument("--captions", required=True, action="append", help="videodatainfo.json, {id: [captions]} "
                    "JSON, VATEX JSON or id<TAB>caption text; repeat for several files")  # fmt: skip
    cv.add_argument("--split-file", action="append", metavar="NAME:FILE", help="video ids of split NAME (one per "
                    "line, JSON list or .npy of names); repeat per split; overrides the JSON's split field")  # fmt: skip
    cv.add_argument("--splits", nargs="+", help="write only these splits")
    cv.add_argument("--format", choices=["auto", "npy-dir", "hdf5", "lmdb"], default="auto")
    cv.add_argument("--dtype", choices=["float32", "float16"], default="float32")
    cv.add_argument("--lmdb-dim", type=int, action=at_least(1), help="feature size of raw float32 LMDB values (not needed for .npy values)")
    cv.add_argument("--out", required=True)
    cv.add_argument("--overwrite", action="store_true", help="replace the files of these splits in --out")
    cv.set_defaults(func=run_convert_video)
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
    y = dsub.add_parser("synthetic", help="write a small synthetic precomp dataset (tests, smoke runs)")
    y.add_argument("--out", required=True)
    y.add_argument("--n-train", type=int, action=at_least(1), default=400)
    y.add_argument("--seed", type=int, action=at_least(0), default=0)
    y.add_argument("--variable-captions", action="store_true")
    y.add_argument("--overwrite", action="store_true", help="replace the dataset in a non-empty --out")
    y.set_defaults(func=run_synthetic)
    r = dsub.add_parser("relevance", help="cache caption x caption relevance (MiniLM) for CS@K and the ladder loss")
    r.add_argument("data")
    r.add_argument("--split", nargs="+", default=["test"])
    r.add_argument("--cache-dir", help="where to cache (default: the dataset directory when writable)")
    r.add_argument("--device", default="cpu")
    r.set_defaults(func=run_relevance)
    rs = dsub.add_parser("relevance-share", help="share of caption pairs at or above a ladder threshold θ, and the "
                         "θ of a given share (the rule of loss.ladder_threshold_share)")  # fmt: skip
    rs.add_argument("data")
    rs.add_argument("--split", default="train")
    rs.add_argument("--theta", type=float, action=finite(), nargs="+", default=[0.2, 0.3, 0.4, 0.5])
    rs.add_argument("--share", type=float, action=fraction(), nargs="+", default=[0.15])
    rs.add_argument("--batch", type=int, action=at_least(2), default=128, help="batch size for the per-query count")
    rs.add_argument("--captions-per-image", type=int, action=at_least(1), default=5, help="SCAN layout without a cap2img file")
    rs.add_argument("--max-pairs", type=int, action=at_least(1), default=20_000_000, help="above this many pairs, a sample of it")
    rs.add_argument("--cache-dir", help="where the sentence embeddings are cached (as `vse data relevance`)")
    rs.add_argument("--device", default="cpu")
    add_json_args(rs, "the shares and thresholds", path_form=True)
    rs.set_defaults(func=run_relevance_share)
    ms = dsub.add_parser("moving-shapes", help="generate the moving-shapes video-text set (clips of frames; docs/video.md)")
    ms.add_argument("--out", required=True)
    ms.add_argument("--clips", type=int, action=at_least(1), nargs="+", default=[600, 150, 150], metavar="N",
                    help="clips per split: TRAIN DEV TEST, or TRAIN alone (dev and test TRAIN/4 each)")
    ms.add_argument("--frames", type=int, action=at_least(1), nargs=2, default=[6, 16], metavar=("MIN", "MAX"),
                    help="frames per clip")
    ms.add_argument("--captions", type=int, action=at_least(1), nargs=2, default=[5, 10], metavar=("MIN", "MAX"),
                    help="captions per clip")
    ms.add_argument("--features", choices=("efficientnet", "random-projection"), default="efficientnet",
                    help="efficientnet: Lite0 grid averaged, 1280-d a frame; random-projection: a fixed random ReLU "
                    "projection of the pixels, 256-d, no CNN (tests, smoke runs)")  # fmt: skip
    ms.add_argument("--splits", nargs="+", choices=("train", "dev", "test"), default=["train", "dev", "test"],
                    help="build only these (clip i of a split is the same whatever else is built)")
    ms.add_argument("--seed", type=int, action=at_least(0), default=0)
    ms.add_argument("--overwrite", action="store_true", help="replace the dataset in a non-empty --out")
    ms.add_argument("--device", default="cpu", help="where the CNN runs (efficientnet features)")
    ms.add_argument("--no-progress", action="store_true")
    ms.set_defaults(func=run_moving_shapes)
    wn = dsub.add_parser("wesnoth", help="build the Battle for Wesnoth unit-animation video-text set (docs/wesnoth.md)")
    wn.add_argument("--out", required=True)
    wn.add_argument("--source", help="a wesnoth-1.16-data .deb, an extracted package root or its data folder "
                    "(default: an installed /usr/share/games/wesnoth/*/data, else `apt-get download`)")  # fmt: skip
    wn.add_argument("--campaigns", action="store_true", help="also the unit types under data/campaigns/*/units")
    wn.add_argument("--descriptions", action="store_true",
                    help="add each unit's description as a second caption (shared by all its clips)")
    wn.add_argument("--all-takes", action="store_true",
                    help="keep in dev/test the clips whose caption repeats another clip's (dropped by default)")
    wn.add_argument("--overwrite", action="store_true", help="replace the dataset in a non-empty --out")
    wn.add_argument("--no-progress", action="store_true")
    wn.set_defaults(func=run_wesnoth)
