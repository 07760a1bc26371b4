"""Convert the frame features video benchmarks publish into vsekit's ragged clip layout (`vsekit.data.frames`).

MSR-VTT and VATEX features come as one `(T, D)` array per video, stored one of three ways:

- a folder of `<video_id>.npy` files (`--format npy-dir`);
- one HDF5 file, one dataset per video id (`--format hdf5`): HGR (Chen et al., CVPR 2020) ships its
  frame-level features this way ("ordered_feature/SA": `{name: ft}`, `ft.shape = (num_frames, dim_ft)`),
  with a `/` in a name stored as `_`, which the lookup here tries too;
- an LMDB database (`--format lmdb`): key = the video id in UTF-8, value = either a whole `.npy` file's
  bytes (shape and dtype travel with it) or raw little-endian float32 bytes of the `(T, D)` array, which
  need `lmdb_dim` (`--lmdb-dim D`) to be cut into frames. The two are told apart by the `.npy` magic.

A leading axis of size 1 (`(1, T, D)`: one batch of one video, as some extractors save it) is dropped.

Captions come from MSR-VTT's `videodatainfo.json` (`{"videos": [{"video_id", "split"}], "sentences":
[{"video_id", "caption"}]}`), HGR's `ref_captions.json` (`{video_id: [caption, ...]}`), VATEX's
`vatex_*.json` (`[{"videoID", "enCap": [...]}]`) or a `video_id<TAB>caption` text file. Split membership
comes from the JSON's `split` field ("validate"/"val" become "dev") or from split files (`NAME:FILE`: one id
per line, a JSON list, or a `.npy` array of names such as HGR's `public_split/trn_names.npy`).

Everything is checked before the dataset appears: ids, shapes and dims from the files' metadata first
(seconds), then NaN/inf while the frames are copied into temp files, which are renamed into place only when
every split is complete (`vsekit.utils.io.atomic_path`); any error leaves the output directory as it was.
"""

from __future__ import annotations

import io
import json
import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vsekit.data.precomp import CLIP_SPLIT_FILES, FRAMES, IMAGES, IMS, IMS_LENGTHS, SplitWriter, writing_split
from vsekit.errors import MissingPackageError, VseInputError
from vsekit.utils.io import NPY_MAGIC, open_npy
from vsekit.utils.progress import progress_bar

logger = logging.getLogger(__name__)

FORMATS = ("auto", "npy-dir", "hdf5", "lmdb")
DTYPES = ("float32", "float16")
HDF5_SUFFIXES = (".h5", ".hdf5", ".hdf", ".he5")
HDF5_MAGIC = b"\x89HDF\r\n\x1a\n"
# the benchmarks' own split names -> vsekit's (the trainer validates on "dev")
SPLIT_ALIASES = {"validate": "dev", "val": "dev", "validation": "dev", "training": "train", "testing": "test"}
OUTPUT_SUFFIXES = CLIP_SPLIT_FILES
# files of the image layout that would contradict a frames split (removed by --overwrite once it is written)
CONFLICT_SUFFIXES = (IMS, IMS_LENGTHS, IMAGES)


class VideoConvertError(VseInputError):
    """A feature, caption or split file that cannot be converted; the message names the file and video id."""


# ---------------------------------------------------------------------------------------------- sources


class FrameSource:
    """Per-video `(T, D)` features by id. `meta` is cheap (headers only); `where` names file and key."""

    path: Path

    def meta(self, vid: str) -> tuple[tuple[int, ...], np.dtype] | None:
        raise NotImplementedError

    def read(self, vid: str) -> np.ndarray:
        raise NotImplementedError

    def where(self, vid: str) -> str:
        raise NotImplementedError

    def close(self) -> None:
        pass


def _file_key(vid: str) -> str:
    return vid.replace("/", "_")  # HGR's rule: a "/" in a name would be a folder (or an HDF5 group)


