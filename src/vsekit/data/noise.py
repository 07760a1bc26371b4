"""The noisy-correspondence protocol: one place that draws (or applies) mismatched training pairs, both kinds.

- **caption level** (NCR, IN2R): `m = int(rate * captions)` captions are chosen by a seeded shuffle and their
  image indices are shuffled among themselves; a caption that lands on its own image stays clean, so the
  realised rate is a little below the nominal one (`caption_level`).
- **image level** (RCL): `int(rate * images)` images are chosen and permuted among themselves; all captions of
  a moved image go wrong together (`image_level`).

Both draw from `numpy.random.RandomState(seed)`, which is what the releases' `np.random.seed(seed)` followed by
`np.random.shuffle` computes, so a seed gives the releases' arrays. `apply_index` takes a released index file
instead (NCR's caption-level `t2i`, RCL's image-level `noise_inx`), checked against the split's sizes.

`write_noisy_dataset` writes a dataset whose train split carries the noise as `train_cap2img.txt` (the pairing
file the precomp reader supports: caption text and features untouched), every other file a symbolic link to
the source's (COCO's features are 17 GB), and the ground truth: `train_noise_clean.npy` (True where a caption
still sits with its own image), `train_noise_index.npy` (the release-format index array, reusable with
`--from-file` and by the releases) and a `noise` record in `manifest.json` (`read_noise_record`).
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vsekit.data.manifest import MANIFEST, ManifestError, read_manifest, write_manifest
from vsekit.data.precomp import (
    CAP2IMG,
    IDS,
    IMS,
    dataset_image_root,
    load_precomp_split,
    split_path,
    write_precomp_split,
)
from vsekit.errors import VseInputError
from vsekit.utils.io import atomic_save_npy, open_npy

log = logging.getLogger(__name__)

LEVELS = ("caption", "image")
DEFAULT_LEVEL = "caption"  # NCR / IN2R, the protocol most published tables use
DEFAULT_SEED = 0  # IN2R's default; NCR's is random.randint(0, 100), RCL never seeds
NOISE_KEY = "noise"  # manifest.json's record
NOISY_SPLIT = "train"
CLEAN_FILE = "{split}_noise_clean.npy"
INDEX_FILE = "{split}_noise_index.npy"
SEED_MAX = 2**32 - 1  # numpy's RandomState takes 0 .. 2**32 - 1


class NoiseInputError(VseInputError):
    """A bad noise option or noise index file; the message names it."""


def check_rate(rate: float) -> float:
    """`rate` when it lies in [0, 1) (a share of the pairs to mismatch), else NoiseInputError naming --rate."""
    value = float(rate)
    if not 0.0 <= value < 1.0:  # also refuses nan
        raise NoiseInputError(f"--rate must lie in [0, 1), got {rate}")
    return value


def check_level(level: str) -> str:
    """`level` when it is caption or image, else NoiseInputError naming --level."""
    if level not in LEVELS:
        raise NoiseInputError(f"--level {level!r} is not a noise level; choose one of {', '.join(LEVELS)}")
    return level


def check_seed(seed: int) -> int:
    """`seed` when numpy's RandomState takes it, else NoiseInputError naming --seed."""
    if not 0 <= int(seed) <= SEED_MAX:
        raise NoiseInputError(f"--seed must lie in 0..{SEED_MAX}, got {seed}")
    return int(seed)


def caption_level(cap2img: np.ndarray, rate: float, seed: int) -> np.ndarray:
    """NCR/IN2R's noisy caption -> image map: shuffle the caption ids, take the first `int(rate * n)`, shuffle
    their image indices among them (each image keeps its number of captions)."""
    rng = np.random.RandomState(check_seed(seed))
    t2i = np.array(cap2img, dtype=np.int64)
    idx = np.arange(len(t2i))
    rng.shuffle(idx)
    m = int(check_rate(rate) * len(t2i))
    moved = t2i[idx[:m]]
    rng.shuffle(moved)
    t2i[idx[:m]] = moved
    return t2i


def image_level(n_images: int, rate: float, seed: int) -> np.ndarray:
    """RCL's `noise_inx`: image -> image it is replaced by; `int(rate * n)` images permuted among themselves."""
    rng = np.random.RandomState(check_seed(seed))
    noisy = np.arange(n_images, dtype=np.int64)
    inx = np.arange(n_images)
    rng.shuffle(inx)
    sel = inx[: int(check_rate(rate) * n_images)]
    moved = np.array(sel)
    rng.shuffle(moved)
    noisy[sel] = moved
    return noisy


@dataclass
class NoisyPairs:
    """A split's noisy pairing and its ground truth."""

    level: str
    cap2img: np.ndarray  # caption -> the image it is now paired with
    clean: np.ndarray  # bool per caption: still with its own image
    index: (
        np.ndarray
    )  # the release-format array: caption level t2i [captions], image level noise_inx [images]

    @property
    def realised_rate(self) -> float:
        return float(1.0 - self.clean.mean()) if len(self.clean) else 0.0


