"""Variable-length frame sets for video–text retrieval: the "ragged" layout beside the precomp one.

Clips have different frame counts, so a padded `(N, T_max, D)` array would waste most of its bytes on a set
like MSR-VTT (10–300 frames a clip). One split stores instead:

- `{split}_frames.npy`         `(F, D)` float16/float32: every clip's frame features, clip after clip,
                               opened memory-mapped;
- `{split}_frame_offsets.npy`  `(N + 1,)` integers: clip i is rows `offsets[i] : offsets[i + 1]`;
  `offsets[0] == 0`, `offsets[N] == F`, every clip has at least one frame.

Captions, `{split}_cap2img.txt` (one clip row per caption: MSR-VTT 20 per clip, VATEX 10), `_ids.txt` and
`_images.txt` keep their precomp meaning with "image" read as "clip". `RaggedFrames` makes the pair look
like the padded `(N, T_max, D)` array to the rest of vsekit (`shape`, `dtype`, `frames[i]`), so training,
evaluation, ensembles and search take clips unchanged: a clip is a set of vectors, as regions are.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vsekit.errors import VseInputError
from vsekit.utils.io import open_npy

FRAMES_SUFFIX = "_frames.npy"
OFFSETS_SUFFIX = "_frame_offsets.npy"


class RaggedFrames:
    """Clip i's frames as `frames[i]` ((T_i, D), memory-mapped); `shape` is `(N, T_max, D)`.

    Only integer indexing is offered: a slice of clips would have to be padded, which is the batch
    collator's job (`vsekit.data.datasets.pad_sets`).
    """

    ndim = 3

    def __init__(self, frames: np.ndarray, offsets: np.ndarray, path: Path | None = None) -> None:
        self.frames = frames
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.path = path
        self.lengths = np.diff(self.offsets)
        max_len = int(self.lengths.max()) if len(self.lengths) else 0
        self.shape = (len(self.lengths), max_len, int(frames.shape[1]))

    @property
    def dtype(self) -> np.dtype:
        return self.frames.dtype

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, index: int) -> np.ndarray:
        if not isinstance(index, (int, np.integer)):
            raise TypeError(f"RaggedFrames takes one clip index, got {type(index).__name__}")
        if not -len(self) <= index < len(self):
            raise IndexError(f"clip {index} out of range for {len(self)} clips")
        index = int(index) % len(self)
        return self.frames[self.offsets[index] : self.offsets[index + 1]]


def frames_files(root: Path, split: str) -> tuple[Path, Path]:
    return root / f"{split}{FRAMES_SUFFIX}", root / f"{split}{OFFSETS_SUFFIX}"


def has_frames(root: Path, split: str) -> bool:
    return frames_files(root, split)[0].is_file()


def load_frames(root: Path, split: str, error: type[Exception] = VseInputError) -> RaggedFrames:
    """Open and check a split's frames + offsets; every problem raises `error` naming the file."""
    frames_path, offsets_path = frames_files(root, split)
    if not offsets_path.is_file():
        raise error(f"{offsets_path}: missing; {frames_path.name} needs it (N + 1 clip offsets into its rows)")
    frames = open_npy(frames_path, error)
    if frames.ndim != 2:
        raise error(f"{frames_path}: expected shape (frames, dim), got {frames.shape}")
    if frames.dtype not in (np.float16, np.float32):
        raise error(f"{frames_path}: expected float16 or float32 features, got {frames.dtype}")
    if frames.shape[0] == 0 or frames.shape[1] == 0:
        raise error(f"{frames_path}: empty frame array {frames.shape}")
    offsets = open_npy(offsets_path, error)
    if offsets.ndim != 1 or not np.issubdtype(offsets.dtype, np.integer):
        raise error(f"{offsets_path}: expected a 1-D integer array, got {offsets.dtype} {offsets.shape}")
    if len(offsets) < 2:
        raise error(f"{offsets_path}: needs at least 2 entries (N + 1 for N clips), got {len(offsets)}")
    offsets = np.asarray(offsets, dtype=np.int64)
    if offsets[0] != 0:
        raise error(f"{offsets_path}: the first offset must be 0, got {offsets[0]}")
    if offsets[-1] != frames.shape[0]:
        raise error(f"{offsets_path}: the last offset is {offsets[-1]} but {frames_path.name} has "
                    f"{frames.shape[0]} frame rows")  # fmt: skip
    steps = np.diff(offsets)
    bad = np.nonzero(steps < 1)[0]
    if len(bad):
        i = int(bad[0])
        what = "no frames" if steps[i] == 0 else "a negative frame count (offsets must increase)"
        raise error(f"{offsets_path}: clip {i} has {what} (offsets[{i}] = {offsets[i]}, "
                    f"offsets[{i + 1}] = {offsets[i + 1]}); {len(bad)} such clips")  # fmt: skip
    return RaggedFrames(frames, offsets, frames_path)


def write_frames(root: str | Path, split: str, clips: list[np.ndarray], dtype: type = np.float32) -> None:
    """Write clips (each `(T_i, D)`) as `{split}_frames.npy` + `{split}_frame_offsets.npy`, crash-safely."""
    from vsekit.utils.io import atomic_save_npy

    if not clips:
        raise VseInputError(f"{split}: no clips to write")
    dims = {int(c.shape[1]) if c.ndim == 2 else -1 for c in clips}
    if len(dims) != 1 or -1 in dims:
        raise VseInputError(f"{split}: every clip must be (frames, dim) with one dim; got dims {sorted(dims)}")
    empty = [i for i, c in enumerate(clips) if c.shape[0] == 0]
    if empty:
        raise VseInputError(f"{split}: clip {empty[0]} has no frames")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    offsets = np.concatenate([[0], np.cumsum([c.shape[0] for c in clips])]).astype(np.int64)
    frames_path, offsets_path = frames_files(root, split)
    atomic_save_npy(frames_path, np.concatenate(clips).astype(dtype, copy=False))
    atomic_save_npy(offsets_path, offsets)
