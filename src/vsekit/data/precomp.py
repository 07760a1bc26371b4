"""Reader for the SCAN "precomp" layout and vsekit's variable-captions extension.

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

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from vsekit.data.frames import has_frames, load_frames
from vsekit.errors import VseInputError
from vsekit.utils.io import open_npy


class DataFormatError(VseInputError):
    """A dataset file that does not fit the layout; the message names the file and the problem."""


def read_lines(path: Path) -> list[str]:
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{path}: not UTF-8 text ({e})") from e
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return [line.rstrip("\r") for line in lines]


def read_int_lines(path: Path) -> np.ndarray:
    values = []
    for lineno, line in enumerate(read_lines(path), 1):
        try:
            values.append(int(line.strip()))
        except ValueError:
            raise DataFormatError(f"{path}:{lineno}: expected one integer per line, got {line[:60]!r}") from None
    return np.asarray(values, dtype=np.int64)


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
        feats = self.features[row] if self.set_sizes is None else self.features[row][: int(self.set_sizes[row])]
        return np.asarray(feats, dtype=np.float32)

    def truncate(self, max_images: int) -> PrecompSplit:
        """The first `max_images` images and their captions (e.g. the 1,000-image dev set)."""
        if max_images <= 0 or max_images >= self.n_images:
            return self
        keep = np.nonzero(self.cap2img < max_images)[0]
        return PrecompSplit(
            self.root, self.split, self.features, [self.captions[i] for i in keep], self.cap2img[keep],
            self.image_rows[:max_images], self.image_ids[:max_images],
            self.image_paths[:max_images] if self.image_paths is not None else None, self.set_sizes,
            self.image_root,
        )  # fmt: skip

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
            self.root, self.split, self.features, [self.captions[i] for i in keep], new_index[self.cap2img[keep]],
            self.image_rows[chosen], [self.image_ids[i] for i in chosen],
            [self.image_paths[i] for i in chosen] if self.image_paths is not None else None, self.set_sizes,
            self.image_root,
        )  # fmt: skip

    def abs_image_path(self, index: int) -> Path:
        """The picture of image `index` under the images root; a path that resolves outside it (`..`, an
        absolute path, a symlink out) is a DataFormatError naming the line of `{split}_images.txt`."""
        if self.image_paths is None:
            raise DataFormatError(f"{self.root}: split {self.split!r} has no {self.split}_images.txt")
        return resolve_image_path(self.images_root, self.image_paths[index],
                                  f"{self.root / f'{self.split}_images.txt'} (image row {index})")  # fmt: skip


MANIFEST = "manifest.json"


def dataset_image_root(root: str | Path) -> Path:
    """The folder the paths of a dataset's `{split}_images.txt` are relative to: `manifest.json`'s
    `images_root` (absolute, or relative to the dataset directory), else the dataset directory itself.
    An unreadable manifest declares nothing (`vse data check` warns about it)."""
    root = Path(root)
    path = root / MANIFEST
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return root
    value = meta.get("images_root") if isinstance(meta, dict) else None
    if value is None:
        return root
    if not isinstance(value, str) or not value.strip() or "\0" in value:
        raise DataFormatError(f"{path}: images_root must be a folder path, got {value!r}")
    return root / value


def resolve_image_path(images_root: Path, rel: str, where: str) -> Path:
    """`images_root / rel`, refused (DataFormatError naming `where`) when it resolves outside `images_root`."""
    rel = rel.strip()
    if not rel:
        raise DataFormatError(f"{where}: empty picture path")
    try:
        base = images_root.resolve()
        full = (images_root / rel).resolve()
    except (OSError, RuntimeError, ValueError) as e:  # NUL bytes, symlink loops
        raise DataFormatError(f"{where}: {rel!r} is not a usable path ({e})") from e
    if Path(rel).is_absolute() or not full.is_relative_to(base):
        raise DataFormatError(f"{where}: {rel!r} points outside the images root {base}")
    return full


def _load_features(path: Path) -> np.ndarray:
    if not path.is_file():
        raise DataFormatError(f"{path}: missing (expected the (N, R, D) feature array of this split)")
    feats = open_npy(path, DataFormatError)
    if feats.ndim != 3:
        raise DataFormatError(f"{path}: expected shape (images, regions, dim), got {feats.shape}")
    if feats.dtype not in (np.float16, np.float32):
        raise DataFormatError(f"{path}: expected float16 or float32 features, got {feats.dtype}")
    if feats.shape[0] == 0 or feats.shape[1] == 0 or feats.shape[2] == 0:
        raise DataFormatError(f"{path}: empty feature array {feats.shape}")
    return feats


def caption_layout(
    n_rows: int, n_caps: int, cap2img_file: Path, captions_per_image: int, caps_file: Path
) -> tuple[np.ndarray, np.ndarray]:
    """(cap2img, image_rows) for a split, from the explicit map or the SCAN conventions."""
    if cap2img_file.is_file():
        cap2img = read_int_lines(cap2img_file)
        if len(cap2img) != n_caps:
            raise DataFormatError(f"{cap2img_file}: {len(cap2img)} lines but {caps_file.name} has {n_caps} captions")
        if n_caps and (cap2img.min() < 0 or cap2img.max() >= n_rows):
            raise DataFormatError(f"{cap2img_file}: image indices must lie in 0..{n_rows - 1}")
        missing = np.setdiff1d(np.arange(n_rows), cap2img)
        if len(missing):
            raise DataFormatError(f"{cap2img_file}: image row {missing[0]} has no caption ({len(missing)} such rows)")
        return cap2img, np.arange(n_rows, dtype=np.int64)
    k = captions_per_image
    if n_caps == n_rows * k:
        return np.arange(n_caps, dtype=np.int64) // k, np.arange(n_rows, dtype=np.int64)
    if n_caps == n_rows and n_rows % k == 0 and k > 1:
        # one feature row per caption (e.g. Kaggle F30K dev): image i is row k*i
        return np.arange(n_caps, dtype=np.int64) // k, np.arange(0, n_rows, k, dtype=np.int64)
    raise DataFormatError(
        f"{caps_file}: {n_caps} captions do not fit {n_rows} image rows with {k} captions per image; "
        f"add {cap2img_file.name} (one image row per caption) for a variable number of captions"
    )


def load_precomp_split(root: str | Path, split: str, captions_per_image: int = 5) -> PrecompSplit:
    """Open `{split}_*` files in `root`, checking that they agree with each other."""
    root = Path(root)
    if not root.is_dir():
        raise DataFormatError(f"{root}: dataset directory does not exist")
    caps_file = root / f"{split}_caps.txt"
    if not caps_file.is_file():
        raise DataFormatError(f"{caps_file}: missing (expected one caption per line)")
    paths_file = root / f"{split}_images.txt"
    ims_file = root / f"{split}_ims.npy"
    lengths_file = root / f"{split}_ims_lengths.txt"
    if has_frames(root, split):
        # video: variable-length clips (vsekit.data.frames), one "image" row per clip
        for other in (ims_file, lengths_file):
            if other.is_file():
                raise DataFormatError(f"{other}: a split holds either {other.name} or {split}_frames.npy "
                                      f"(clips of frames), not both; remove one")  # fmt: skip
        feats = load_frames(root, split, DataFormatError)
    elif not ims_file.is_file() and paths_file.is_file():
        # pixels only (e.g. converted from a Karpathy JSON): a zero-width placeholder, one row per picture;
        # backbone recipes read the pictures, precomp recipes get a clear error from `require_features`
        feats = np.zeros((len(read_lines(paths_file)), 0, 0), dtype=np.float32)
    else:
        feats = _load_features(ims_file)
    captions = read_lines(caps_file)
    if not captions:
        raise DataFormatError(f"{caps_file}: no captions")
    cap2img, image_rows = caption_layout(
        feats.shape[0], len(captions), root / f"{split}_cap2img.txt", captions_per_image, caps_file
    )
    n_images = len(image_rows)
    ids_file = root / f"{split}_ids.txt"
    if ids_file.is_file():
        ids = [s.strip() for s in read_lines(ids_file)]
        if len(ids) == n_images:
            image_ids = ids
        elif len(ids) == len(captions):
            image_ids = [""] * n_images
            for c, img in enumerate(cap2img):
                if image_ids[img] == "":
                    image_ids[img] = ids[c]
                elif image_ids[img] != ids[c]:
                    raise DataFormatError(
                        f"{ids_file}:{c + 1}: caption of image row {img} has id {ids[c]!r}, "
                        f"another caption of the same image has {image_ids[img]!r}"
                    )
        elif len(ids) == feats.shape[0]:
            image_ids = [ids[r] for r in image_rows]
        else:
            raise DataFormatError(
                f"{ids_file}: {len(ids)} lines; expected one per image ({n_images}) or per caption ({len(captions)})"
            )
    else:
        image_ids = [str(i) for i in range(n_images)]
    image_paths = None
    if paths_file.is_file():
        image_paths = [s.strip() for s in read_lines(paths_file)]
        if len(image_paths) != n_images:
            raise DataFormatError(f"{paths_file}: {len(image_paths)} paths for {n_images} images")
    image_root = dataset_image_root(root) if image_paths is not None else None
    return PrecompSplit(root, split, feats, captions, cap2img, image_rows, image_ids, image_paths,
                        read_set_sizes(lengths_file, feats.shape), image_root)  # fmt: skip


def read_set_sizes(path: Path, shape: tuple[int, ...]) -> np.ndarray | None:
    """`{split}_ims_lengths.txt`: one size in 1..R per row of `{split}_ims.npy`, or None when absent."""
    if not path.is_file():
        return None
    sizes = read_int_lines(path)
    if len(sizes) != shape[0]:
        raise DataFormatError(f"{path}: {len(sizes)} lines for {shape[0]} feature rows in the .npy")
    bad = np.nonzero((sizes < 1) | (sizes > shape[1]))[0]
    if len(bad):
        raise DataFormatError(f"{path}:{bad[0] + 1}: set size {sizes[bad[0]]} outside 1..{shape[1]}")
    return sizes


def write_precomp_split(
    root: str | Path,
    split: str,
    features: np.ndarray,
    captions: list[str],
    cap2img: np.ndarray | None = None,
    image_ids: list[str] | None = None,
    ids_per_caption: bool = False,
    image_paths: list[str] | None = None,
) -> None:
    """Write a split in the same layout (used by dataset builders and the tests)."""
    from vsekit.utils.io import atomic_save_npy, atomic_write_text

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    atomic_save_npy(root / f"{split}_ims.npy", features)
    atomic_write_text(root / f"{split}_caps.txt", "".join(c + "\n" for c in captions))
    if cap2img is not None:
        atomic_write_text(root / f"{split}_cap2img.txt", "".join(f"{int(i)}\n" for i in cap2img))
    if image_ids is not None:
        if ids_per_caption:
            c2i = cap2img if cap2img is not None else np.arange(len(captions)) // (len(captions) // len(image_ids))
            lines = [image_ids[int(i)] for i in c2i]
        else:
            lines = list(image_ids)
        atomic_write_text(root / f"{split}_ids.txt", "".join(f"{s}\n" for s in lines))
    if image_paths is not None:
        atomic_write_text(root / f"{split}_images.txt", "".join(f"{p}\n" for p in image_paths))
