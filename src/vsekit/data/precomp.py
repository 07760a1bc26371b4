"""Reader and the one writer of the SCAN "precomp" layout and vsekit's variable-captions extension: every
builder, library and lab, writes split files through `writing_split` / `write_precomp_split` / `write_frames`
and names them by the suffixes defined here (`SPLIT_FILES`).

Files of one split in a dataset directory:
- `{split}_ims.npy`   (N, R, D) float16/float32 features, opened memory-mapped (COCO train is 33 GB);
- `{split}_caps.txt`  one caption per line;
- `{split}_ids.txt`   optional image ids: one line per image, or one per caption (repeated ids);
- `{split}_cap2img.txt` optional (vsekit extension): one 0-based image row per caption; without it,
  captions `k*i .. k*i+k-1` belong to image `i` (k = captions_per_image, 5 for COCO / Flickr30K);
- `{split}_images.txt` optional: one image path per image row, relative to the dataset's images root, which
  lets a model trained on features index the raw pictures. The images root is the directory itself unless
  `manifest.json` declares `images_root` (absolute, or relative to the directory; `vse data karpathy`
  writes it); a path that resolves outside the images root is refused.
- video: `{split}_frames.npy` + `{split}_frame_offsets.npy` instead of `{split}_ims.npy` (clips with
  different frame counts; `vsekit.data.frames`): each clip is one "image" row.

Some published files store one image row per caption (the Kaggle F30K dev file has 5,070 rows): when the
row count equals the caption count, image i is row k*i, exactly as the reference loaders' `im_div` does.
COCO: `testall` is the 5K test (use fold-5 for the 1K numbers), `test` its first 1K fold, `dev` is
truncated to 1,000 images for validation by the trainer.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vsekit.data.findings import Findings
from vsekit.data.frames import (
    FRAMES_SUFFIX,
    OFFSETS_SUFFIX,
    RaggedFrames,
    frame_array,
    frame_offsets,
    frames_files,
)
from vsekit.data.manifest import ManifestError, manifest_path, read_manifest
from vsekit.data.untrusted import UntrustedFileError, resolve_inside
from vsekit.errors import VseInputError
from vsekit.utils.io import open_npy

log = logging.getLogger(__name__)

# the files of one split, `{split}{suffix}`: named here once, for every reader, writer, cleaner and check
IMS = "_ims.npy"
IMS_LENGTHS = "_ims_lengths.txt"
CAPS = "_caps.txt"
CAP2IMG = "_cap2img.txt"
IDS = "_ids.txt"
IMAGES = "_images.txt"
FRAMES = FRAMES_SUFFIX  # the frames layout (`vsekit.data.frames`)
OFFSETS = OFFSETS_SUFFIX
TEXT_FILES = (CAPS, CAP2IMG, IDS, IMAGES, IMS_LENGTHS)
ARRAY_FILES = (IMS, FRAMES, OFFSETS)
IMAGE_SPLIT_FILES = (IMS, CAPS, CAP2IMG, IDS, IMAGES)  # an image split, as the builders write it
CLIP_SPLIT_FILES = (FRAMES, OFFSETS, CAPS, CAP2IMG, IDS)  # a clip split (frames layout)
SPLIT_FILES = (IMS, IMS_LENGTHS, FRAMES, OFFSETS, CAPS, CAP2IMG, IDS, IMAGES)  # every file a split may hold
SPLIT_MARKERS = (CAPS, IMS, FRAMES, IMAGES)  # a file of one of these says a split exists (`splits_in`)


def split_path(root: str | Path, split: str, suffix: str) -> Path:
    """The path of `split`'s `suffix` file (one of SPLIT_FILES) in dataset folder `root`."""
    return Path(root) / f"{split}{suffix}"


def splits_with(root: str | Path, suffix: str) -> list[str]:
    """The sorted names of the splits in `root` that have a `suffix` file."""
    return sorted(p.name[: -len(suffix)] for p in Path(root).glob(f"*{suffix}") if len(p.name) > len(suffix))


class DataFormatError(VseInputError):
    """A dataset file that does not fit the layout; the message names the file and the problem."""


