"""The build: locate, parse, clip, split, render and extract, then write the frames layout, captions, manifest,
README and licence."""

from __future__ import annotations

import json
import logging
import re
import shutil
import statistics
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from vsekit.data.manifest import MANIFEST, write_manifest
from vsekit.data.precomp import CLIP_SPLIT_FILES, write_precomp_split
from vsekit.errors import VseInputError
from vsekit.utils.io import prepare_dataset_dir
from vsekit_lab.datasets.wesnoth.captions import CAPTION_RULES
from vsekit_lab.datasets.wesnoth.clips import (
    DEV_FRACTION,
    SPLITS,
    TEST_FRACTION,
    assign_splits,
    drop_repeated_captions,
    make_clips,
)
from vsekit_lab.datasets.wesnoth.frames import (
    EfficientNetFrameMean,
    FrameExtractor,
    extract_frames,
)
from vsekit_lab.datasets.wesnoth.source import locate_source
from vsekit_lab.datasets.wesnoth.units import Clip, parse_units

log = logging.getLogger(__name__)

FORMAT = "vsekit-wesnoth/1"
LICENSE = "GPL-2.0-or-later"
SPLIT_FILES = (*CLIP_SPLIT_FILES, "_clips.jsonl")
EXTRA_FILES = (MANIFEST, "README.md", "COPYING.txt", "debian-copyright.txt")


def prepare_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty folder unless `overwrite`; then remove only the files a Wesnoth build writes."""
    prepare_dataset_dir(out, overwrite, SPLITS, SPLIT_FILES, EXTRA_FILES)
    out.mkdir(parents=True, exist_ok=True)


def _ambiguous(captions: list[str]) -> int:
    """Captions whose exact text is also another clip's caption in the same split."""
    counts = Counter(captions)
    return sum(n for n in counts.values() if n > 1)


def _stats(clips: list[Clip]) -> dict:
    lengths = [len(c.frames) for c in clips]
    caps = [cap for c in clips for cap in c.captions]
    words = Counter(w for cap in caps for w in re.findall(r"[a-z']+", cap.lower()))
    return {
        "clips": len(clips),
        "units": len({c.unit for c in clips}),
        "families": len({c.family for c in clips}),
        "frames": sum(lengths),
        "frames_per_clip": [min(lengths), statistics.median(lengths), max(lengths)],
        "captions": len(caps),
        "distinct_captions": len(set(caps)),
        "ambiguous_captions": _ambiguous(caps),
        "vocabulary": len(words),
    }


def _readme(manifest: dict) -> str:
    src = manifest["source"]
    return (
        "# Battle for Wesnoth unit animations: a video–text retrieval set (vsekit)\n\n"
        f"Built by `vse data wesnoth` (vsekit, {FORMAT}); see docs/wesnoth.md in vsekit.\n\n"
        f"Source: Debian package `{src.get('package')}` version `{src.get('version')}`"
        + (f", .deb sha256 `{src['deb_sha256']}`" if src.get("deb_sha256") else "")
        + ".\n\n"
        "Licence: the sprites and unit descriptions are part of Battle for Wesnoth, copyright the Battle for "
        "Wesnoth project and its contributors (https://www.wesnoth.org), released under the GNU General Public "
        f"License version 2 or later ({LICENSE}); COPYING.txt is the licence text shipped with the data"
        " and debian-copyright.txt the package's copyright file (when found). The frame features and captions "
        "here are derived from that data and are distributed under the same licence.\n\n"
        "Files per split: `_frames.npy` (frames x 1280, float16, EfficientNet-Lite0 grid mean), "
        "`_frame_offsets.npy` (clips + 1), `_caps.txt`, `_cap2img.txt` (clip row per caption), `_ids.txt`, "
        "`_clips.jsonl` (unit, animation, weapon, direction, hits, sprite paths, captions).\n"
    )