class NpyFolderSource(FrameSource):
    """`<folder>/<video_id>.npy`, each memory-mapped without unpickling."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _file(self, vid: str) -> Path:
        return self.path / f"{_file_key(vid)}.npy"

    def meta(self, vid: str) -> tuple[tuple[int, ...], np.dtype] | None:
        f = self._file(vid)
        if not f.is_file():
            return None
        arr = open_npy(f, VideoConvertError)
        return tuple(arr.shape), arr.dtype

    def read(self, vid: str) -> np.ndarray:
        return np.asarray(open_npy(self._file(vid), VideoConvertError))

    def where(self, vid: str) -> str:
        return str(self._file(vid))


def _require(module: str, pip_name: str, what: str):
    try:
        return __import__(module)
    except ImportError as e:
        raise MissingPackageError(f"{what} needs the {pip_name} package: pip install {pip_name} ({e})") from e


class Hdf5Source(FrameSource):
    """One dataset per video id at the file's top level (a `/` in the id tried as `_`, as HGR stores it)."""

    def __init__(self, path: Path) -> None:
        h5py = _require("h5py", "h5py", f"reading HDF5 features ({path})")
        self.path = path
        self._h5py = h5py
        try:
            self.file = h5py.File(path, "r")
        except OSError as e:
            raise VideoConvertError(f"{path}: not a readable HDF5 file ({e})") from e

    def _key(self, vid: str) -> str | None:
        for key in (vid, _file_key(vid)):
            if key and key in self.file:
                return key
        return None

    def meta(self, vid: str) -> tuple[tuple[int, ...], np.dtype] | None:
        key = self._key(vid)
        if key is None:
            return None
        node = self.file[key]
        if not isinstance(node, self._h5py.Dataset):
            raise VideoConvertError(f"{self.where(vid)}: a group, not a (frames, dim) dataset")
        return tuple(node.shape), node.dtype

    def read(self, vid: str) -> np.ndarray:
        return np.asarray(self.file[self._key(vid)][()])

    def where(self, vid: str) -> str:
        return f"{self.path}[{self._key(vid) or vid!r}]"

    def close(self) -> None:
        self.file.close()


class LmdbSource(FrameSource):
    """Key = video id (UTF-8); value = `.npy` bytes, or raw little-endian float32 cut into `dim`-wide frames."""

    def __init__(self, path: Path, dim: int | None) -> None:
        lmdb = _require("lmdb", "lmdb", f"reading LMDB features ({path})")
        self.path, self.dim = path, dim
        try:
            self.env = lmdb.open(str(path), readonly=True, lock=False, readahead=False, subdir=path.is_dir())
        except lmdb.Error as e:
            raise VideoConvertError(f"{path}: not a readable LMDB database ({e})") from e
        self.txn = self.env.begin(buffers=False)

    def _decode(self, vid: str, raw: bytes) -> np.ndarray:
        if raw.startswith(NPY_MAGIC):
            try:
                return np.load(io.BytesIO(raw), allow_pickle=False)
            except ValueError as e:
                raise VideoConvertError(f"{self.where(vid)}: not a plain numeric .npy value ({e})") from e
        if not self.dim:
            raise VideoConvertError(
                f"{self.where(vid)}: raw bytes (no .npy header) need the feature size to be "
                "cut into frames: pass --lmdb-dim D"
            )
        if len(raw) % (4 * self.dim):
            raise VideoConvertError(
                f"{self.where(vid)}: {len(raw)} bytes are not whole float32 frames of "
                f"--lmdb-dim {self.dim} ({4 * self.dim} bytes each)"
            )
        return np.frombuffer(raw, dtype="<f4").reshape(-1, self.dim)

    def meta(self, vid: str) -> tuple[tuple[int, ...], np.dtype] | None:
        raw = self.txn.get(vid.encode("utf-8"))
        if raw is None:
            return None
        arr = self._decode(vid, raw)
        return tuple(arr.shape), arr.dtype

    def read(self, vid: str) -> np.ndarray:
        return self._decode(vid, self.txn.get(vid.encode("utf-8")))

    def where(self, vid: str) -> str:
        return f"{self.path}[{vid!r}]"

    def close(self) -> None:
        self.txn.abort()
        self.env.close()


