"""Users' own pictures and captions as a training set: the one builder behind `vse data folder | table |
webdataset` (the readers are in `vsekit.datasets.own_sources` and `own_shards`). Its parts, one job each:
`own_items` (what a reader hands it), `own_checks` (captions screened, pictures checked, ids, duplicates
merged), `own_splits` (declared splits, seeded splits), `own_output` (the OUT folder: staging, publishing),
`own_features` (features, resumable); their public names are importable from here too.

A reader collects items (a name to report, a key for the id, where the picture's bytes are, its captions,
maybe a declared split) and the problems it found on the way. `build_own_dataset` then
0. holds `OUT/.lock` for the whole build (a second build into the same folder fails at once, naming it)
   and skips every caption `vsekit.data.text.caption_problem` refuses (a control character, more than
   MAX_CAPTION_CHARS characters), reporting it: `vse data check` applies the same rule;
1. checks every picture (read, sha256, full decode, on `workers` threads): an empty file or one that does
   not decode is reported by name and skipped;
2. merges duplicates (same sha256): the copy with the smallest id is kept, the captions of all copies are
   pooled, every other copy is reported by name; a merged picture has ONE split, so the same bytes never
   lie in two splits (a declared split conflict goes to the evaluation side: test, then dev);
3. with `strict`, stops on any problem, naming them all, before anything is written;
4. splits the pictures (a seeded permutation of the sorted ids: `dev` / `test` fractions below 1, or
   counts), unless the input declared them;
5. stores pictures that do not exist as files (tar members; every picture with `copy_images`) under
   `OUT/images/`, otherwise references them where they are through `manifest.json`'s `images_root`;
6. extracts grid features (`vsekit.datasets.own_features`: content-keyed, resumable cache), unless
   `pixels` (then backbone recipes train from the pictures);
7. writes the precomp layout: every split file goes to `OUT/.staging/` first, then the old manifest is
   removed, the files are renamed into place and `manifest.json` is written last. A folder without
   `manifest.json` is an unfinished build: run the same command again.

The check results are cached too (`OUT/.cache/checked.json`, keyed by file, size and mtime), so the rerun
of a stopped build does not read every picture again. A build that fails (an error, not Ctrl-C) removes
what it created in OUT unless it finished feature parts a rerun resumes from; what OUT held before it
started (an earlier build's cache) is never removed. Text that is not valid UTF-8 (a folder's path with other
bytes) is written to JSON with `\\xNN` escapes (`vsekit.utils.io.utf8_text`), and pictures whose folder
cannot be recorded that way are copied into OUT/images, so nothing fails once files are published.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from vsekit.data.manifest import MANIFEST, write_manifest
from vsekit.datasets.own_checks import (
    CHECK_CHUNK,
    CHECK_VERSION,
    assign_ids,
    check_all,
    check_picture,
    merge_duplicates,
    read_check_cache,
    safe_id,
    screen_captions,
    unique_captions,
    write_check_cache,
)
from vsekit.datasets.own_features import (
    FeatureOptions,
    compute_features,
    finished_parts,
    make_extractor,
)
from vsekit.datasets.own_items import (
    BAD_CAPTIONS,
    BAD_NAME,
    BROKEN_SHARD,
    DUPLICATE,
    EMPTY_CAPTION,
    EMPTY_FILE,
    MISSING_FILE,
    NAME_CLASH,
    NO_CAPTION,
    PICTURE_SUFFIXES,
    SKIPPING,
    SPLIT_CONFLICT,
    UNREADABLE,
    Collected,
    Item,
    Picture,
    PictureRef,
    Problem,
    normalise_caption,
)
from vsekit.datasets.own_output import (
    FORMAT,
    MARKER,
    NAME,
    PROBLEMS_FILE,
    SPLIT_FILES,
    check_out_dir,
    listable,
    publish,
    reference_pictures,
    start_out,
    store_pictures,
    utf8_json,
    write_split,
)
from vsekit.datasets.own_splits import (
    EVAL_ORDER,
    SPLIT_ALIASES,
    SPLITS,
    assign_splits,
    resolve_split,
    split_count,
    split_name,
)
from vsekit.errors import VseInputError
from vsekit.utils.io import atomic_write_text, utf8_text
from vsekit.utils.locks import LOCK_NAME, folder_lock

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildOptions:
    """How to build: split sizes (fractions below 1, or counts), seed, features or `pixels`, and policies."""

    dev: float = 0.1
    test: float = 0.1
    seed: int = 0
    pixels: bool = False
    copy_images: bool = False
    strict: bool = False
    overwrite: bool = False
    workers: int = 2
    progress: bool = True
    features: FeatureOptions = field(default_factory=FeatureOptions)


def report_problems(problems: Sequence[Problem]) -> None:
    """Log each problem as a warning, named (`vse data` prints them on stderr)."""
    for p in problems:
        log.warning("%s", p)


def build_own_dataset(
    collected: Collected,
    out_dir: str | Path,
    options: BuildOptions | None = None,
    input_root: str | Path | None = None,
) -> dict:
    """Build the precomp dataset of `collected` in `out_dir` (or finish a stopped build); returns the manifest.

    `input_root`: the folder the input's pictures are named from (a `vse data folder` DIR, a table's images
    root), the least images root when the pictures are referenced in place. One build at a time holds OUT
    (`OUT/.lock`); a build that fails removes what it created there (see the module's docstring).
    """
    opts = options or BuildOptions()
    out = Path(out_dir)
    with folder_lock(out, "`vse data` build", "this folder", VseInputError, log.info):
        before = {p.name for p in out.iterdir()}
        try:
            return _build(collected, out, opts, input_root)
        except Exception:  # not Ctrl-C: a stopped build keeps its work for the rerun
            _undo_failed_build(out, before)
            raise


def _undo_failed_build(out: Path, before: set[str]) -> None:
    """Remove what a failed build created in OUT (its cache, staged files, copied pictures), unless it finished
    feature parts a rerun resumes from; what OUT held before the build is never touched."""
    created = sorted(p for p in out.iterdir() if p.name not in before and p.name != LOCK_NAME)
    if (out / ".cache") in created and finished_parts(out / ".cache" / "features"):
        log.info(
            "the feature parts done so far are kept in %s; run the same command again to resume",
            utf8_text(str(out / ".cache")),
        )
        created = [p for p in created if p.name == ".staging"]
    for p in created:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)


def _build(collected: Collected, out: Path, opts: BuildOptions, input_root: str | Path | None) -> dict:
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    state = check_out_dir(out, opts.overwrite)
    items, caption_problems = screen_captions(collected.items)
    problems = list(collected.problems) + caption_problems
    what = collected.source.get("input", "the input")
    if not items and not problems:
        raise VseInputError(f"{what}: no pictures found")
    if collected.declared_splits and any(it.split is None for it in items):
        first = next(it for it in items if it.split is None)
        raise VseInputError(
            f"{first.name}: no split declared (every picture needs one when splits are declared)"
        )
    # a machine that cannot extract (no CUDA, a missing package, bad weights) fails before any picture is read
    extractor = None if opts.pixels else make_extractor(opts.features)
    timings["setup"] = time.perf_counter() - t0

    ids = assign_ids(items)
    check_cache_path = out / ".cache" / "checked.json"
    cache = read_check_cache(check_cache_path) if state == "ours" else {}
    n_cached = len(cache)
    used: set[str] = set()
    try:
        checked = check_all(items, cache, opts.workers, opts.progress, used)
    except BaseException:
        if not opts.strict and len(cache) > n_cached:  # keep what was checked: the rerun starts from there
            start_out(out, state)
            write_check_cache(check_cache_path, cache)
        raise
    cache = {k: v for k, v in cache.items() if k in used}  # files no longer in the input are forgotten
    timings["check"] = time.perf_counter() - t0 - timings["setup"]
    good = [i for i, (_, p) in enumerate(checked) if p is None]
    problems += [p for _, p in checked if p is not None]
    pictures, dup_problems = merge_duplicates(
        [items[i] for i in good], [ids[i] for i in good], [checked[i][0] for i in good]
    )
    problems += dup_problems
    if problems and opts.strict:
        raise VseInputError(
            f"--strict: {len(problems)} problem(s) in {what}; nothing was written:\n"
            + "\n".join(f"  {p}" for p in problems)
        )
    report_problems(problems)
    if not pictures:
        raise VseInputError(
            f"{what}: no usable picture with a caption ({len(problems)} problem(s), listed above)"
        )
    if collected.declared_splits:
        splits = {s: sorted(p.id for p in pictures if p.split == s) for s in SPLITS}
        if not splits["train"]:
            raise VseInputError(f"{what}: no picture is declared in the train split")
    else:
        splits = assign_splits([p.id for p in pictures], opts.dev, opts.test, opts.seed)
    for s in ("dev", "test"):
        if not splits[s]:
            log.warning(
                "%s: the %s split is empty, so no %s files are written%s",
                what,
                s,
                s,
                "; training needs a dev split (or data.val_split=...)" if s == "dev" else "",
            )

    start_out(out, state)
    write_check_cache(check_cache_path, cache)
    by_id = {p.id: p for p in pictures}
    t1 = time.perf_counter()
    store = opts.copy_images or not all(p.item.picture.is_file for p in pictures)
    images_root = None
    if not store:
        paths, images_root = reference_pictures(out, pictures, Path(input_root) if input_root else None)
        odd = [rel for rel in paths.values() if not listable(rel)]
        if odd:  # `{split}_images.txt` holds one stripped UTF-8 path per line
            log.info(
                "%d picture path(s) cannot be listed one per line in UTF-8 (e.g. %r): the pictures are copied "
                "into %s",
                len(odd),
                utf8_text(odd[0]),
                utf8_text(str(out / "images")),
            )
        elif utf8_text(images_root) != images_root:
            log.info(
                "the pictures' folder %s is not a UTF-8 path, which manifest.json cannot record: the pictures "
                "are copied into %s",
                utf8_text(images_root),
                utf8_text(str(out / "images")),
            )
        if odd or utf8_text(images_root) != images_root:
            store, images_root = True, None
    if store:
        paths = store_pictures(out, pictures, opts.progress)
    timings["pictures"] = time.perf_counter() - t1

    where, spec, shape, device, feat_stats = None, None, None, None, {"computed": 0, "reused": 0}
    if extractor is not None:
        t2 = time.perf_counter()
        spec, shape, device = extractor.spec, extractor.shape, str(extractor.device)
        refs = {p.sha256: (p.item.picture, p.item.name) for p in pictures}
        where, feat_stats = compute_features(
            refs,
            out / ".cache" / "features",
            extractor,
            opts.features.batch_size,
            opts.workers,
            opts.progress,
        )
        timings["features"] = time.perf_counter() - t2

    t3 = time.perf_counter()
    stage = out / ".staging"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    split_info = {
        s: write_split(stage, s, splits[s], by_id, paths, where, shape) for s in SPLITS if splits[s]
    }
    if problems:
        atomic_write_text(stage / PROBLEMS_FILE, "".join(f"{utf8_text(str(p))}\n" for p in problems))

    kinds = Counter(p.kind for p in problems)
    manifest: dict = {
        "format": FORMAT,
        "name": NAME,
        "source": collected.source,
        "build": {
            "split_by": "declared" if collected.declared_splits else "seeded fractions",
            "dev": None if collected.declared_splits else opts.dev,
            "test": None if collected.declared_splits else opts.test,
            "seed": opts.seed,
            "pixels": opts.pixels,
            "copy_images": store,
            "strict": opts.strict,
            "backbone": None if opts.pixels else opts.features.backbone,
            "batch_size": None if opts.pixels else opts.features.batch_size,
            "device": device,
        },
        "counts": {
            **collected.notes,
            "pictures": len(pictures),
            "captions": sum(len(p.captions) for p in pictures),
            "duplicates_merged": kinds.get(DUPLICATE, 0),
            "skipped": sum(n for k, n in kinds.items() if k in SKIPPING),
        },
        "problems": dict(sorted(kinds.items())),
        "splits": split_info,
        "layout": {
            "{split}_ims.npy": "float16 (images, regions, dim) grid features, one row per picture"
            if not opts.pixels
            else "not written: pictures only (--pixels), for backbone recipes",
            "{split}_caps.txt": "one caption per line, the captions of one picture consecutive",
            "{split}_cap2img.txt": "0-based picture row of each caption line",
            "{split}_ids.txt": "picture id (its name without extension, made safe) per row",
            "{split}_images.txt": "picture path per row, relative to images_root (else this folder)",
            "{split}_meta.jsonl": "per row: id, sha256 of the bytes, every input name merged into it, captions",
            PROBLEMS_FILE: "every problem of the input, one per line (absent when there were none)",
        },
        "files_sha256": {},
        "cache": {"features_computed": feat_stats["computed"], "features_reused": feat_stats["reused"]},
        "timings_s": {},
    }
    if images_root is not None:
        manifest["images_root"] = images_root
    if spec is not None:
        manifest["features"] = spec
    manifest = utf8_json(manifest)  # before anything is published: writing it cannot fail on a path's bytes
    manifest["files_sha256"] = publish(out, stage, [PROBLEMS_FILE])
    timings["write"] = time.perf_counter() - t3
    timings["total"] = time.perf_counter() - t0
    manifest["timings_s"] = {k: round(v, 2) for k, v in timings.items()}
    write_manifest(out, manifest, ensure_ascii=False)
    return manifest


def summary_line(manifest: dict, out: str | Path) -> str:
    """One line for the terminal: split sizes, captions, what was skipped, features computed/reused, time."""
    sp = manifest["splits"]
    sizes = " / ".join(f"{s} {sp[s]['images']:,}" if s in sp else f"{s} 0" for s in SPLITS)
    c = manifest["counts"]
    kinds = manifest.get("problems", {})
    skipped = ", ".join(f"{k} {n}" for k, n in kinds.items()) or "none"
    feats = (
        "pictures only (--pixels)"
        if manifest["build"]["pixels"]
        else f"features {manifest['cache']['features_computed']:,} computed, {manifest['cache']['features_reused']:,} reused"
    )
    out = utf8_text(str(out))  # printable whatever the folder's bytes
    return (
        f"dataset ready in {out}: pictures {sizes}, {c['captions']:,} captions; problems: {skipped}; {feats} "
        f"({manifest['timings_s']['total']:.1f} s); check it with: vse data check {out}"
    )


__all__ = [
    "BuildOptions",
    "Collected",
    "Item",
    "PictureRef",
    "Problem",
    "Picture",
    "build_own_dataset",
    "assign_ids",
    "assign_splits",
    "safe_id",
    "split_count",
    "split_name",
    "merge_duplicates",
    "normalise_caption",
    "unique_captions",
    "resolve_split",
    "screen_captions",
    "summary_line",
    "PICTURE_SUFFIXES",
    "SPLITS",
    # also importable from here, as before the builder was split (their owners: own_items, own_checks,
    # own_splits, own_output)
    "BAD_CAPTIONS",
    "BAD_NAME",
    "BROKEN_SHARD",
    "CHECK_CHUNK",
    "CHECK_VERSION",
    "DUPLICATE",
    "EMPTY_CAPTION",
    "EMPTY_FILE",
    "EVAL_ORDER",
    "FORMAT",
    "MANIFEST",
    "MARKER",
    "MISSING_FILE",
    "NAME",
    "NAME_CLASH",
    "NO_CAPTION",
    "PROBLEMS_FILE",
    "SKIPPING",
    "SPLIT_ALIASES",
    "SPLIT_CONFLICT",
    "SPLIT_FILES",
    "UNREADABLE",
    "check_out_dir",
    "check_picture",
    "report_problems",
]
