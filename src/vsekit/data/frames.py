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

from vsekit.data.findings import Findings
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


def frame_array(path: Path, found: Findings) -> np.ndarray | None:
    """`{split}_frames.npy` opened memory-mapped: a non-empty (frames, dim) float16/float32 array, else None
    with the problem reported to `found`."""
    try:
        frames = open_npy(path, found.error_type)
    except found.error_type as e:
        if not found.collecting:
            raise
        found.error(path, "", str(e).removeprefix(f"{path}: "))
        return None
    if frames.ndim != 2:
        found.error(path, "", f"expected shape (frames, dim), got {frames.shape}")
    elif frames.dtype not in (np.float16, np.float32):
        found.error(path, "", f"expected float16 or float32 features, got {frames.dtype}")
    elif 0 in frames.shape:
        found.error(path, "", f"empty feature array {frames.shape}")
    else:
        return frames
    return None


def frame_offsets(
    path: Path, frames_path: Path, n_frames: int | None, found: Findings
) -> tuple[np.ndarray | None, int | None]:
    """(the offsets when they map `n_frames` frame rows to clips, else None; the clip count when known): every
    problem of `{split}_frame_offsets.npy` is reported to `found`, ` row I` naming the index into the offsets."""
    if not path.is_file():
        found.error(
            path, "", f"missing; {frames_path.name} needs it (N + 1 clip offsets into its frame rows)"
        )
        return None, None
    try:
        arr = open_npy(path, found.error_type)
    except found.error_type as e:
        if not found.collecting:
            raise
        found.error(path, "", str(e).removeprefix(f"{path}: "))
        return None, None
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        found.error(
            path, "", f"expected a 1-D integer array (N + 1 clip offsets), got {arr.dtype} {arr.shape}"
        )
        return None, None
    if len(arr) < 2:
        found.error(path, "", f"needs at least 2 offsets (N + 1 for N clips), got {len(arr)}")
        return None, None
    off, n_clips, ok = np.asarray(arr, dtype=np.int64), len(arr) - 1, True
    if off[0] != 0:
        found.error(path, " row 0", f"the first offset must be 0, got {off[0]}")
        ok = False
    if n_frames is not None and off[-1] != n_frames:
        found.error(
            path,
            f" row {n_clips}",
            f"the last offset is {off[-1]} but {frames_path.name} has {n_frames} frame rows",
        )
        ok = False
    outside = np.nonzero((off < 0) | (off > (n_frames if n_frames is not None else np.iinfo(np.int64).max)))[
        0
    ]
    if len(outside):
        i = int(outside[0])
        found.error(
            path,
            f" row {i}",
            f"offset {off[i]} outside 0..{n_frames} (frame rows of {frames_path.name}; "
            f"{len(outside)} such offset(s))",
        )
        ok = False
    steps = np.diff(off)
    for bad, what in ((steps < 0, "decrease"), (steps == 0, "empty")):
        idx = np.nonzero(bad)[0]
        if len(idx):
            i = int(idx[0])
            msg = (
                f"offsets decrease at clip {i} ({off[i]} then {off[i + 1]}; they must increase); {len(idx)} such clip(s)"
                if what == "decrease"
                else f"clip {i} has no frames (offsets[{i}] = offsets[{i + 1}] = {off[i]}); {len(idx)} empty clip(s)"
            )
            found.error(path, f" row {i}", msg)
            ok = False
    return (off if ok else None), n_clips


def load_frames(root: Path, split: str, error: type[Exception] = VseInputError) -> RaggedFrames:
    """Open and check a split's frames + offsets; the first problem raises `error` naming the file (the rules
    `vse data check` applies too, listing every problem: `frame_array`, `frame_offsets`)."""
    frames_path, offsets_path = frames_files(root, split)
    found = Findings(error)
    if not offsets_path.is_file():  # said first: the frames are useless without it
        frame_offsets(offsets_path, frames_path, None, found)
    frames = frame_array(frames_path, found)
    offsets, _ = frame_offsets(offsets_path, frames_path, int(frames.shape[0]), found)
    return RaggedFrames(frames, offsets, frames_path)