def draw(cap2img: np.ndarray, n_images: int, level: str, rate: float, seed: int) -> NoisyPairs:
    """Noisy pairs of a split drawn by the protocol of `level` (caption: NCR/IN2R, image: RCL)."""
    cap2img = np.asarray(cap2img, dtype=np.int64)
    if check_level(level) == "caption":
        index = caption_level(cap2img, rate, seed)
        noisy = index
    else:
        index = image_level(n_images, rate, seed)
        noisy = index[cap2img]
    return NoisyPairs(level, noisy, noisy == cap2img, index)


def apply_index(
    index: np.ndarray, cap2img: np.ndarray, n_images: int, level: str | None, where: str
) -> NoisyPairs:
    """Noisy pairs from a released index array: one image index per caption (caption level, NCR's files) or per
    image (image level, RCL's `noise_inx`); its length says which unless `level` is given. NoiseInputError
    naming `where` when it fits neither, points outside the images, or leaves an image without a caption."""
    cap2img = np.asarray(cap2img, dtype=np.int64)
    n_caps = len(cap2img)
    sizes = {"caption": n_caps, "image": n_images}
    if index.ndim != 1 or not np.issubdtype(index.dtype, np.integer):
        raise NoiseInputError(
            f"{where}: expected a 1-D integer array, got shape {tuple(index.shape)} dtype {index.dtype}"
        )
    if level is None:
        fits = [lv for lv in LEVELS if sizes[lv] == len(index)]
        level = fits[0] if fits else None
    elif sizes[check_level(level)] != len(index):
        level = None
    if level is None:
        raise NoiseInputError(
            f"{where}: {len(index)} entries, but the train split has {n_caps} captions (a caption-level file) "
            f"and {n_images} images (an image-level file)"
        )
    index = np.asarray(index, dtype=np.int64)
    if len(index) and (index.min() < 0 or index.max() >= n_images):
        raise NoiseInputError(
            f"{where}: image indices must lie in 0..{n_images - 1}, got {index.min()}..{index.max()}"
        )
    noisy = index if level == "caption" else index[cap2img]
    orphans = np.setdiff1d(np.arange(n_images), noisy)
    if len(orphans):
        raise NoiseInputError(
            f"{where}: leaves image {orphans[0]} without a caption ({len(orphans)} such images); a noise file "
            "moves pairs among themselves"
        )
    return NoisyPairs(level, noisy, noisy == cap2img, index)


def read_index_file(path: str | Path) -> np.ndarray:
    """A noise index `.npy` from elsewhere, read through the bounded reader (no pickles, header checked)."""
    path = Path(path)
    if not path.is_file():
        raise NoiseInputError(f"--from-file {path}: no such file")
    return np.asarray(open_npy(path, NoiseInputError))


def read_noise_record(root: str | Path) -> dict | None:
    """The `noise` record of a dataset's manifest.json, or None when it records no noise (or cannot be read)."""
    try:
        record = read_manifest(root).get(NOISE_KEY)
    except ManifestError:
        return None
    return record if isinstance(record, dict) else None


def check_noise_record(root: str | Path, record: dict, n_captions: int | None) -> list[str]:
    """Problems of a recorded ground truth (for `vse data check`): its clean-label file missing, unreadable, of
    another length than the split, or counting other than the record says."""
    root = Path(root)
    split = str(record.get("split", NOISY_SPLIT))
    path = root / str(record.get("clean_file", CLEAN_FILE.format(split=split)))
    if not path.is_file():
        return [f"{path}: missing (the ground truth manifest.json's 'noise' names)"]
    try:
        clean = np.asarray(open_npy(path, NoiseInputError))
    except NoiseInputError as e:
        return [str(e)]
    problems = []
    if clean.ndim != 1 or clean.dtype != np.bool_:
        return [f"{path}: expected one bool per caption, got shape {tuple(clean.shape)} dtype {clean.dtype}"]
    if n_captions is not None and len(clean) != n_captions:
        problems.append(f"{path}: {len(clean)} entries for {n_captions} {split} captions")
    if int((~clean).sum()) != record.get("mismatched"):
        problems.append(
            f"{path}: {int((~clean).sum())} mismatched captions, manifest.json says {record.get('mismatched')}"
        )
    return problems


def describe_noise(record: dict) -> str:
    """One line naming a dataset's recorded noise, for `vse data check`."""
    how = f"seed {record.get('seed')}" if record.get("from_file") is None else f"from {record['from_file']}"
    nominal = record.get("nominal_rate")
    nominal_text = "not given" if nominal is None else f"{100 * nominal:g}%"
    return (
        f"noise: split {record.get('split')!r} carries {record.get('level')}-level noise ({how}): "
        f"{record.get('mismatched')} of {record.get('captions')} captions mismatched, nominal rate "
        f"{nominal_text}, realised {100 * float(record.get('realised_rate', 0)):.2f}%; ground truth "
        f"{record.get('clean_file')}, index {record.get('index_file')}"
    )