FIRST_ERROR = Findings(DataFormatError)  # loading: the first problem raises, naming its file and line


def text_lines(path: Path, found: Findings = FIRST_ERROR, nul: bool = False) -> list[str] | None:
    """The lines of a UTF-8 text file, as Python's text mode reads them (\\n, \\r\\n or \\r ends a line; a
    final line end adds no empty line). A line that is not UTF-8 is reported with its number (and, collecting,
    decoded with replacement characters so later rules still run); with `nul`, so is a line holding a NUL byte.
    None (collecting) when the file cannot be read at all; loading lets the OSError through."""
    try:
        raw = path.read_bytes()
    except OSError as e:
        if not found.collecting:
            raise
        found.error(path, "", f"cannot be read ({e})")
        return None
    try:
        lines = raw.decode("utf-8").replace("\r\n", "\n").replace("\r", "\n").split("\n")
    except UnicodeDecodeError:
        lines = []
        for lineno, b in enumerate(raw.replace(b"\r\n", b"\n").replace(b"\r", b"\n").split(b"\n"), 1):
            try:
                lines.append(b.decode("utf-8"))
            except UnicodeDecodeError as e:
                found.error(
                    path,
                    f":{lineno}",
                    f"not UTF-8 (byte {e.start}: {b[e.start : e.start + 1]!r})",
                    "not UTF-8",
                )
                lines.append(b.decode("utf-8", errors="replace"))
    if lines and lines[-1] == "":
        lines.pop()
    if nul:
        for lineno, line in enumerate(lines, 1):
            if "\x00" in line:
                found.error(path, f":{lineno}", "contains a NUL byte (binary file?)", "NUL byte")
    return lines