def detect_format(path: Path) -> str:
    """`npy-dir`, `hdf5` or `lmdb` from what `path` is (a folder with data.mdb is LMDB)."""
    if path.is_dir():
        return "lmdb" if (path / "data.mdb").is_file() else "npy-dir"
    if not path.is_file():
        raise VideoConvertError(
            f"{path}: features not found (a folder of <video_id>.npy, an HDF5 file or an LMDB)"
        )
    if path.suffix.lower() in HDF5_SUFFIXES:
        return "hdf5"
    with open(path, "rb") as f:
        if f.read(8) == HDF5_MAGIC:
            return "hdf5"
    if path.suffix.lower() == ".mdb":
        return "lmdb"
    raise VideoConvertError(
        f"{path}: cannot tell the feature format; pass --format ({', '.join(FORMATS[1:])})"
    )


def open_source(path: str | Path, fmt: str = "auto", lmdb_dim: int | None = None) -> FrameSource:
    path = Path(path)
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "npy-dir":
        if not path.is_dir():
            raise VideoConvertError(f"{path}: not a folder (--format npy-dir reads <folder>/<video_id>.npy)")
        return NpyFolderSource(path)
    if not path.exists():
        raise VideoConvertError(f"{path}: features not found")
    if fmt == "hdf5":
        return Hdf5Source(path)
    if fmt == "lmdb":
        return LmdbSource(path, lmdb_dim)
    raise VideoConvertError(f"unknown feature format {fmt!r}; choose one of {', '.join(FORMATS)}")


# --------------------------------------------------------------------------------------------- captions


@dataclass
class Annotations:
    """Captions per video id (file order) and, when the captions JSON says so, split -> ordered ids."""

    captions: dict[str, list[str]]
    caption_file: dict[str, Path]  # video id -> the file its captions came from (for error messages)
    splits: dict[str, list[str]]


def _clean_caption(text: object, path: Path, vid: str) -> str:
    if not isinstance(text, str):
        raise VideoConvertError(f"{path}: video {vid!r} has a caption that is not text ({text!r:.60})")
    cap = " ".join(text.split())  # one caption per line in {split}_caps.txt: no newlines or tabs inside
    if not cap:
        raise VideoConvertError(f"{path}: video {vid!r} has an empty caption")
    return cap


def _msrvtt_json(data: dict, path: Path) -> tuple[list[tuple[str, object]], dict[str, list[str]]]:
    pairs = []
    for i, s in enumerate(data["sentences"]):
        if not isinstance(s, dict) or "video_id" not in s or "caption" not in s:
            raise VideoConvertError(f'{path}: sentences[{i}] needs "video_id" and "caption", got {s!r:.80}')
        pairs.append((str(s["video_id"]), s["caption"]))
    splits: dict[str, list[str]] = {}
    for i, v in enumerate(data.get("videos", [])):
        if not isinstance(v, dict) or "video_id" not in v:
            raise VideoConvertError(f'{path}: videos[{i}] needs "video_id", got {v!r:.80}')
        if "split" in v:
            name = SPLIT_ALIASES.get(str(v["split"]), str(v["split"]))
            splits.setdefault(name, []).append(str(v["video_id"]))
    return pairs, splits