def _check_out(src: Path, out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise NoiseInputError(
            f"--out {out}: exists and is not an empty folder; nothing was written: name a new one"
        )
    real_src, real_out = src.resolve(), out.resolve()
    if real_out == real_src or real_out.is_relative_to(real_src):
        raise NoiseInputError(f"--out {out}: lies inside the source dataset {src}; name a folder outside it")
    if not out.parent.is_dir():
        raise NoiseInputError(f"--out {out}: the folder {out.parent} does not exist")


def write_noisy_dataset(
    src: str | Path,
    out: str | Path,
    rate: float | None = None,
    level: str | None = None,
    seed: int = DEFAULT_SEED,
    from_file: str | Path | None = None,
    captions_per_image: int = 5,
) -> dict:
    """Write `out`: `src` with noisy train pairs (drawn with `rate`, `level`, `seed`, or applied from
    `from_file`), dev/test untouched, features linked, ground truth recorded; returns the record. Every check
    runs before anything is written; the folder appears whole (written beside it, then renamed) or not at all."""
    src, out = Path(src), Path(out)
    if not src.is_dir():
        raise NoiseInputError(f"{src}: dataset directory does not exist")
    if from_file is None and rate is None:
        raise NoiseInputError("--rate is required (or --from-file with a released noise index)")
    rate = None if rate is None else check_rate(rate)
    level = None if level is None else check_level(level)
    seed = check_seed(seed)
    if read_noise_record(src) is not None:
        raise NoiseInputError(
            f"{src}: already carries noise (manifest.json '{NOISE_KEY}'); start from the clean dataset"
        )
    _check_out(src, out)
    split = load_precomp_split(src, NOISY_SPLIT, captions_per_image)
    if not np.array_equal(split.image_rows, np.arange(len(split.image_rows))):
        raise NoiseInputError(
            f"{split_path(src, NOISY_SPLIT, IMS)}: one feature row per caption (image i is row k*i); the noisy "
            "copy needs one row per image"
        )
    if from_file is not None:
        pairs = apply_index(
            read_index_file(from_file), split.cap2img, split.n_images, level, f"--from-file {from_file}"
        )
    else:
        pairs = draw(split.cap2img, split.n_images, level or DEFAULT_LEVEL, rate, seed)
    clean_name, index_name = CLEAN_FILE.format(split=NOISY_SPLIT), INDEX_FILE.format(split=NOISY_SPLIT)
    record = {
        "split": NOISY_SPLIT,
        "level": pairs.level,
        "protocol": "NCR/IN2R caption shuffle" if pairs.level == "caption" else "RCL image permutation",
        "seed": None if from_file is not None else seed,
        "from_file": None if from_file is None else str(from_file),
        "nominal_rate": rate,
        "realised_rate": pairs.realised_rate,
        "captions": int(len(pairs.clean)),
        "mismatched": int((~pairs.clean).sum()),
        "source": str(src.resolve()),
        "clean_file": clean_name,
        "index_file": index_name,
    }
    manifest = _source_manifest(src)
    manifest["images_root"] = str(dataset_image_root(src).resolve())
    manifest[NOISE_KEY] = record
    ids_file = split_path(src, NOISY_SPLIT, IDS)
    rewrite_ids = split.image_ids is not None and ids_file.is_file()
    rewritten = {split_path(src, NOISY_SPLIT, CAP2IMG).name} | ({ids_file.name} if rewrite_ids else set())
    skip = {MANIFEST} | rewritten
    stage = out.parent / f".{out.name}.noise-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        for entry in sorted(src.iterdir()):
            if entry.name not in skip and entry.is_file():
                os.symlink(os.path.realpath(entry), stage / entry.name)
        # one id per image (`rewrite_ids`): per-caption ids would disagree under the new pairing
        write_precomp_split(
            stage,
            NOISY_SPLIT,
            cap2img=pairs.cap2img.tolist(),
            image_ids=split.image_ids if rewrite_ids else None,
        )
        atomic_save_npy(stage / clean_name, pairs.clean)
        atomic_save_npy(stage / index_name, pairs.index)
        write_manifest(stage, manifest)
        if out.is_dir():
            out.rmdir()  # empty (checked above)
        os.replace(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    log.debug("%s: %s", out, describe_noise(record))
    return record


def _source_manifest(src: Path) -> dict:
    """The source's manifest.json as a dict (its extractor spec etc. stay valid for the copy); {} if none."""
    try:
        return dict(read_manifest(src))
    except ManifestError:
        return {}
