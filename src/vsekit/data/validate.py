"""Checks that run before training starts, so a bad file fails in seconds rather than an hour in.

`check_dataset` reads a whole precomp directory and returns one report naming every problem with its
file and line (text files, 1-based) or row (feature arrays, 0-based), instead of stopping at the first:
a dataset that arrives truncated or in the wrong layout should be fixed in one pass. Feature arrays are
scanned memory-mapped in chunks, so a 33 GB COCO file never has to fit in memory. Video splits
(`{split}_frames.npy` + `{split}_frame_offsets.npy`, `vsekit.data.frames`) get the same checks, with a bad
frame row traced to its clip through the offsets.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vsekit.data.frames import FRAMES_SUFFIX, OFFSETS_SUFFIX, RaggedFrames
from vsekit.data.precomp import MANIFEST, DataFormatError, dataset_image_root

FILE_KINDS = ("_caps.txt", "_ims.npy", FRAMES_SUFFIX, "_images.txt", "_cap2img.txt", "_ids.txt")
MAX_PER_KIND = 5  # problems of one kind in one file listed one by one; the rest are counted


def check_split_features(split, chunk_rows: int = 2048) -> None:
    """NaN/inf scan of a split's features, chunk by chunk (memory-mapped files stay on disk)."""
    feats = split.features
    if isinstance(feats, RaggedFrames):
        _check_frame_values(feats, split.root / f"{split.split}{FRAMES_SUFFIX}", chunk_rows)
    else:
        _check_image_values(feats, split.root / f"{split.split}_ims.npy", chunk_rows)
    for i, cap in enumerate(split.captions):
        if not cap.strip():
            raise DataFormatError(f"{split.root / f'{split.split}_caps.txt'}:{i + 1}: empty caption")


def _check_image_values(feats: np.ndarray, path: Path, chunk_rows: int) -> None:
    for start in range(0, feats.shape[0], chunk_rows):
        block = np.asarray(feats[start : start + chunk_rows])
        finite = np.isfinite(block)
        if not finite.all():
            row = start + int(np.argwhere(~finite.all(axis=(1, 2)))[0, 0])
            raise DataFormatError(f"{path}: image row {row} has NaN or inf features")


def _clip_of(offsets: np.ndarray, row: int) -> int:
    """The clip whose frames `offsets[c] : offsets[c + 1]` hold frame row `row` (offsets already checked)."""
    return int(np.searchsorted(offsets, row, side="right")) - 1


def _check_frame_values(feats: RaggedFrames, path: Path, chunk_rows: int) -> None:
    """RaggedFrames takes clip indices only: scan its (F, D) frame rows directly, name the clip of a bad one."""
    frames = feats.frames
    for start in range(0, frames.shape[0], chunk_rows):
        bad = ~np.isfinite(np.asarray(frames[start : start + chunk_rows])).all(axis=1)
        if bad.any():
            row = start + int(np.argmax(bad))
            clip = _clip_of(feats.offsets, row)
            raise DataFormatError(f"{path}: clip {clip} has NaN or inf features (frame row {row}, frame "
                                  f"{row - int(feats.offsets[clip])} of the clip)")  # fmt: skip


@dataclass
class Problem:
    """One finding: `where` is `:LINE` (1-based, text files), ` row R` (0-based, arrays) or empty."""

    severity: str  # error | warning
    path: str
    where: str
    message: str

    def __str__(self) -> str:
        return f"{self.severity}: {self.path}{self.where}: {self.message}"