def build_wesnoth(
    out_dir: str | Path,
    source: str | Path | None = None,
    campaigns: bool = False,
    descriptions: bool = False,
    all_takes: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    extractor: FrameExtractor | None = None,
    cache_dir: str | Path | None = None,
    batch_size: int = 16,
) -> dict:
    """Build the set in `out_dir`; returns the manifest. `extractor` replaces the CNN (tests).

    `descriptions`: add the unit description as a second caption; `all_takes`: keep in dev/test the clips whose
    action caption repeats another clip's (dropped by default, see `drop_repeated_captions`).
    """
    from vsekit.utils.io import atomic_write_text

    out = Path(out_dir)
    prepare_out_dir(out, overwrite)  # before any heavy work: a refused --out costs nothing
    src = locate_source(source, cache_dir)
    log.info("Wesnoth data: %s (%s)", src.data_dir, src.origin)
    units, anims = parse_units(src.data_dir, campaigns)
    clips, clip_stats = make_clips(src.data_dir, units, anims, descriptions)
    if not clips:
        raise VseInputError(f"{src.data_dir}: no animation with at least 2 distinct frames found")
    splits = assign_splits(clips, units)
    repeated = drop_repeated_captions(splits, keep_all=all_takes)
    clips = [c for split in SPLITS for c in splits[split]]
    extract = extractor if extractor is not None else EfficientNetFrameMean(batch_size)
    distinct = sorted({f for c in clips for f in c.frames})
    feats = extract_frames([src.data_dir / f for f in distinct], extract, batch_size, progress)
    row = {f: i for i, f in enumerate(distinct)}
    split_stats: dict[str, dict] = {}
    for split in SPLITS:
        members = splits[split]
        if not members:
            raise VseInputError(
                f"{split}: no clips (only {len(clips)} clips in {len({c.family for c in clips})} "
                "families); the split needs more unit families"
            )
        caps = [(cap, i) for i, c in enumerate(members) for cap in c.captions]
        write_precomp_split(
            out,
            split,
            captions=[cap for cap, _ in caps],
            cap2img=[i for _, i in caps],
            image_ids=[c.id for c in members],
            clips=[feats[[row[f] for f in c.frames]] for c in members],
            clip_dtype=np.float16,
        )
        atomic_write_text(
            out / f"{split}_clips.jsonl",
            "".join(json.dumps(asdict(c), ensure_ascii=False) + "\n" for c in members),
        )
        split_stats[split] = _stats(members)
        log.info("%s: %s", split, split_stats[split])
    manifest = {
        "format": FORMAT,
        "name": "wesnoth",
        "source": {
            "origin": src.origin,
            "package": src.package,
            "version": src.version,
            "deb": src.deb,
            "deb_sha256": src.deb_sha256,
            "data_dir": str(src.data_dir),
        },
        "license": LICENSE,
        "attribution": "Battle for Wesnoth, copyright the Battle for Wesnoth project and contributors, "
        "https://www.wesnoth.org",
        "build": {
            "campaigns": campaigns,
            "descriptions": descriptions,
            "all_takes": all_takes,
            "test_fraction": TEST_FRACTION,
            "dev_fraction": DEV_FRACTION,
            "split_rule": "advancement families (advances_to) in md5(family) "
            "order: test until 10% of the clips, dev until 20%, train the rest",
        },
        "counts": {
            "unit_types": len(units),
            "animation_branches": len(anims),
            **clip_stats,
            "dropped_repeated_caption": repeated,
            "distinct_sprites": len(distinct),
            **_stats(clips),
        },
        "splits": split_stats,
        "caption_rules": CAPTION_RULES,
        "features": extract.describe(),
    }
    write_manifest(out, manifest, ensure_ascii=False)
    atomic_write_text(out / "README.md", _readme(manifest))
    copying = src.data_dir / "COPYING.txt"
    if copying.is_file():
        shutil.copyfile(copying, out / "COPYING.txt")
    if src.package_root is not None and src.package:
        debian = src.package_root / "usr/share/doc" / src.package / "copyright"
        if debian.is_file():
            shutil.copyfile(debian, out / "debian-copyright.txt")
    return manifest