def read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 text file; DataFormatError naming the first line that is not UTF-8."""
    return text_lines(path)


def int_lines(path: Path, found: Findings = FIRST_ERROR) -> np.ndarray | None:
    """One integer per line (int64), every line that is not one reported; None when any is not."""
    lines = text_lines(path, found)
    if lines is None:
        return None
    values, bad = [], False
    for lineno, line in enumerate(lines, 1):
        try:
            values.append(int(line.strip()))
        except ValueError:
            found.error(
                path, f":{lineno}", f"expected one integer, got {line[:40]!r}", "expected one integer"
            )
            bad = True
    return None if bad else np.asarray(values, dtype=np.int64)


def read_int_lines(path: Path) -> np.ndarray:
    """One integer per line; DataFormatError naming the first line that is not one."""
    return int_lines(path)


@dataclass
class PrecompSplit:
    """One split: memory-mapped features plus the caption -> image map."""

    root: Path
    split: str
    features: np.ndarray  # (rows, R, D), memory-mapped; for clips a RaggedFrames with the same face
    captions: list[str]
    cap2img: np.ndarray  # caption -> image index (0..n_images-1)
    image_rows: np.ndarray  # image index -> row of `features`
    image_ids: list[str]
    image_paths: list[str] | None
    # optional `{split}_ims_lengths.txt`: real rows per feature row (the rest is zero padding), for sets of
    # different sizes (e.g. a variable number of detected regions); None = every row of R is real
    set_sizes: np.ndarray | None = None
    # folder the paths of `{split}_images.txt` are relative to (`dataset_image_root`); None = `root`
    image_root: Path | None = None

    @property
    def images_root(self) -> Path:
        return self.image_root if self.image_root is not None else self.root

    @property
    def n_images(self) -> int:
        return len(self.image_rows)

    @property
    def n_captions(self) -> int:
        return len(self.captions)

    @property
    def feature_shape(self) -> tuple[int, int]:
        return int(self.features.shape[1]), int(self.features.shape[2])

    @property
    def has_features(self) -> bool:
        return self.features.shape[1] > 0

    def require_features(self) -> None:
        """Raise a clear error when a split has pictures but no `{split}_ims.npy`."""
        if not self.has_features:
            raise DataFormatError(
                f"{self.root / f'{self.split}_ims.npy'}: missing; this split has pictures only "
                f"({self.split}_images.txt), so train a backbone recipe (e.g. vse_infty_grid_e2e) or extract features"
            )

    def require_width(self, expected: int, model: str = "the model") -> None:
        """Raise a clear error, before any model runs, when the features are not `expected` wide (a model
        trained on other features; torch would only say "mat1 and mat2 shapes cannot be multiplied")."""
        self.require_features()
        width = int(self.features.shape[2])
        if expected and width != int(expected):
            raise DataFormatError(
                f"{self.root / f'{self.split}_ims.npy'}: features are {width} wide but {model} expects "
                f"{int(expected)}-wide features: it was trained on other features (another extractor or dataset)"
            )

    def image_features(self, index: int) -> np.ndarray:
        row = self.image_rows[index]
        feats = (
            self.features[row] if self.set_sizes is None else self.features[row][: int(self.set_sizes[row])]
        )
        return np.asarray(feats, dtype=np.float32)

    def truncate(self, max_images: int) -> PrecompSplit:
        """The first `max_images` images and their captions (e.g. the 1,000-image dev set)."""
        if max_images <= 0 or max_images >= self.n_images:
            return self
        keep = np.nonzero(self.cap2img < max_images)[0]
        return PrecompSplit(
            self.root,
            self.split,
            self.features,
            [self.captions[i] for i in keep],
            self.cap2img[keep],
            self.image_rows[:max_images],
            self.image_ids[:max_images],
            self.image_paths[:max_images] if self.image_paths is not None else None,
            self.set_sizes,
            self.image_root,
        )

    def sample_images(self, fraction: float, seed: int) -> PrecompSplit:
        """A random `fraction` of the images (at least 2) with all their captions, images renumbered in order.

        The draw is one permutation from `seed`, so a smaller fraction is a subset of a larger one (a
        learning curve adds data rather than swapping it) and the subset does not change with train.seed.
        """
        if fraction >= 1.0:
            return self
        n = max(2, round(self.n_images * fraction))
        chosen = np.sort(np.random.default_rng(seed).permutation(self.n_images)[:n])
        new_index = np.full(self.n_images, -1, dtype=np.int64)
        new_index[chosen] = np.arange(n)
        keep = np.nonzero(new_index[self.cap2img] >= 0)[0]
        return PrecompSplit(
            self.root,
            self.split,
            self.features,
            [self.captions[i] for i in keep],
            new_index[self.cap2img[keep]],
            self.image_rows[chosen],
            [self.image_ids[i] for i in chosen],
            [self.image_paths[i] for i in chosen] if self.image_paths is not None else None,
            self.set_sizes,
            self.image_root,
        )

    def abs_image_path(self, index: int) -> Path:
        """The picture of image `index` under the images root; a path that resolves outside it (`..`, an
        absolute path, a symlink out) is a DataFormatError naming the line of `{split}_images.txt`."""
        if self.image_paths is None:
            raise DataFormatError(f"{self.root}: split {self.split!r} has no {self.split}_images.txt")
        return resolve_image_path(
            self.images_root,
            self.image_paths[index],
            f"{self.root / f'{self.split}_images.txt'} (image row {index})",
        )


def dataset_image_root(root: str | Path) -> Path:
    """The folder the paths of a dataset's `{split}_images.txt` are relative to: `manifest.json`'s
    `images_root` (absolute, or relative to the dataset directory), else the dataset directory itself.
    An unreadable manifest declares nothing (`vse data check` warns about it)."""
    root = Path(root)
    try:
        meta = read_manifest(root)
    except ManifestError:
        return root
    value = meta.get("images_root")
    if value is None:
        return root
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise DataFormatError(f"{manifest_path(root)}: images_root must be a folder path, got {value!r}")
    return root / value


def resolve_image_path(images_root: Path, rel: str, where: str) -> Path:
    """`images_root / rel` resolved, refused (DataFormatError naming `where`) when it resolves outside
    `images_root` (an absolute path, `~`, `..`, a symbolic link out): the rule of `untrusted.resolve_inside`."""
    rel = rel.strip()
    if not rel:
        raise DataFormatError(f"{where}: empty picture path")
    try:
        return resolve_inside(images_root, rel, label="the images root")
    except UntrustedFileError as e:
        raise DataFormatError(f"{where}: {e.detail}") from None


def feature_array(path: Path, found: Findings = FIRST_ERROR) -> np.ndarray | None:
    """`{split}_ims.npy` opened memory-mapped: a non-empty (images, regions, dim) float16/float32 array, else
    None with the problem reported to `found`."""
    try:
        feats = open_npy(path, DataFormatError)
    except DataFormatError as e:
        if not found.collecting:
            raise
        found.error(path, "", str(e).removeprefix(f"{path}: "))
        return None
    if feats.ndim != 3:
        found.error(path, "", f"expected shape (images, regions, dim), got {feats.shape}")
    elif feats.dtype not in (np.float16, np.float32):
        found.error(path, "", f"expected float16 or float32 features, got {feats.dtype}")
    elif 0 in feats.shape:
        found.error(path, "", f"empty feature array {feats.shape}")
    else:
        return feats
    return None


UNITS = {"image row": ("image rows", "image", "rows"), "clip": ("clips", "clip", "clips")}


def caption_map(
    n_rows: int,
    n_caps: int,
    cap2img_file: Path,
    captions_per_image: int,
    caps_file: Path,
    found: Findings = FIRST_ERROR,
    unit: str = "image row",
) -> tuple[np.ndarray, np.ndarray] | None:
    """(cap2img: caption -> image, image_rows: image -> feature row) of a split, from `{split}_cap2img.txt` or
    the SCAN conventions (k captions per row, or one feature row per caption: image i is row k*i, as the
    reference loaders' `im_div`); None when the counts fit no layout. `unit`: what a row is (image row, clip)."""
    plural, per, such = UNITS[unit]
    k = captions_per_image
    if cap2img_file.is_file():
        cap2img = int_lines(cap2img_file, found)
        if cap2img is None:
            return None
        if len(cap2img) != n_caps:
            found.error(
                cap2img_file,
                "",
                f"{len(cap2img)} lines but {caps_file.name} has {n_caps} captions (one {unit} per caption)",
            )
            return None
        bad = np.nonzero((cap2img < 0) | (cap2img >= n_rows))[0]
        for i in bad:
            found.error(
                cap2img_file, f":{i + 1}", f"{unit} {cap2img[i]} outside 0..{n_rows - 1}", f"{unit} outside"
            )
        if len(bad):
            return None
        missing = np.setdiff1d(np.arange(n_rows), cap2img)
        if len(missing):
            found.error(cap2img_file, "", f"{unit} {missing[0]} has no caption ({len(missing)} such {such})")
            return None
        return cap2img, np.arange(n_rows, dtype=np.int64)
    if n_caps == n_rows * k:
        return np.arange(n_caps, dtype=np.int64) // k, np.arange(n_rows, dtype=np.int64)
    if n_caps == n_rows and n_rows % k == 0 and k > 1:
        return np.arange(n_caps, dtype=np.int64) // k, np.arange(0, n_rows, k, dtype=np.int64)
    found.error(
        caps_file,
        "",
        f"{n_caps} captions do not fit {n_rows} {plural} with {k} captions per {per}; "
        f"add {cap2img_file.name} (one {unit} per caption) for a variable number of captions",
    )
    return None


def image_ids_of(
    ids: list[str],
    cap2img: np.ndarray,
    image_rows: np.ndarray,
    n_rows: int,
    ids_file: Path,
    found: Findings = FIRST_ERROR,
) -> list[str] | None:
    """Each image's id from `{split}_ids.txt`: one line per image, one per caption (the captions of one image
    must agree), or one per feature row; None when the count fits none of them or captions disagree."""
    n_images = len(image_rows)
    if len(ids) == n_images:
        return ids
    if len(ids) == len(cap2img):
        first: dict[int, str] = {}
        agree = True
        for c, img in enumerate(cap2img.tolist()):
            if first.setdefault(img, ids[c]) != ids[c]:
                found.error(
                    ids_file,
                    f":{c + 1}",
                    f"id {ids[c]!r} differs from {first[img]!r} given to another caption "
                    f"of the same image (row {img})",
                    "id differs",
                )
                agree = False
        return [first[i] for i in range(n_images)] if agree else None
    if len(ids) == n_rows:
        return [ids[r] for r in image_rows]
    found.error(
        ids_file, "", f"{len(ids)} lines; expected one per image ({n_images}) or per caption ({len(cap2img)})"
    )
    return None


def read_set_sizes(path: Path, shape: tuple[int, ...], found: Findings = FIRST_ERROR) -> np.ndarray | None:
    """`{split}_ims_lengths.txt`: one size in 1..R per row of `{split}_ims.npy`, or None when absent (or wrong)."""
    if not path.is_file():
        return None
    sizes = int_lines(path, found)
    if sizes is None:
        return None
    if len(sizes) != shape[0]:
        found.error(path, "", f"{len(sizes)} lines for {shape[0]} feature rows in the .npy")
        return None
    bad = np.nonzero((sizes < 1) | (sizes > shape[1]))[0]
    for i in bad:
        found.error(path, f":{i + 1}", f"set size {sizes[i]} outside 1..{shape[1]}", "set size outside")
    return None if len(bad) else sizes


@dataclass
class SplitFiles:
    """What one split's files hold, as far as they could be read (None: absent, or refused by a rule)."""

    unit: str = "image row"  # a feature row is an image, or a clip of frames
    features: np.ndarray | RaggedFrames | None = None  # pictures only: a zero-width placeholder, one row each
    frames: np.ndarray | None = None  # a video split: (F, D) frame rows and their clip offsets
    offsets: np.ndarray | None = None
    n_rows: int | None = None
    captions: list[str] | None = None
    cap2img: np.ndarray | None = None
    image_rows: np.ndarray | None = None
    ids: list[str] | None = None  # `{split}_ids.txt` as written
    image_ids: list[str] | None = None  # one per image
    image_paths: list[str] | None = None
    set_sizes: np.ndarray | None = None


def read_split_files(
    root: Path, split: str, captions_per_image: int = 5, found: Findings = FIRST_ERROR
) -> SplitFiles:
    """Every layout rule of one split, in the order a load applies them: loading stops at the first problem,
    `vse data check` (`vsekit.data.validate`) collects them all and adds its own content checks."""
    root = Path(root)
    out = SplitFiles()
    caps_file, ims_file, paths_file = (
        root / f"{split}_caps.txt",
        root / f"{split}_ims.npy",
        root / f"{split}_images.txt",
    )
    lengths_file = root / f"{split}_ims_lengths.txt"
    frames_path, offsets_path = frames_files(root, split)
    if not caps_file.is_file():
        found.error(caps_file, "", "missing (expected one caption per line)")
    if frames_path.is_file():  # video: variable-length clips (vsekit.data.frames), one "image" row per clip
        out.unit = "clip"
        for other in (ims_file, lengths_file):
            if other.is_file():
                found.error(
                    other,
                    "",
                    f"a split holds either {other.name} or {frames_path.name} (clips of frames), "
                    "not both; remove one",
                )
        if not offsets_path.is_file():  # said first: the frames are useless without it
            frame_offsets(offsets_path, frames_path, None, found)
        out.frames = frame_array(frames_path, found)
        if offsets_path.is_file():
            n_frames = None if out.frames is None else int(out.frames.shape[0])
            out.offsets, out.n_rows = frame_offsets(offsets_path, frames_path, n_frames, found)
        if out.frames is not None and out.offsets is not None:
            out.features = RaggedFrames(out.frames, out.offsets, frames_path)
    elif ims_file.is_file():
        out.features = feature_array(ims_file, found)
        if out.features is not None:
            out.n_rows = int(out.features.shape[0])
            out.set_sizes = read_set_sizes(lengths_file, out.features.shape, found)
    elif not paths_file.is_file():
        found.error(
            ims_file,
            "",
            f"missing (and no {frames_path.name} or {paths_file.name} either): split {split!r} "
            "has no images or clips",
        )
    if caps_file.is_file():
        out.captions = text_lines(caps_file, found)
        if out.captions is not None and not out.captions:
            found.error(caps_file, "", "no captions")
    if paths_file.is_file():
        lines = text_lines(paths_file, found, nul=found.collecting)
        out.image_paths = None if lines is None else [p.strip() for p in lines]
        if (
            out.image_paths is not None
            and out.n_rows is None
            and out.unit == "image row"
            and not ims_file.is_file()
        ):
            # pictures only (e.g. converted from a Karpathy JSON): a zero-width placeholder, one row per picture;
            # backbone recipes read the pictures, precomp recipes get a clear error from `require_features`
            out.n_rows = len(out.image_paths)
            out.features = np.zeros((out.n_rows, 0, 0), dtype=np.float32)
    if out.n_rows is None or not out.captions:
        return out
    layout = caption_map(
        out.n_rows,
        len(out.captions),
        root / f"{split}_cap2img.txt",
        captions_per_image,
        caps_file,
        found,
        out.unit,
    )
    if layout is None:
        return out
    out.cap2img, out.image_rows = layout
    n_images = len(out.image_rows)
    ids_file = root / f"{split}_ids.txt"
    if ids_file.is_file():
        lines = text_lines(ids_file, found, nul=found.collecting)
        if lines is not None:
            out.ids = [s.strip() for s in lines]
            out.image_ids = image_ids_of(out.ids, out.cap2img, out.image_rows, out.n_rows, ids_file, found)
    else:
        out.image_ids = [str(i) for i in range(n_images)]
    if out.image_paths is not None and len(out.image_paths) != n_images:
        found.error(paths_file, "", f"{len(out.image_paths)} paths for {n_images} images")
    return out


def load_precomp_split(root: str | Path, split: str, captions_per_image: int = 5) -> PrecompSplit:
    """Open `{split}_*` files in `root`, checking that they agree with each other (`read_split_files`)."""
    root = Path(root)
    if not root.is_dir():
        raise DataFormatError(f"{root}: dataset directory does not exist")
    f = read_split_files(root, split, captions_per_image)
    image_root = dataset_image_root(root) if f.image_paths is not None else None
    return PrecompSplit(
        root,
        split,
        f.features,
        f.captions,
        f.cap2img,
        f.image_rows,
        f.image_ids,
        f.image_paths,
        f.set_sizes,
        image_root,
    )


class SplitWriter:
    """The one writer of a split's files (`writing_split`): each file is staged in a temp file beside its
    target and all of them are renamed into place when the `writing_split` block ends without an error (none
    otherwise), so a reader never sees captions of one build beside features of another. The bytes are the
    layout's: one `str(value)` and `\\n` per line, `.npy` as numpy saves it."""

    def __init__(self, root: Path, split: str, stack: ExitStack) -> None:
        self.root, self.split, self._stack = root, split, stack

    def path(self, suffix: str) -> Path:
        """The final path of this split's `suffix` file (for messages; write through the methods)."""
        return split_path(self.root, self.split, suffix)

    def _staged(self, suffix: str) -> Path:
        from vsekit.utils.io import atomic_path

        return self._stack.enter_context(atomic_path(self.path(suffix)))

    def lines(self, suffix: str, values: Iterable[object]) -> None:
        """A text file of the layout: one value a line (captions, rows, ids, picture paths, set sizes)."""
        if suffix not in TEXT_FILES:
            raise ValueError(f"{suffix!r} is not a line file of the precomp layout ({', '.join(TEXT_FILES)})")
        self._staged(suffix).write_bytes("".join(f"{v}\n" for v in values).encode("utf-8"))

    def array(self, suffix: str, array: np.ndarray) -> None:
        """A whole `.npy` of the layout (features, frames or offsets), without a second copy in memory."""
        if suffix not in ARRAY_FILES:
            raise ValueError(
                f"{suffix!r} is not an array file of the precomp layout ({', '.join(ARRAY_FILES)})"
            )
        with open(self._staged(suffix), "wb") as f:
            np.save(f, np.asarray(array), allow_pickle=False)

    def memmap(self, suffix: str, shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
        """A new `.npy` of `shape` to fill in place (a split can be many GB), flushed when the block ends."""
        if suffix not in ARRAY_FILES:
            raise ValueError(
                f"{suffix!r} is not an array file of the precomp layout ({', '.join(ARRAY_FILES)})"
            )
        tmp = self._staged(suffix)  # entered first, so its rename runs after the flush below
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=dtype, shape=tuple(int(n) for n in shape))
        self._stack.callback(mm.flush)
        return mm

    def features(self, features: np.ndarray) -> None:
        self.array(IMS, features)

    def captions(self, captions: Iterable[str]) -> None:
        self.lines(CAPS, captions)

    def cap2img(self, rows: Iterable[int]) -> None:
        self.lines(CAP2IMG, (int(r) for r in rows))

    def ids(self, ids: Iterable[str]) -> None:
        self.lines(IDS, ids)

    def image_paths(self, paths: Iterable[str]) -> None:
        self.lines(IMAGES, paths)

    def offsets(self, lengths: Iterable[int]) -> None:
        """`{split}_frame_offsets.npy` from each clip's frame count (int64, 0 first)."""
        self.array(OFFSETS, np.concatenate([[0], np.cumsum(np.asarray(list(lengths)))]).astype(np.int64))

    def frames(self, clips: list[np.ndarray], dtype: type = np.float32) -> None:
        """Clips (each `(T_i, D)`) as `{split}_frames.npy` + `{split}_frame_offsets.npy`."""
        if not clips:
            raise VseInputError(f"{self.split}: no clips to write")
        dims = {int(c.shape[1]) if c.ndim == 2 else -1 for c in clips}
        if len(dims) != 1 or -1 in dims:
            raise VseInputError(
                f"{self.split}: every clip must be (frames, dim) with one dim; got dims {sorted(dims)}"
            )
        empty = [i for i, c in enumerate(clips) if c.shape[0] == 0]
        if empty:
            raise VseInputError(f"{self.split}: clip {empty[0]} has no frames")
        self.array(FRAMES_SUFFIX, np.concatenate(clips).astype(dtype, copy=False))
        self.offsets(c.shape[0] for c in clips)


@contextmanager
def writing_split(root: str | Path, split: str, stack: ExitStack | None = None) -> Iterator[SplitWriter]:
    """A `SplitWriter` for `split` in `root` (created): its files appear when the block ends without an error.
    With `stack`, they appear when that stack closes instead (several splits published together)."""
    root = Path(root)  # made by the first file staged (`atomic_path`)
    if stack is not None:
        yield SplitWriter(root, split, stack)
        return
    with ExitStack() as own:
        yield SplitWriter(root, split, own)
    log.debug("wrote split %s of %s", split, root)


def write_frames(root: str | Path, split: str, clips: list[np.ndarray], dtype: type = np.float32) -> None:
    """Write clips (each `(T_i, D)`) as `{split}_frames.npy` + `{split}_frame_offsets.npy`, crash-safely."""
    with writing_split(root, split) as w:
        w.frames(clips, dtype)


def write_precomp_split(
    root: str | Path,
    split: str,
    features: np.ndarray | None = None,
    captions: list[str] | None = None,
    cap2img: np.ndarray | None = None,
    image_ids: list[str] | None = None,
    ids_per_caption: bool = False,
    image_paths: list[str] | None = None,
    clips: list[np.ndarray] | None = None,
    clip_dtype: type = np.float32,
) -> None:
    """Write the given files of a split in the layout (used by every dataset builder and the tests): features
    or `clips` (frames layout), captions, caption -> row, ids (per image, or repeated per caption), paths."""
    with writing_split(root, split) as w:
        if features is not None:
            w.features(features)
        if clips is not None:
            w.frames(clips, clip_dtype)
        if captions is not None:
            w.captions(captions)
        if cap2img is not None:
            w.cap2img(cap2img)
        if image_ids is not None:
            if ids_per_caption:
                c2i = (
                    cap2img
                    if cap2img is not None
                    else np.arange(len(captions)) // (len(captions) // len(image_ids))
                )
                w.ids(image_ids[int(i)] for i in c2i)
            else:
                w.ids(image_ids)
        if image_paths is not None:
            w.image_paths(image_paths)