def _json_pairs(path: Path) -> tuple[list[tuple[str, object]], dict[str, list[str]]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise VideoConvertError(f"{path}: not valid UTF-8 JSON ({e})") from e
    if isinstance(data, dict) and "sentences" in data:  # MSR-VTT videodatainfo.json
        return _msrvtt_json(data, path)
    if isinstance(data, list) and all(isinstance(v, dict) and "videoID" in v for v in data):  # VATEX
        pairs = []
        for v in data:
            caps = v.get("enCap")
            if not isinstance(caps, list):
                raise VideoConvertError(
                    f'{path}: video {v["videoID"]!r} has no "enCap" list of English captions'
                )
            pairs += [(str(v["videoID"]), c) for c in caps]
        return pairs, {}
    if isinstance(data, dict) and all(isinstance(c, list) for c in data.values()):  # HGR ref_captions.json
        return [(str(vid), c) for vid, caps in data.items() for c in caps], {}
    raise VideoConvertError(
        f'{path}: not a captions JSON vsekit knows: expected MSR-VTT\'s {{"sentences": '
        '[{"video_id", "caption"}]}, HGR\'s {video_id: [captions]} or VATEX\'s '
        '[{"videoID", "enCap"}]'
    )


def _tsv_pairs(path: Path) -> list[tuple[str, object]]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise VideoConvertError(f"{path}: not UTF-8 text ({e})") from e
    pairs = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        vid, tab, cap = line.partition("\t")
        if not tab or not vid.strip():
            raise VideoConvertError(f"{path}:{lineno}: expected 'video_id<TAB>caption', got {line[:60]!r}")
        pairs.append((vid.strip(), cap))
    return pairs


def read_annotations(paths: list[str | Path]) -> Annotations:
    """Captions (and JSON split fields) of every file, merged; a file that does not parse names itself."""
    ann = Annotations({}, {}, {})
    for p in map(Path, paths):
        if not p.is_file():
            raise VideoConvertError(f"{p}: captions file not found")
        pairs, splits = _json_pairs(p) if p.suffix.lower() == ".json" else (_tsv_pairs(p), {})
        if not pairs:
            raise VideoConvertError(f"{p}: no captions")
        for vid, cap in pairs:
            ann.captions.setdefault(vid, []).append(_clean_caption(cap, p, vid))
            ann.caption_file.setdefault(vid, p)
        for name, ids in splits.items():
            ann.splits.setdefault(name, []).extend(ids)
    return ann


# ---------------------------------------------------------------------------------------------- splits


def parse_split_file(spec: str) -> tuple[str, Path]:
    """`NAME:FILE` -> (NAME, FILE); NAME becomes the file prefix, so only [A-Za-z0-9_.-] is allowed."""
    name, sep, file = spec.partition(":")
    if not sep or not file or not re.fullmatch(r"[A-Za-z0-9_.-]+", name):
        raise VideoConvertError(
            f"--split-file {spec!r}: expected NAME:FILE, e.g. train:train_list.txt "
            "(NAME of letters, digits, _ . -)"
        )
    return name, Path(file)


def read_split_ids(path: Path) -> list[str]:
    """Ids of a split file: a `.npy` array of names (HGR), a JSON list, or one id per line."""
    if not path.is_file():
        raise VideoConvertError(f"{path}: split file not found")
    if path.suffix.lower() == ".npy":
        arr = open_npy(path, VideoConvertError)
        if arr.ndim != 1 or arr.dtype.kind not in "US":
            raise VideoConvertError(
                f"{path}: expected a 1-D array of video ids (strings), got {arr.dtype} {arr.shape}"
            )
        ids = [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in arr.tolist()]
    elif path.suffix.lower() == ".json":
        try:
            ids = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise VideoConvertError(f"{path}: not valid UTF-8 JSON ({e})") from e
        if not isinstance(ids, list) or not all(isinstance(v, str) for v in ids):
            raise VideoConvertError(f"{path}: expected a JSON list of video ids")
    else:
        ids = path.read_text(encoding="utf-8").splitlines()
    ids = [v.strip() for v in ids if v.strip()]
    if not ids:
        raise VideoConvertError(f"{path}: no video ids")
    return ids


@dataclass
class SplitPlan:
    """One split to write: its clips in order, with their captions and where the membership came from."""

    name: str
    ids: list[str]
    source: str  # the split file, or the captions JSON's "split" field


def plan_splits(ann: Annotations, split_files: list[str] | None, only: list[str] | None) -> list[SplitPlan]:
    """Split membership (split files win over the JSON's split field), checked: no duplicates, no id in two
    splits, every id captioned."""
    if split_files:
        plans = []
        for spec in split_files:
            name, path = parse_split_file(spec)
            plans.append(SplitPlan(name, read_split_ids(path), str(path)))
    else:
        files = sorted({str(p) for p in ann.caption_file.values()})
        plans = [
            SplitPlan(n, ids, f'the "split" field of {", ".join(files)}') for n, ids in ann.splits.items()
        ]
    if not plans:
        raise VideoConvertError(
            'no split membership: the captions file has no "split" field; pass '
            "--split-file NAME:FILE (one video id per line) for each split"
        )
    if only:
        missing = sorted(set(only) - {p.name for p in plans})
        if missing:
            raise VideoConvertError(
                f"--splits {missing[0]!r}: no such split (have {', '.join(p.name for p in plans)})"
            )
        plans = [p for p in plans if p.name in only]
    names = [p.name for p in plans]
    if len(set(names)) != len(names):
        raise VideoConvertError(f"split {next(n for n in names if names.count(n) > 1)!r} is given twice")
    _check_membership(plans, ann)
    return plans


def _check_membership(plans: list[SplitPlan], ann: Annotations) -> None:
    owner: dict[str, SplitPlan] = {}
    for plan in plans:
        for vid in plan.ids:
            if vid in owner:
                other = owner[vid]
                where = (
                    "twice in split"
                    if other is plan
                    else f"in split {other.name!r} ({other.source}) and in split"
                )
                raise VideoConvertError(f"{plan.source}: video {vid!r} is {where} {plan.name!r}")
            owner[vid] = plan
            if vid not in ann.captions:
                raise VideoConvertError(
                    f"{plan.source}: video {vid!r} (split {plan.name!r}) has no captions in "
                    f"{', '.join(sorted({str(p) for p in ann.caption_file.values()}))}"
                )
    unused = len(set(ann.captions) - set(owner))
    if unused:
        logger.info(
            "%d captioned video(s) are in none of the splits %s; left out", unused, [p.name for p in plans]
        )


# ------------------------------------------------------------------------------------------- conversion


def _check_out(out: Path, names: list[str], overwrite: bool) -> list[Path]:
    """Refuse to replace a dataset without --overwrite; returns the image-layout files --overwrite removes."""
    if out.exists() and not out.is_dir():
        raise VideoConvertError(f"{out}: exists and is not a folder; choose another --out")
    existing = [out / f"{n}{s}" for n in names for s in OUTPUT_SUFFIXES + CONFLICT_SUFFIXES]
    existing = [p for p in existing if p.exists()]
    if existing and not overwrite:
        raise VideoConvertError(
            f"{existing[0]}: exists ({len(existing)} file(s) of splits {', '.join(names)} in "
            f"{out}); nothing was written: choose another --out or pass --overwrite"
        )
    return [p for p in existing if p.name.endswith(CONFLICT_SUFFIXES)]


def _frame_counts(source: FrameSource, plans: list[SplitPlan]) -> tuple[dict[str, np.ndarray], int]:
    """Frames per clip of every split, and the one feature size, from metadata alone (no frames read)."""
    counts, dim, first = {}, None, ""
    for plan in plans:
        lengths = np.zeros(len(plan.ids), dtype=np.int64)
        for i, vid in enumerate(plan.ids):
            meta = source.meta(vid)
            if meta is None:
                raise VideoConvertError(
                    f"{source.path}: no features for video {vid!r} (split {plan.name!r}, from {plan.source})"
                )
            shape, dtype = meta
            shape = shape[1:] if len(shape) == 3 and shape[0] == 1 else shape  # one batch of one video
            where = source.where(vid)
            if len(shape) != 2:
                hint = (
                    " (one vector per video: mean-pooled? this layout needs frame-level features)"
                    if len(shape) == 1
                    else ""
                )
                raise VideoConvertError(f"{where}: expected (frames, dim) features, got shape {shape}{hint}")
            if np.dtype(dtype).kind not in "fiu":
                raise VideoConvertError(f"{where}: features must be numbers, got dtype {dtype}")
            if shape[0] == 0 or shape[1] == 0:
                what = "no frames" if shape[0] == 0 else "frames of width 0"
                raise VideoConvertError(f"{where}: video {vid!r} has {what} (shape {shape})")
            if dim is None:
                dim, first = int(shape[1]), where
            elif shape[1] != dim:
                raise VideoConvertError(
                    f"{where}: frames are {shape[1]} wide but {first} has {dim}; "
                    "every video needs the same feature size"
                )
            lengths[i] = shape[0]
        counts[plan.name] = lengths
    return counts, int(dim)


def _copy_frames(
    source: FrameSource, plan: SplitPlan, lengths: np.ndarray, split: SplitWriter, dtype: np.dtype, bar
) -> None:
    """Fill the split's `(F, D)` frames clip by clip, refusing NaN/inf (also from a float16 overflow)."""
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    out = None
    for i, vid in enumerate(plan.ids):
        clip = source.read(vid)
        clip = clip[0] if clip.ndim == 3 and clip.shape[0] == 1 else clip
        if clip.shape[0] != lengths[i]:
            raise VideoConvertError(
                f"{source.where(vid)}: {clip.shape[0]} frames read but its header said {lengths[i]}"
            )
        if out is None:
            out = split.memmap(FRAMES, (int(offsets[-1]), clip.shape[1]), dtype)
        with np.errstate(over="ignore"):  # an overflow to inf is reported below, with the video and frame
            block = clip.astype(dtype, copy=False)
        bad = ~np.isfinite(block).all(axis=1)
        if bad.any():
            t = int(np.argmax(bad))
            why = (
                "is too large for float16 (use --dtype float32)"
                if np.isfinite(clip[t]).all()
                else "has NaN or inf features"
            )
            raise VideoConvertError(
                f"{source.where(vid)}: video {vid!r} frame {t} {why} ({int(bad.sum())} bad frame(s))"
            )
        out[offsets[i] : offsets[i + 1]] = block
        bar.update(1)


def convert_video(
    features: str | Path,
    captions: list[str | Path],
    out: str | Path,
    *,
    fmt: str = "auto",
    split_files: list[str] | None = None,
    splits: list[str] | None = None,
    dtype: str = "float32",
    lmdb_dim: int | None = None,
    overwrite: bool = False,
    progress: bool = True,
) -> dict[str, dict]:
    """Write `{split}_frames.npy`, `_frame_offsets.npy`, `_caps.txt`, `_cap2img.txt`, `_ids.txt` for each split.

    Returns per split: clips, captions, frames, dim and the min/median/max frames per clip.
    """
    if dtype not in DTYPES:
        raise VideoConvertError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    out = Path(out)
    ann = read_annotations(list(captions))
    plans = plan_splits(ann, split_files, splits)
    stale = _check_out(out, [p.name for p in plans], overwrite)
    source = open_source(features, fmt, lmdb_dim)
    created = not out.exists()
    try:
        counts, dim = _frame_counts(source, plans)
        summary = _write_splits(source, plans, ann, counts, out, np.dtype(dtype), progress)
    except BaseException:
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # leave no trace of a failed conversion
        raise
    finally:
        source.close()
    for p in stale:
        p.unlink()
        logger.info("removed %s (the split now holds frames)", p)
    for name, s in summary.items():
        s["dim"] = dim
        logger.info("%s: %d clips, %d captions, %d frames", name, s["clips"], s["captions"], s["frames"])
    return summary


def _write_splits(
    source: FrameSource,
    plans: list[SplitPlan],
    ann: Annotations,
    counts: dict[str, np.ndarray],
    out: Path,
    dtype: np.dtype,
    progress: bool,
) -> dict[str, dict]:
    """Every file of every split into temp files; all are renamed into place only when all are written."""
    summary: dict[str, dict] = {}
    out.mkdir(parents=True, exist_ok=True)
    bar = progress_bar(
        total=sum(len(p.ids) for p in plans), desc="convert-video", unit="clip", enabled=progress
    )
    with ExitStack() as stack:
        stack.callback(bar.close)
        for plan in plans:
            lengths = counts[plan.name]
            caps = [(row, c) for row, vid in enumerate(plan.ids) for c in ann.captions[vid]]
            split = stack.enter_context(writing_split(out, plan.name, stack))
            _copy_frames(source, plan, lengths, split, dtype, bar)
            split.offsets(lengths)
            split.captions(c for _, c in caps)
            split.cap2img(row for row, _ in caps)
            split.ids(plan.ids)
            summary[plan.name] = {
                "clips": len(plan.ids),
                "captions": len(caps),
                "frames": int(lengths.sum()),
                "frames_per_clip": (int(lengths.min()), float(np.median(lengths)), int(lengths.max())),
            }
    return summary
