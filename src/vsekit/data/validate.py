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

from vsekit.data.findings import Findings
from vsekit.data.frames import RaggedFrames
from vsekit.data.manifest import MANIFEST, ManifestError, read_manifest
from vsekit.data.noise import check_noise_record, describe_noise, read_noise_record
from vsekit.data.precomp import (
    CAP2IMG,
    CAPS,
    FRAMES,
    IDS,
    IMAGES,
    IMS,
    SPLIT_MARKERS,
    DataFormatError,
    dataset_image_root,
    read_split_files,
    split_path,
)
from vsekit.data.text import CONTROL_CHARACTER, caption_problem
from vsekit.data.untrusted import OUTSIDE, UntrustedFileError, resolve_inside

FILE_KINDS = (CAPS, IMS, FRAMES, IMAGES, CAP2IMG, IDS)  # named when a folder holds no split
MAX_PER_KIND = 5  # problems of one kind in one file listed one by one; the rest are counted


def check_split_features(split, chunk_rows: int = 2048) -> None:
    """NaN/inf scan of a split's features, chunk by chunk (memory-mapped files stay on disk)."""
    feats = split.features
    if isinstance(feats, RaggedFrames):
        _check_frame_values(feats, split_path(split.root, split.split, FRAMES), chunk_rows)
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
            raise DataFormatError(
                f"{path}: clip {clip} has NaN or inf features (frame row {row}, frame "
                f"{row - int(feats.offsets[clip])} of the clip)"
            )


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
    notes: list[str] = field(default_factory=list)  # facts worth saying that are no problem (recorded noise)

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
            shape = (
                "x".join(str(v) for v in s["feature_shape"]) if s.get("feature_shape") else "pictures only"
            )
            if "clips" in s:  # a video split: feature_shape is (frames, dim)
                lengths = (
                    "min {} / median {:g} / max {}".format(*s["frames_per_clip"])
                    if s.get("frames_per_clip")
                    else "?"
                )
                lines.append(
                    f"  {name}: {s['clips'] if s['clips'] is not None else '?'} clips, {s.get('captions', '?')} "
                    f"captions, frames x dim {shape}, frames per clip {lengths}"
                )
            else:
                lines.append(
                    f"  {name}: {s.get('images', '?')} images, {s.get('captions', '?')} captions, features {shape}"
                )
        lines += [f"  {n}" for n in self.notes]
        lines += [f"  {p}" for p in self.problems]
        verdict = "OK" if self.ok else "FAILED"
        lines.append(f"{verdict}: {len(self.errors)} error(s), {len(self.warnings)} warning(s)")
        return "\n".join(lines)

    def raise_for_errors(self) -> None:
        """Raise one DataFormatError that lists every error (for the trainer)."""
        if self.errors:
            listed = "\n  ".join(str(p) for p in self.errors)
            raise DataFormatError(
                f"{self.root}: {len(self.errors)} problem(s); run `vse data check {self.root}`:\n  {listed}"
            )


class _Collector(Findings):
    """The layout rules of `vsekit.data.precomp` in collecting mode: every problem is recorded, none raises."""

    collecting = True

    def __init__(self, report: DatasetReport) -> None:
        super().__init__(DataFormatError)
        self.report = report
        self.counts: Counter = Counter()

    def error(self, path: Path | str, where: str, message: str, kind: str | None = None) -> None:
        self.add("error", Path(path), where, message, kind)

    def warning(self, path: Path | str, where: str, message: str, kind: str | None = None) -> None:
        self.add("warning", Path(path), where, message, kind)

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
                self.report.problems.append(
                    Problem(sev, path, "", f"... and {n - MAX_PER_KIND} more like '{kind}'")
                )