@dataclass
class DatasetReport:
    """Everything `check_dataset` found; `ok` means no errors (warnings do not stop training)."""

    root: Path
    splits: dict[str, dict] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)

    @property
    def errors(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "error"]

    @property
    def warnings(self) -> list[Problem]:
        return [p for p in self.problems if p.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors

    def format(self) -> str:
        lines = [f"dataset {self.root}"]
        for name, s in self.splits.items():
            shape = "x".join(str(v) for v in s["feature_shape"]) if s.get("feature_shape") else "pictures only"
            if "clips" in s:  # a video split: feature_shape is (frames, dim)
                lengths = "min {} / median {:g} / max {}".format(*s["frames_per_clip"]) if s.get("frames_per_clip") else "?"
                lines.append(f"  {name}: {s['clips'] if s['clips'] is not None else '?'} clips, {s.get('captions', '?')} "
                             f"captions, frames x dim {shape}, frames per clip {lengths}")  # fmt: skip
            else:
                lines.append(f"  {name}: {s.get('images', '?')} images, {s.get('captions', '?')} captions, features {shape}")
        lines += [f"  {p}" for p in self.problems]
        verdict = "OK" if self.ok else "FAILED"
        lines.append(f"{verdict}: {len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        return "\n".join(lines)

    def raise_for_errors(self) -> None:
        """Raise one DataFormatError that lists every error (for the trainer)."""
        if self.errors:
            listed = "\n  ".join(str(p) for p in self.errors)
            raise DataFormatError(f"{self.root}: {len(self.errors)} problem(s); run `vse data check {self.root}`:\n  {listed}")


class _Collector:
    def __init__(self, report: DatasetReport) -> None:
        self.report = report
        self.counts: Counter = Counter()

    def add(self, severity: str, path: Path, where: str, message: str, kind: str | None = None) -> None:
        """Record a problem; only the first MAX_PER_KIND of each (file, kind) are listed one by one."""
        key = (str(path), kind or message)
        self.counts[key] += 1
        if self.counts[key] <= MAX_PER_KIND:
            self.report.problems.append(Problem(severity, str(path), where, message))

    def finish(self) -> None:
        for (path, kind), n in self.counts.items():
            if n > MAX_PER_KIND:
                sev = next(p.severity for p in self.report.problems if p.path == path)
                self.report.problems.append(Problem(sev, path, "", f"... and {n - MAX_PER_KIND} more like '{kind}'"))


def discover_splits(root: Path) -> list[str]:
    """Split names that have a captions, features or pictures file in `root` (sorted, train first)."""
    names = set()
    for p in root.iterdir():
        for suffix in ("_caps.txt", "_ims.npy", FRAMES_SUFFIX, "_images.txt"):
            if p.name.endswith(suffix) and len(p.name) > len(suffix):
                names.add(p.name[: -len(suffix)])
    return sorted(names, key=lambda s: (s != "train", s))


def _text_lines(path: Path, out: _Collector) -> list[str] | None:
    """Lines of a UTF-8 file; every undecodable line is reported (and replaced, so later checks still run)."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        out.add("error", path, "", f"cannot be read ({e})")
        return None
    parts = raw.split(b"\n")
    if parts and parts[-1] == b"":
        parts.pop()
    lines = []
    for lineno, b in enumerate(parts, 1):
        try:
            s = b.decode("utf-8")
        except UnicodeDecodeError as e:
            out.add("error", path, f":{lineno}", f"not UTF-8 (byte {e.start}: {b[e.start : e.start + 1]!r})", "not UTF-8")
            s = b.decode("utf-8", errors="replace")
        if "\x00" in s:
            out.add("error", path, f":{lineno}", "contains a NUL byte (binary file?)", "NUL byte")
        lines.append(s.rstrip("\r"))
    return lines


def _int_lines(path: Path, out: _Collector) -> np.ndarray | None:
    lines = _text_lines(path, out)
    if lines is None:
        return None
    values, bad = [], False
    for lineno, line in enumerate(lines, 1):
        try:
            values.append(int(line.strip()))
        except ValueError:
            out.add("error", path, f":{lineno}", f"expected one integer, got {line[:40]!r}", "expected one integer")
            bad = True
    return None if bad else np.asarray(values, dtype=np.int64)


def _open_features(path: Path, out: _Collector, layout: str = "(images, regions, dim)") -> np.ndarray | None:
    try:
        feats = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        out.add("error", path, "", f"not a readable .npy array, truncated or not plain numbers ({e})")
        return None
    if not isinstance(feats, np.ndarray):
        out.add("error", path, "", "not a single .npy array")
        return None
    if feats.ndim != layout.count(",") + 1:
        out.add("error", path, "", f"expected shape {layout}, got {feats.shape}")
        return None
    if feats.dtype not in (np.float16, np.float32):
        out.add("error", path, "", f"expected float16 or float32 features, got {feats.dtype}")
        return None
    if 0 in feats.shape:
        out.add("error", path, "", f"empty feature array {feats.shape}")
        return None
    return feats


def _scan_features(path: Path, feats: np.ndarray, out: _Collector, chunk_rows: int) -> None:
    """NaN/inf rows, found chunk by chunk; the first bad row and the count are reported."""
    first_bad, n_bad, n_zero = -1, 0, 0
    for start in range(0, feats.shape[0], chunk_rows):
        block = np.asarray(feats[start : start + chunk_rows])
        bad_rows = ~np.isfinite(block).all(axis=(1, 2))
        if bad_rows.any():
            if first_bad < 0:
                first_bad = start + int(np.argmax(bad_rows))
            n_bad += int(bad_rows.sum())
        n_zero += int((block == 0).all(axis=(1, 2)).sum())
    if n_bad:
        out.add("error", path, f" row {first_bad}", f"NaN or inf features ({n_bad} bad row(s) in all; first shown)")
    if n_zero:
        out.add("warning", path, "", f"{n_zero} row(s) are all zeros (failed feature extraction?)")


def _open_offsets(path: Path, frames_path: Path, n_frames: int | None, out: _Collector) -> tuple[np.ndarray | None, int | None]:
    """(offsets when they can map frame rows to clips, else None; the clip count when known) — every problem
    of `{split}_frame_offsets.npy` is reported; `where` is the 0-based index into the offsets array."""
    if not path.is_file():
        out.add("error", path, "", f"missing; {frames_path.name} needs it (N + 1 clip offsets into its frame rows)")
        return None, None
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        out.add("error", path, "", f"not a readable .npy array, truncated or not plain numbers ({e})")
        return None, None
    if not isinstance(arr, np.ndarray) or arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        what = f"{arr.dtype} {arr.shape}" if isinstance(arr, np.ndarray) else "not a single array"
        out.add("error", path, "", f"expected a 1-D integer array (N + 1 clip offsets), got {what}")
        return None, None
    return _check_offsets(path, frames_path, np.asarray(arr), n_frames, out)


def _check_offsets(path: Path, frames_path: Path, arr: np.ndarray, n_frames: int | None,
                   out: _Collector) -> tuple[np.ndarray | None, int | None]:  # fmt: skip
    if len(arr) < 2:
        out.add("error", path, "", f"needs at least 2 offsets (N + 1 for N clips), got {len(arr)}")
        return None, None
    off, n_clips, ok = arr.astype(np.int64), len(arr) - 1, True
    if off[0] != 0:
        out.add("error", path, " row 0", f"the first offset must be 0, got {off[0]}")
        ok = False
    if n_frames is not None and off[-1] != n_frames:
        out.add("error", path, f" row {n_clips}", f"the last offset is {off[-1]} but {frames_path.name} has {n_frames} "
                "frame rows")  # fmt: skip
        ok = False
    outside = np.nonzero((off < 0) | (off > (n_frames if n_frames is not None else np.iinfo(np.int64).max)))[0]
    if len(outside):
        i = int(outside[0])
        out.add("error", path, f" row {i}", f"offset {off[i]} outside 0..{n_frames} (frame rows of {frames_path.name}; "
                f"{len(outside)} such offset(s))")  # fmt: skip
        ok = False
    steps = np.diff(off)
    for bad, what in ((steps < 0, "decrease"), (steps == 0, "empty")):
        idx = np.nonzero(bad)[0]
        if len(idx):
            i = int(idx[0])
            msg = (f"offsets decrease at clip {i} ({off[i]} then {off[i + 1]}; they must increase); {len(idx)} such clip(s)"
                   if what == "decrease" else
                   f"clip {i} has no frames (offsets[{i}] = offsets[{i + 1}] = {off[i]}); {len(idx)} empty clip(s)")  # fmt: skip
            out.add("error", path, f" row {i}", msg)
            ok = False
    return (off if ok else None), n_clips


def _scan_frames(path: Path, frames: np.ndarray, offsets: np.ndarray | None, out: _Collector, chunk_rows: int) -> None:
    """NaN/inf and all-zero frame rows, chunk by chunk; a bad row is named with its clip when offsets are sound."""
    bad_rows, zero_rows = [], []
    for start in range(0, frames.shape[0], chunk_rows):
        block = np.asarray(frames[start : start + chunk_rows])
        bad_rows.append(start + np.nonzero(~np.isfinite(block).all(axis=1))[0])
        zero_rows.append(start + np.nonzero((block == 0).all(axis=1))[0])
    bad, zero = np.concatenate(bad_rows), np.concatenate(zero_rows)
    if len(bad):
        row = int(bad[0])
        if offsets is not None:
            clips = np.searchsorted(offsets, bad, side="right") - 1
            c = int(clips[0])
            out.add("error", path, f" row {row}", f"NaN or inf features in clip {c} (its frame {row - int(offsets[c])}); "
                    f"{len(bad)} bad frame row(s) in {len(np.unique(clips))} clip(s) in all, first shown")  # fmt: skip
        else:
            out.add("error", path, f" row {row}", f"NaN or inf features ({len(bad)} bad frame row(s) in all, first "
                    "shown; clips unknown while the offsets are broken)")  # fmt: skip
    if len(zero):
        where = ""
        if offsets is not None:
            where = f" in {len(np.unique(np.searchsorted(offsets, zero, side='right') - 1))} clip(s)"
        out.add("warning", path, "", f"{len(zero)} frame row(s){where} are all zeros (failed feature extraction?)")


def _check_frames(root: Path, split: str, chunk_rows: int, out: _Collector) -> tuple[dict, int | None]:
    """(report info, clip count) of a video split: frames (F, D) + offsets (N + 1,), every problem reported."""
    frames_path, offsets_path = root / f"{split}{FRAMES_SUFFIX}", root / f"{split}{OFFSETS_SUFFIX}"
    info: dict = {}
    frames = _open_features(frames_path, out, layout="(frames, dim)")
    if frames is not None:
        info["feature_shape"] = tuple(int(v) for v in frames.shape)
    offsets, n_clips = _open_offsets(offsets_path, frames_path, None if frames is None else int(frames.shape[0]), out)
    info["clips"] = n_clips  # None when the offsets cannot be read
    if offsets is not None:
        lengths = np.diff(offsets)
        info["frames_per_clip"] = (int(lengths.min()), float(np.median(lengths)), int(lengths.max()))
    if frames is not None:
        _scan_frames(frames_path, frames, offsets, out, chunk_rows)
    return info, n_clips


UNITS = {"image row": ("image rows", "image", "rows"), "clip": ("clips", "clip", "clips")}


def _check_layout(split: str, root: Path, n_rows: int, n_caps: int, k: int, out: _Collector,
                  unit: str = "image row") -> np.ndarray | None:  # fmt: skip
    """cap2img of the split (caption -> image or clip index), or None when the counts do not fit any layout."""
    plural, per, such = UNITS[unit]
    caps_file, c2i_file = root / f"{split}_caps.txt", root / f"{split}_cap2img.txt"
    if c2i_file.is_file():
        c2i = _int_lines(c2i_file, out)
        if c2i is None:
            return None
        if len(c2i) != n_caps:
            out.add("error", c2i_file, "", f"{len(c2i)} lines but {caps_file.name} has {n_caps} captions (one {unit} per caption)")
            return None
        bad = np.nonzero((c2i < 0) | (c2i >= n_rows))[0]
        for i in bad[:MAX_PER_KIND]:
            out.add("error", c2i_file, f":{i + 1}", f"{unit} {c2i[i]} outside 0..{n_rows - 1}", f"{unit} outside")
        if len(bad):
            return None
        missing = np.setdiff1d(np.arange(n_rows), c2i)
        if len(missing):
            out.add("error", c2i_file, "", f"{unit} {missing[0]} has no caption ({len(missing)} such {such})")
            return None
        return c2i
    if n_caps == n_rows * k:
        return np.arange(n_caps) // k
    if n_caps == n_rows and k > 1 and n_rows % k == 0:
        return np.arange(n_caps) // k
    out.add("error", caps_file, "", f"{n_caps} captions do not fit {n_rows} {plural} with {k} captions per {per}; "
            f"add {c2i_file.name} (one {unit} per caption) for a variable number of captions")  # fmt: skip
    return None


def _check_split(root: Path, split: str, k: int, max_words: int, chunk_rows: int, out: _Collector,
                 report: DatasetReport) -> dict:  # fmt: skip
    info: dict = {}
    caps_file, ims_file, paths_file = root / f"{split}_caps.txt", root / f"{split}_ims.npy", root / f"{split}_images.txt"
    frames_file, unit = root / f"{split}{FRAMES_SUFFIX}", "image row"
    feats, n_clips = None, None
    if frames_file.is_file():
        for other in (ims_file, root / f"{split}_ims_lengths.txt"):
            if other.is_file():
                out.add("error", other, "", f"a split holds either {other.name} or {frames_file.name} (clips of "
                        "frames), not both; remove one")  # fmt: skip
    if ims_file.is_file():
        feats = _open_features(ims_file, out)
        if feats is not None:
            info["feature_shape"] = tuple(int(v) for v in feats.shape[1:])
            _scan_features(ims_file, feats, out, chunk_rows)
    elif frames_file.is_file():
        frame_info, n_clips = _check_frames(root, split, chunk_rows, out)
        info.update(frame_info)
        report.splits.setdefault(split, {})["_frames"] = True
        unit = "clip"
    elif not paths_file.is_file():
        out.add("error", ims_file, "", f"missing (and no {frames_file.name} or {paths_file.name} either): split "
                f"{split!r} has no images or clips")  # fmt: skip
    paths = _text_lines(paths_file, out) if paths_file.is_file() else None
    if unit == "clip":
        n_rows = n_clips
    else:
        n_rows = int(feats.shape[0]) if feats is not None else (len(paths) if paths is not None and not ims_file.is_file() else None)
    captions = None
    if not caps_file.is_file():
        out.add("error", caps_file, "", "missing (expected one caption per line)")
    else:
        captions = _text_lines(caps_file, out)
        if captions is not None:
            info["captions"] = len(captions)
            if not captions:
                out.add("error", caps_file, "", "no captions")
            for lineno, cap in enumerate(captions, 1):
                if not cap.strip():
                    out.add("error", caps_file, f":{lineno}", "empty caption", "empty caption")
                elif len(cap.split()) > max_words:
                    out.add("warning", caps_file, f":{lineno}", f"{len(cap.split())} words (over {max_words}; truncated "
                            "by transformer text encoders)", "over-long caption")  # fmt: skip
    c2i = None
    if n_rows is not None and captions:
        c2i = _check_layout(split, root, n_rows, len(captions), k, out, unit)
    n_images = int(c2i.max()) + 1 if c2i is not None and len(c2i) else None
    if c2i is not None and unit == "image row":
        # the one-feature-row-per-caption layout has n_rows == n_caps but n_caps / k images
        info["images"] = n_images
    ids_file = root / f"{split}_ids.txt"
    image_ids: list[str] | None = None
    if ids_file.is_file() and c2i is not None:
        ids = [s.strip() for s in (_text_lines(ids_file, out) or [])]
        for lineno, s in enumerate(ids, 1):
            if not s:
                out.add("error", ids_file, f":{lineno}", "empty id", "empty id")
        if len(ids) == n_images:
            image_ids = ids
        elif len(ids) == len(c2i):
            first: dict[int, str] = {}
            for c, img in enumerate(c2i.tolist()):
                if first.setdefault(img, ids[c]) != ids[c]:
                    out.add("error", ids_file, f":{c + 1}", f"id {ids[c]!r} differs from {first[img]!r} given to another "
                            f"caption of the same image (row {img})", "id differs")  # fmt: skip
            image_ids = [first[i] for i in range(n_images or 0) if i in first]
        elif n_rows is not None and len(ids) == n_rows:
            image_ids = ids
        else:
            out.add("error", ids_file, "", f"{len(ids)} lines; expected one per image ({n_images}) or per caption ({len(c2i)})")
        if image_ids is not None and len(image_ids) == n_images:
            dup = [i for i, n in Counter(image_ids).items() if n > 1]
            if dup:
                out.add("warning", ids_file, "", f"{len(dup)} id(s) name more than one image, e.g. {dup[0]!r}")
    if paths is not None and n_rows is not None:
        expected = n_images if n_images is not None else n_rows
        if len(paths) not in (expected, n_rows):
            out.add("error", paths_file, "", f"{len(paths)} paths for {expected} images")
        _check_picture_paths(root, paths, paths_file, out)
    if image_ids is not None:
        report.splits.setdefault(split, {})["_ids"] = image_ids
    if paths is not None:
        report.splits.setdefault(split, {})["_paths"] = [p.strip() for p in paths]
    return info


def _check_picture_paths(root: Path, paths: list[str], paths_file: Path, out: _Collector) -> None:
    """Every picture path lies under the images root (the directory, or manifest.json's `images_root`) and
    exists there."""
    try:
        images_root = dataset_image_root(root)
        base = images_root.resolve()
    except DataFormatError as e:
        out.add("error", root / MANIFEST, "", str(e).removeprefix(f"{root / MANIFEST}: "))
        return
    except (OSError, RuntimeError, ValueError) as e:
        out.add("error", root / MANIFEST, "", f"images_root is not a usable path ({e})")
        return
    declared = images_root != root
    if declared and not base.is_dir():
        out.add("error", root / MANIFEST, "", f"images_root {str(images_root)!r}: no such folder (the pictures "
                f"of {paths_file.name} are looked up there)")  # fmt: skip
        return
    outside = (f"points outside the images root {base} ({MANIFEST} images_root)" if declared else
               "points outside the dataset directory")  # fmt: skip
    for lineno, p in enumerate(paths, 1):
        p = p.strip()
        if not p:
            out.add("error", paths_file, f":{lineno}", "empty path", "empty path")
            continue
        try:
            full = (images_root / p).resolve()
        except (ValueError, OSError, RuntimeError) as e:  # NUL bytes, loops
            out.add("error", paths_file, f":{lineno}", f"not a usable path ({e})", "not a usable path")
            continue
        if Path(p).is_absolute() or not full.is_relative_to(base):
            hint = "" if declared or not Path(p).is_absolute() else (
                f"; pictures outside the dataset directory need {MANIFEST} images_root (`vse data karpathy` "
                "writes it: convert the JSON again)")  # fmt: skip
            out.add("error", paths_file, f":{lineno}", f"{p!r} {outside}{hint}", "outside")
        elif not full.is_file():
            out.add("error", paths_file, f":{lineno}", f"{p!r}: no such picture", "no such picture")


def check_dataset(data_dir: str | Path, splits: list[str] | None = None, captions_per_image: int = 5,
                  max_caption_words: int = 200, chunk_rows: int = 2048) -> DatasetReport:  # fmt: skip
    """Check a precomp directory fully and report every problem with its file and line/row.

    Checks: files present; features a readable (N, R, D) float16/32 array without NaN/inf rows; captions
    UTF-8, non-empty, not over-long; caption/image counts fit `captions_per_image` or `{split}_cap2img.txt`;
    ids one per image or per caption and consistent; picture paths inside the images root (the directory, or
    manifest.json's `images_root`) and present;
    feature sizes equal across splits; no image shared between train and an evaluation split.
    """
    root = Path(data_dir)
    report = DatasetReport(root)
    out = _Collector(report)
    if not root.is_dir():
        out.add("error", root, "", "dataset directory does not exist")
        return report
    names = list(splits) if splits else discover_splits(root)
    if not names:
        out.add("error", root, "", f"no split files ({', '.join('SPLIT' + s for s in FILE_KINDS)})")
    manifest = root / "manifest.json"
    if manifest.is_file():
        import json

        try:
            json.loads(manifest.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            out.add("warning", manifest, "", f"not valid JSON ({e})")
    for split in names:
        info = _check_split(root, split, captions_per_image, max_caption_words, chunk_rows, out, report)
        report.splits[split] = {**report.splits.get(split, {}), **info}
    dims = {s: v["feature_shape"] for s, v in report.splits.items() if v.get("feature_shape")}
    if len({d[1] for d in dims.values()}) > 1:
        desc = ", ".join(f"{s} {d[1]}" for s, d in dims.items())
        out.add("error", root, "", f"feature size differs between splits ({desc}); a model fits one size")
    regions = {s: d for s, d in dims.items() if not report.splits[s].get("_frames")}  # clips' F always differs
    if len({d[0] for d in regions.values()}) > 1:
        desc = ", ".join(f"{s} {d[0]}" for s, d in regions.items())
        out.add("warning", root, "", f"regions per image differ between splits ({desc})")
    _check_overlap(report, out)
    for s in report.splits.values():
        s.pop("_ids", None)
        s.pop("_paths", None)
        s.pop("_frames", None)
    out.finish()
    return report


def _check_overlap(report: DatasetReport, out: _Collector) -> None:
    """An image (by id or picture path) in two splits: an error when one of them is train."""
    names = list(report.splits)
    for key, what in (("_ids", "id"), ("_paths", "picture")):
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                va, vb = report.splits[a].get(key), report.splits[b].get(key)
                if not va or not vb:
                    continue
                shared = sorted(set(va) & set(vb))
                if shared:
                    severity = "error" if "train" in (a, b) else "warning"
                    f = report.root / f"{b}_{'ids' if key == '_ids' else 'images'}.txt"
                    out.add(severity, f, "", f"{len(shared)} image {what}(s) also in split "
                            f"{a!r}, e.g. {shared[0]!r} (train/test leakage)" if severity == "error" else
                            f"{len(shared)} image {what}(s) also in split {a!r}, e.g. {shared[0]!r}")  # fmt: skip
