"""The build: find, parse, label, render, split, extract and write the openclipart set with its manifest."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path

import numpy as np

from vsekit.data.manifest import write_manifest
from vsekit.data.precomp import IMAGE_SPLIT_FILES, writing_split
from vsekit.errors import SetupError
from vsekit.utils.io import atomic_write_json, atomic_write_text, sha256_file
from vsekit_lab.datasets.openclipart.features import compute_features, write_features
from vsekit_lab.datasets.openclipart.labels import CAPTION_RULES, MAX_SHARE, assign_labels, merge_duplicates
from vsekit_lab.datasets.openclipart.metadata import parse_all
from vsekit_lab.datasets.openclipart.render import IMAGE_SIZE, MARGIN, RENDER_SIZE, RENDER_VERSION, render_all
from vsekit_lab.datasets.openclipart.source import (
    DEFAULT_SVG_ROOT,
    PACKAGE,
    ensure_svg_root,
    find_svgs,
    package_version,
)
from vsekit_lab.datasets.openclipart.text import MAX_WORDS

log = logging.getLogger(__name__)

FORMAT = "vsekit-precomp/1"
SPLITS = ("train", "dev", "test")
EVAL_FRACTION_CAP = 0.4  # test + dev never take more than this share of the images (small `limit` builds)


def split_sizes(n: int, n_test: int, n_dev: int) -> tuple[int, int]:
    """Requested test/dev sizes, scaled down (ratio kept) when they would exceed 40 % of the images."""
    if n_test + n_dev <= EVAL_FRACTION_CAP * n:
        return n_test, n_dev
    budget = EVAL_FRACTION_CAP * n
    total = max(n_test + n_dev, 1)
    t = max(1, int(round(budget * n_test / total))) if n >= 3 else 0
    d = max(1, int(round(budget * n_dev / total))) if n >= 3 else 0
    return t, d


def assign_splits(ids: list[str], seed: int, n_test: int, n_dev: int) -> dict[str, list[str]]:
    """Seeded split by image (captions follow their image); rows inside a split are sorted by id."""
    ids = sorted(ids)
    t, d = split_sizes(len(ids), n_test, n_dev)
    perm = np.random.default_rng(seed).permutation(len(ids))
    test, dev, train = perm[:t], perm[t : t + d], perm[t + d :]
    return {
        "train": sorted(ids[i] for i in train),
        "dev": sorted(ids[i] for i in dev),
        "test": sorted(ids[i] for i in test),
    }


def build_openclipart(
    out_dir: str | Path,
    svg_root: str | Path = DEFAULT_SVG_ROOT,
    seed: int = 0,
    limit: int | None = None,
    workers: int = 2,
    n_test: int = 500,
    n_dev: int = 300,
    progress: bool = True,
) -> dict:
    """Build (or finish, or refresh) the openclipart retrieval set in `out_dir`; returns the manifest.

    `limit` keeps a seeded random subset of that many labelled drawings (after parsing and filtering the
    whole tree, so labels are the same as in the full build) for quick smoke runs; test/dev sizes then
    shrink so that they take at most 40 % of the images.
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    out = Path(out_dir)
    cache = out / ".cache"
    (out / "images").mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    root = ensure_svg_root(svg_root)

    rel_paths, links = find_svgs(root)
    if not rel_paths:
        raise FileNotFoundError(f"{root}: no .svg files found")
    parsed, errors = parse_all(root, rel_paths, cache / "metadata.json", progress)
    timings["parse"] = time.perf_counter() - t0
    drawings, n_dup = merge_duplicates(parsed)
    kept, label_stats = assign_labels(drawings)
    if limit is not None and len(kept) > limit:
        pick = np.random.default_rng(seed).choice(len(kept), size=max(int(limit), 0), replace=False)
        kept = [kept[i] for i in sorted(pick)]
    by_id = {d.id: d for d in kept}

    # render (PNGs and non-ok outcomes are cached, so a re-run only renders what is missing)
    t1 = time.perf_counter()
    status_file = cache / "render_status.json"
    status: dict = {}
    if status_file.is_file():
        try:
            data = json.loads(status_file.read_text(encoding="utf-8"))
            status = data.get("status", {}) if data.get("render_version") == RENDER_VERSION else {}
        except (OSError, ValueError):
            status = {}
    jobs = []
    reused = 0
    for d in kept:
        png = out / "images" / f"{d.id}.png"
        if png.is_file():
            status[d.id] = {"status": "ok", "detail": ""}
            reused += 1
        elif status.get(d.id, {}).get("status") in ("blank", "failed"):
            continue
        else:
            jobs.append((d.id, str(root / d.files[0]), str(png)))
    pending = {"n": 0}

    def on_result(ident: str, st: str, detail: str) -> None:
        status[ident] = {"status": st, "detail": detail}
        if st == "failed":
            log.warning("render failed for %s (%s): %s", ident, by_id[ident].files[0], detail)
        pending["n"] += 1
        if pending["n"] % 200 == 0:
            atomic_write_json(
                status_file, {"render_version": RENDER_VERSION, "status": status}, ensure_ascii=False
            )

    try:
        render_all(jobs, workers, progress, on_result)
    finally:
        atomic_write_json(
            status_file, {"render_version": RENDER_VERSION, "status": status}, ensure_ascii=False
        )
    timings["render"] = time.perf_counter() - t1
    outcome = Counter(status[d.id]["status"] for d in kept)
    images = [d for d in kept if status[d.id]["status"] == "ok"]
    if not images:
        raise SetupError(f"no usable images from {root} (render outcomes: {dict(outcome)})")

    # split + features
    splits = assign_splits([d.id for d in images], seed, n_test, n_dev)
    t2 = time.perf_counter()
    where, spec, feat_stats = compute_features(
        sorted(d.id for d in images), out, cache / "features", progress
    )
    timings["features"] = time.perf_counter() - t2

    # write the layout
    t3 = time.perf_counter()
    files: dict[str, str] = {}
    split_info: dict[str, dict] = {}
    for split in SPLITS:
        ids = splits[split]
        caps, cap2img, metas = [], [], []
        for row, ident in enumerate(ids):
            d = by_id[ident]
            for c in d.captions:
                if "\n" in c or "\r" in c or not c.strip():
                    raise RuntimeError(f"bad caption for {ident}: {c!r}")
                caps.append(c)
                cap2img.append(row)
            metas.append(
                {
                    "id": d.id,
                    "label": d.label,
                    "label_source": d.label_source,
                    "title": d.title,
                    "description": d.description,
                    "keywords": d.keywords,
                    "creator": d.creator,
                    "categories": d.categories,
                    "files": d.files,
                    "captions": d.captions,
                }
            )
        with writing_split(out, split) as w:
            if ids:
                write_features(w, ids, where)
            else:  # an empty split (tiny `limit` builds) still gets well-formed files
                w.features(np.zeros((0, spec["regions"], spec["dim"]), np.float16))
            w.captions(caps)
            w.cap2img(cap2img)
            w.ids(ids)
            w.image_paths(f"images/{i}.png" for i in ids)
        atomic_write_text(
            out / f"{split}_meta.jsonl", "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in metas)
        )
        per_image = Counter(len(by_id[i].captions) for i in ids)
        split_info[split] = {
            "images": len(ids),
            "captions": len(caps),
            "captions_per_image": {str(k): per_image[k] for k in sorted(per_image)},
        }
    for split in SPLITS:
        for suffix in (*IMAGE_SPLIT_FILES, "_meta.jsonl"):
            name = f"{split}{suffix}"
            files[name] = sha256_file(out / name)
    timings["write"] = time.perf_counter() - t3
    timings["total"] = time.perf_counter() - t0

    err_kinds = Counter(e["kind"] for e in errors.values())
    licences = Counter(d.license.rsplit("/", 1)[-1] or "(none)" for d in drawings)
    is_default = root.resolve() == Path(DEFAULT_SVG_ROOT).resolve()
    manifest = {
        "format": FORMAT,
        "name": "openclipart",
        "source": {
            "package": PACKAGE if is_default else None,
            "version": package_version() if is_default else None,
            "svg_root": str(root),
        },
        "license": "Public domain: Creative Commons Public Domain Dedication (the predecessor of CC0), per "
        "/usr/share/doc/openclipart-svg/copyright; each SVG's RDF carries cc:license PublicDomain.",
        "license_per_drawing": dict(licences),
        "build": {
            "seed": seed,
            "limit": limit,
            "n_test": n_test,
            "n_dev": n_dev,
            "workers": workers,
            "render": RENDER_VERSION,
            "render_size": RENDER_SIZE,
            "image_size": IMAGE_SIZE,
            "crop_margin": MARGIN,
            "max_words": MAX_WORDS,
            "max_share": MAX_SHARE,
        },
        "counts": {
            "svg_files": len(rel_paths),
            "symlinks_skipped": links,
            "malformed_skipped": err_kinds.get("malformed", 0),
            "no_metadata_skipped": err_kinds.get("no_metadata", 0),
            "parsed": len(parsed),
            "duplicates": n_dup,
            "unique_drawings": len(drawings),
            "generic_titles": label_stats["generic_titles"],
            "renamed_from_file_stem": label_stats["renamed_from_file_stem"],
            "generic_dropped": label_stats["generic_dropped"],
            "generic_dropped_collection": label_stats["generic_dropped_collection"],
            "generic_dropped_unreadable_stem": label_stats["generic_dropped_unreadable_stem"],
            "generic_dropped_ambiguous_stem": label_stats["generic_dropped_ambiguous_stem"],
            "labelled": len(drawings) - label_stats["generic_dropped"],
            "selected": len(kept),
            "render_failures": outcome.get("failed", 0),
            "blank": outcome.get("blank", 0),
            "images": len(images),
            "captions": sum(s["captions"] for s in split_info.values()),
        },
        "splits": split_info,
        "caption_rules": CAPTION_RULES,
        "layout": {
            "{split}_ims.npy": "float16 (images, 49, 1280) EfficientNet-Lite0 grid, one row per image",
            "{split}_caps.txt": "one caption per line, captions of one image consecutive",
            "{split}_cap2img.txt": "0-based image row of each caption line",
            "{split}_ids.txt": "stable image id (md5 prefix of the SVG without <metadata>) per image row",
            "{split}_images.txt": "PNG path relative to this folder per image row",
            "{split}_meta.jsonl": "per image row: label, title, description, keywords, creator, categories, files",
        },
        "features": spec,
        "files_sha256": files,
        "cache": {
            "png_reused": reused,
            "png_rendered": len(jobs),
            "features_reused": feat_stats["reused"],
            "features_computed": feat_stats["computed"],
        },
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }
    write_manifest(out, manifest, ensure_ascii=False)
    return manifest