def discover_splits(root: Path) -> list[str]:
    """Split names that have a captions, features or pictures file in `root` (sorted, train first)."""
    names = set()
    for p in root.iterdir():
        for suffix in SPLIT_MARKERS:
            if p.name.endswith(suffix) and len(p.name) > len(suffix):
                names.add(p.name[: -len(suffix)])
    return sorted(names, key=lambda s: (s != "train", s))


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
        out.add(
            "error",
            path,
            f" row {first_bad}",
            f"NaN or inf features ({n_bad} bad row(s) in all; first shown)",
        )
    if n_zero:
        out.add("warning", path, "", f"{n_zero} row(s) are all zeros (failed feature extraction?)")


def _scan_frames(
    path: Path, frames: np.ndarray, offsets: np.ndarray | None, out: _Collector, chunk_rows: int
) -> None:
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
            out.add(
                "error",
                path,
                f" row {row}",
                f"NaN or inf features in clip {c} (its frame {row - int(offsets[c])}); "
                f"{len(bad)} bad frame row(s) in {len(np.unique(clips))} clip(s) in all, first shown",
            )
        else:
            out.add(
                "error",
                path,
                f" row {row}",
                f"NaN or inf features ({len(bad)} bad frame row(s) in all, first "
                "shown; clips unknown while the offsets are broken)",
            )
    if len(zero):
        where = ""
        if offsets is not None:
            where = f" in {len(np.unique(np.searchsorted(offsets, zero, side='right') - 1))} clip(s)"
        out.add(
            "warning", path, "", f"{len(zero)} frame row(s){where} are all zeros (failed feature extraction?)"
        )


def _check_split(
    root: Path, split: str, k: int, max_words: int, chunk_rows: int, out: _Collector, report: DatasetReport
) -> dict:
    """The layout rules of a load (`precomp.read_split_files`, collecting), then the content: NaN/inf and
    all-zero rows, each caption, empty and shared ids, the pictures named by `{split}_images.txt`."""
    files = read_split_files(root, split, k, out)
    info: dict = {}
    if files.unit == "clip":
        report.splits.setdefault(split, {})["_frames"] = True
        if files.frames is not None:
            info["feature_shape"] = tuple(int(v) for v in files.frames.shape)
        info["clips"] = files.n_rows  # None when the offsets cannot be read
        if files.offsets is not None:
            lengths = np.diff(files.offsets)
            info["frames_per_clip"] = (int(lengths.min()), float(np.median(lengths)), int(lengths.max()))
        if files.frames is not None:
            _scan_frames(split_path(root, split, FRAMES), files.frames, files.offsets, out, chunk_rows)
    elif files.features is not None and files.features.shape[1] > 0:
        info["feature_shape"] = tuple(int(v) for v in files.features.shape[1:])
        _scan_features(root / f"{split}_ims.npy", files.features, out, chunk_rows)
    caps_file = root / f"{split}_caps.txt"
    if files.captions is not None:
        info["captions"] = len(files.captions)
        for lineno, cap in enumerate(files.captions, 1):
            problem = caption_problem(cap)
            if not cap.strip():
                out.add("error", caps_file, f":{lineno}", "empty caption", "empty caption")
            elif problem is not None:
                kind, detail = problem
                error = kind == CONTROL_CHARACTER  # an over-long one trains: text encoders read its start
                out.add(
                    "error" if error else "warning",
                    caps_file,
                    f":{lineno}",
                    f"{kind}: {detail}" + ("" if error else "; text encoders read its start only"),
                    kind,
                )
            elif len(cap.split()) > max_words:
                out.add(
                    "warning",
                    caps_file,
                    f":{lineno}",
                    f"{len(cap.split())} words (over {max_words}; text encoders read the first ones only)",
                    "over-long caption",
                )
    if files.image_rows is not None and files.unit == "image row":
        # the one-feature-row-per-caption layout has n_rows == n_caps but n_caps / k images
        info["images"] = len(files.image_rows)
    ids_file = root / f"{split}_ids.txt"
    for lineno, s in enumerate(files.ids or [], 1):
        if not s:
            out.add("error", ids_file, f":{lineno}", "empty id", "empty id")
    if files.ids is not None and files.image_ids is not None:
        dup = [i for i, n in Counter(files.image_ids).items() if n > 1]
        if dup:
            out.add("warning", ids_file, "", f"{len(dup)} id(s) name more than one image, e.g. {dup[0]!r}")
        report.splits.setdefault(split, {})["_ids"] = files.image_ids
    if files.image_paths is not None:
        if files.n_rows is not None:
            _check_picture_paths(root, files.image_paths, root / f"{split}_images.txt", out)
        report.splits.setdefault(split, {})["_paths"] = files.image_paths
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
        out.add(
            "error",
            root / MANIFEST,
            "",
            f"images_root {str(images_root)!r}: no such folder (the pictures "
            f"of {paths_file.name} are looked up there)",
        )
        return
    outside = (
        f"points outside the images root {base} ({MANIFEST} images_root)"
        if declared
        else "points outside the dataset directory"
    )
    for lineno, p in enumerate(paths, 1):
        p = p.strip()
        if not p:
            out.add("error", paths_file, f":{lineno}", "empty path", "empty path")
            continue
        try:  # the one rule train, show and index apply (`untrusted.resolve_inside`)
            full = resolve_inside(images_root, p)
        except UntrustedFileError as e:
            if e.kind != OUTSIDE:  # NUL bytes, loops
                out.add("error", paths_file, f":{lineno}", e.detail, "not a usable path")
                continue
            hint = (
                ""
                if declared or not Path(p).is_absolute()
                else (
                    f"; pictures outside the dataset directory need {MANIFEST} images_root (`vse data karpathy` "
                    "writes it: convert the JSON again)"
                )
            )
            out.add("error", paths_file, f":{lineno}", f"{p!r} {outside}{hint}", "outside")
            continue
        if not full.is_file():
            out.add("error", paths_file, f":{lineno}", f"{p!r}: no such picture", "no such picture")


def check_dataset(
    data_dir: str | Path,
    splits: list[str] | None = None,
    captions_per_image: int = 5,
    max_caption_words: int = 200,
    chunk_rows: int = 2048,
) -> DatasetReport:
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
    try:
        read_manifest(root)
    except ManifestError as e:
        out.add("warning", e.path, "", e.detail)
    for split in names:
        info = _check_split(root, split, captions_per_image, max_caption_words, chunk_rows, out, report)
        report.splits[split] = {**report.splits.get(split, {}), **info}
    dims = {s: v["feature_shape"] for s, v in report.splits.items() if v.get("feature_shape")}
    if len({d[1] for d in dims.values()}) > 1:
        desc = ", ".join(f"{s} {d[1]}" for s, d in dims.items())
        out.add("error", root, "", f"feature size differs between splits ({desc}); a model fits one size")
    regions = {
        s: d for s, d in dims.items() if not report.splits[s].get("_frames")
    }  # clips' F always differs
    if len({d[0] for d in regions.values()}) > 1:
        desc = ", ".join(f"{s} {d[0]}" for s, d in regions.items())
        out.add("warning", root, "", f"regions per image differ between splits ({desc})")
    _check_overlap(report, out)
    _note_noise(root, report, out)
    for s in report.splits.values():
        s.pop("_ids", None)
        s.pop("_paths", None)
        s.pop("_frames", None)
    out.finish()
    return report


def _note_noise(root: Path, report: DatasetReport, out: _Collector) -> None:
    """Name the noise a dataset records (`vse data noise`) and check its ground truth against the split."""
    record = read_noise_record(root)
    if record is None:
        return
    report.notes.append(describe_noise(record))
    n_captions = report.splits.get(str(record.get("split")), {}).get("captions")
    for message in check_noise_record(root, record, n_captions):
        out.add("error", root / MANIFEST, "", message)


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
                    out.add(
                        severity,
                        f,
                        "",
                        f"{len(shared)} image {what}(s) also in split "
                        f"{a!r}, e.g. {shared[0]!r} (train/test leakage)"
                        if severity == "error"
                        else f"{len(shared)} image {what}(s) also in split {a!r}, e.g. {shared[0]!r}",
                    )
