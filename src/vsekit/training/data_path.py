"""Where the training batches are made, and how they reach the device.

Two paths give the trainer (and `vse bench data` / `vse bench train-step`) the batches of an epoch, in the
order `EpochBatches` draws from (seed, epoch):

- **on the device** (`DeviceBatches`): the training split's precomputed features, as stored (float16 stays
  float16), and its captions, tokenised once with the run's vocabulary into a fixed-width int32 matrix, live
  on the run's device. Each batch is gathered there by index (one `index_select` of the feature rows, in the
  order the augmentation keeps them), augmented with tensor ops (`set_keep_mask`, `pack_order`,
  `augment_token_batch`: the rules of `augment_set` and `Vocabulary.encode`), converted to float32, and
  padded to FIXED widths: the set's largest region (frame) count, and for captions the smallest of a few
  bucket widths that holds the batch's longest caption (`train.caption_buckets`, see below). The randomness of
  batch `step` of epoch `epoch` comes from one `torch.Generator` on the device seeded with
  `derived_seed(seed, epoch, step)`, drawn for the global batch (each rank under torchrun keeps its shard
  of it), so a run is deterministic and `--resume` mid-epoch is exact. On a CUDA device the features are
  copied there (compacted: real rows only, plus one zero row that padding slots read); on the CPU the
  memory-mapped array itself is gathered from (`torch.from_numpy`, no copy) and the padding rows are zeroed
  after the conversion.
- **the DataLoader** (`make_train_data` builds it over `PairDataset`): per-sample numpy augmentation from
  (seed, epoch, caption index), float16 kept through the collate function on CUDA (converted to float32
  after the pinned, side-stream copy of `device_batches`; on the CPU in the collate function, i.e. in the
  workers), vectorised padding, `persistent_workers` when `data.num_workers > 0` (the epoch travels with
  each index, so persistent workers draw the right epoch's augmentation). With caption buckets the collate
  function (`FixedWidthCollate`) pads captions to the same bucket widths and feature sets to the set's largest.

**Caption buckets** (`train.caption_buckets` = N >= 1): the widths are the token lengths at the quantiles
k/N (k = 1..N-1) of the training captions, plus the longest caption (`caption_widths`); a batch is padded (the
device path: cut) to the smallest width that holds its longest caption (`bucket_width`). On the device path
that choice is made on the host, from a host copy of the captions' token lengths indexed by the batch's
caption ids (the sampler's indices are host values): the caption augmentation only shortens captions, so the
un-augmented longest bounds the augmented one and no device value is read back. It augments at the full
width, then cuts, so the random draws are those of one bucket. Every encoder masks what lies past a
caption's length, so the width changes rounding only (tests/test_caption_buckets.py); with
`train.length_bucketing` (similar lengths per batch) most batches take a small width. N = 1 is the one width
of the longest caption; 0 pads each batch to its own longest caption (dynamic shapes). Transformer text
(DataLoader only) pads each batch to its own longest caption: its word-piece lengths are not known up front.

`train.data_on_device` picks: `false` the DataLoader; `true` the device, or a `SetupError` saying why it
cannot (pixel or transformer-text recipes, or a set larger than the free memory); `auto` (default) the
device when the recipe allows it and the set takes at most half the device's free memory
(`torch.cuda.mem_get_info` on CUDA, `MemAvailable` on the CPU), else the DataLoader. A resumed run keeps the
path it was trained with under `auto` (recorded in its state), since the two paths draw their augmentation
from different generators.
"""

from __future__ import annotations

import bisect
import itertools
import logging
import math
import os
import warnings
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch.utils.data import DataLoader, Sampler

from vsekit.config import Recipe
from vsekit.data.batch import Batch
from vsekit.data.datasets import (
    AugmentConfig,
    Collate,
    FeatureSource,
    PairDataset,
    augment_token_batch,
    pack_order,
    set_keep_mask,
)
from vsekit.data.frames import RaggedFrames
from vsekit.data.text import END, MASK, PAD, START, Vocabulary
from vsekit.distributed import DistContext, shard_slice
from vsekit.errors import SetupError
from vsekit.utils.runtime import derived_seed

logger = logging.getLogger(__name__)

# `auto` keeps the set on the device when it takes at most this share of the free memory (the rest is for the
# model, its activations and the optimizer)
AUTO_MEMORY_SHARE = 0.5
LOADER, DEVICE = "loader", "device"


class EpochBatches(Sampler[list[int]]):
    """Shuffled batches of epoch e from seed (seed, e); `skip` drops batches already trained on.

    `batches()` are global batches (the same on every rank); with `world_size > 1` iteration yields this
    rank's contiguous shard of each (see vsekit.distributed), so the gathered batch is the global one.
    `plan`: the pair indices this epoch trains on (the sample policy's epoch plan, set at each epoch start by
    vsekit.training.sample_policy); None is every pair, the draw of `uniform`. It is the one input of the draw
    both data paths and the trainer read, so a plan reaches them all alike.
    """

    def __init__(
        self,
        n: int,
        batch_size: int,
        seed: int,
        lengths: np.ndarray | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.n, self.batch_size, self.seed = n, batch_size, seed
        self.lengths = lengths
        self.rank, self.world_size = rank, world_size
        self.epoch, self.skip = 0, 0
        self.plan: np.ndarray | None = None

    def batches(self) -> list[list[int]]:
        g = torch.Generator().manual_seed(derived_seed(self.seed, self.epoch, 0xDA7A))
        n = self.n if self.plan is None else len(self.plan)
        perm = torch.randperm(n, generator=g).numpy()
        if self.plan is not None:
            perm = self.plan[perm]
        if self.lengths is not None:
            # length bucketing: sort within chunks of 50 batches so batches hold similar lengths
            chunk = self.batch_size * 50
            perm = np.concatenate(
                [
                    c[np.argsort(self.lengths[c], kind="stable")]
                    for c in np.array_split(perm, max(1, math.ceil(n / chunk)))
                ]
            )
        batches = [perm[i : i + self.batch_size].tolist() for i in range(0, n, self.batch_size)]
        # a single-sample batch has no negatives; under torchrun every rank needs at least one sample
        batches = [b for b in batches if len(b) >= max(2, self.world_size)]
        if self.lengths is not None and len(batches) > 1:
            # shuffle the full batches; a short remainder batch stays last
            full = batches if len(batches[-1]) == self.batch_size else batches[:-1]
            order = torch.randperm(len(full), generator=g).tolist()
            batches = [full[i] for i in order] + batches[len(full) :]
        return batches

    def __iter__(self):
        for b in self.batches()[self.skip :]:
            yield b if self.world_size == 1 else b[shard_slice(len(b), self.rank, self.world_size)]

    def __len__(self) -> int:
        return max(0, len(self.batches()) - self.skip)


class TaggedBatches(Sampler[list[tuple[int, int]]]):
    """`EpochBatches` whose indices carry their epoch, `(epoch, index)`: persistent DataLoader workers keep the
    dataset object they started with, so the epoch cannot reach them through `PairDataset.set_epoch`."""

    def __init__(self, sampler: EpochBatches) -> None:
        self.sampler = sampler

    def __iter__(self):
        epoch = self.sampler.epoch
        for b in self.sampler:
            yield [(epoch, i) for i in b]

    def __len__(self) -> int:
        return len(self.sampler)


def device_batches(loader: Iterable[Batch], device: torch.device) -> Iterator[Batch]:
    """The loader's batches, on CUDA already copied to the GPU: the next batch is copied on a side stream
    (from pinned memory, so asynchronously) while the current one trains. Elsewhere a plain pass-through.
    Every tensor goes, the caption lengths included: on CUDA the BiGRU runs unpacked (device lengths, no host
    sync), and the step's inputs are then all on the device (a CUDA graph copies them into its buffers)."""
    if device.type != "cuda":
        yield from loader
        return
    stream = torch.cuda.Stream(device)

    def move(b: Batch) -> Batch:
        with torch.cuda.stream(stream):
            return Batch.of(b).to(device, non_blocking=True)

    it = iter(loader)
    nxt = next(it, None)
    nxt = move(nxt) if nxt is not None else None
    while nxt is not None:
        current = torch.cuda.current_stream(device)
        current.wait_stream(stream)
        batch = nxt
        for v in batch.values():
            if v.is_cuda:
                v.record_stream(current)  # the copy's memory belongs to the compute stream from now on
        raw = next(it, None)
        nxt = move(raw) if raw is not None else None
        yield batch


# ------------------------------------------------------------------------------------- caption buckets
def caption_widths(lengths: np.ndarray, buckets: int) -> tuple[int, ...]:
    """The caption widths batches are padded to (module docstring): the token lengths at the quantiles k/buckets
    (k = 1..buckets-1; each a length some caption has) and the longest, ascending, repeats dropped. () for
    buckets=0: each batch is padded to its own longest caption."""
    if buckets < 0:
        raise ValueError(f"caption_buckets must be >= 0, got {buckets}")
    lengths = np.asarray(lengths)
    if buckets == 0 or lengths.size == 0:
        return ()
    qs = (
        np.quantile(lengths, [k / buckets for k in range(1, buckets)], method="higher") if buckets > 1 else []
    )
    return tuple(sorted({int(q) for q in qs} | {int(lengths.max())}))


def bucket_width(widths: Sequence[int], longest: int) -> int:
    """The smallest of `widths` that holds a caption of `longest` tokens (`longest` itself when there are no
    widths). A caption longer than every width is a bug of the caller (the last width is the set's longest)."""
    if not widths:
        return int(longest)
    i = bisect.bisect_left(widths, longest)
    if i == len(widths):
        raise ValueError(f"a caption of {longest} tokens is longer than every bucket width {tuple(widths)}")
    return int(widths[i])


def vocabulary_lengths(captions: Sequence[str], text: Vocabulary) -> np.ndarray:
    """Token lengths (`<start> words <end>`) of every caption, as `Vocabulary.encode` gives them."""
    return np.fromiter((len(text.word_ids(c)) + 2 for c in captions), dtype=np.int64, count=len(captions))


class FixedWidthCollate:
    """`Collate.pairs`, then padded to fixed widths: the tokens to the smallest of `widths` that holds the
    batch's longest (augmented) caption, feature sets [B, n, D] to `image_width` (the set's largest); pixels are
    left as they are. A module-level class, so DataLoader workers can pickle it."""

    def __init__(self, pad_id: int, float32: bool, widths: Sequence[int], image_width: int | None) -> None:
        self.inner = Collate(pad_id, float32=float32)
        self.pad_id, self.widths, self.image_width = pad_id, tuple(widths), image_width

    def __call__(self, batch) -> Batch:
        out = self.inner.pairs(batch)
        tokens = out.tokens
        width = bucket_width(self.widths, tokens.shape[1])
        if width > tokens.shape[1]:
            out = out.replace(
                tokens=torch.nn.functional.pad(tokens, (0, width - tokens.shape[1]), value=self.pad_id)
            )
        images = out.images
        if self.image_width is not None and images.ndim == 3 and images.shape[1] < self.image_width:
            out = out.replace(
                images=torch.nn.functional.pad(images, (0, 0, 0, self.image_width - images.shape[1]))
            )
        return out


# ------------------------------------------------------------------------------------- the resident set
def free_memory(device: torch.device) -> int | None:
    """Bytes free for the set on `device`: CUDA's free memory, the host's MemAvailable on the CPU (the page
    cache counts: a memory-mapped file read from it is what the CPU path gathers); None when unknown."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    if device.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return int(os.sysconf("SC_AVPHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (AttributeError, ValueError, OSError):
        return None


def _feature_layout(split) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(source [rows, D] as stored, first source row of each image, set size of each image)."""
    feats = split.features
    rows = np.asarray(split.image_rows, dtype=np.int64)
    if isinstance(feats, RaggedFrames):
        return feats.frames, feats.offsets[:-1][rows], feats.lengths[rows].astype(np.int64)
    n, width, dim = feats.shape
    sizes = (
        np.full(len(rows), width, dtype=np.int64)
        if split.set_sizes is None
        else np.asarray(split.set_sizes, np.int64)[rows]
    )
    return feats.reshape(n * width, dim), rows * width, sizes


def feature_bytes(split, device: torch.device) -> int:
    """Bytes the device path holds for the split's features: on the CPU the stored array it gathers from, on an
    accelerator the compacted copy (each image's real rows, plus one zero row)."""
    source, _, sizes = _feature_layout(split)
    rows = source.shape[0] if device.type == "cpu" else int(sizes.sum()) + 1
    return rows * int(source.shape[1]) * source.dtype.itemsize


def _as_tensor_no_copy(a: np.ndarray) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only memory map: the tensor is only ever read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(a)


class DeviceData:
    """The training split resident on `device`: feature rows [rows, D] as stored, each image's first row and set
    size, the fixed set width (the largest set), and the captions as an int32 matrix [captions, L] (`<start>
    words <end>`, `pad` after) with their lengths (on the device, and a host copy `caption_lengths` from which
    the batches' caption widths are chosen without reading the device)."""

    def __init__(self, split, text: Vocabulary, device: torch.device, chunk_bytes: int = 256 << 20) -> None:
        self.device = device
        source, starts, sizes = _feature_layout(split)
        self.width, self.dim = int(sizes.max()), int(source.shape[1])
        if device.type == "cpu":
            self.flat = _as_tensor_no_copy(source)  # gathered from the (memory-mapped) array itself
            self.zero_row: int | None = None
            self.starts = torch.from_numpy(starts)
        else:
            # compact copy of each image's real rows, chunk by chunk, and one zero row for the padding slots
            total = int(sizes.sum())
            self.flat = torch.empty((total + 1, self.dim), dtype=_torch_dtype(source.dtype), device=device)
            self.flat[total].zero_()
            self.zero_row = total
            dest = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
            per_chunk = max(1, chunk_bytes // max(1, self.width * self.dim * source.dtype.itemsize))
            for a in range(0, len(sizes), per_chunk):
                b = min(len(sizes), a + per_chunk)
                n = sizes[a:b]
                rows = np.repeat(starts[a:b] - np.cumsum(np.concatenate([[0], n[:-1]])), n) + np.arange(
                    int(n.sum())
                )
                block = torch.from_numpy(np.ascontiguousarray(source[rows]))
                self.flat[dest[a] : dest[a] + len(rows)].copy_(block)
            self.starts = torch.from_numpy(dest).to(device)
        self.sizes = torch.from_numpy(sizes).to(device)
        tokens, lengths = token_matrix(split.captions, text)
        self.caption_lengths = lengths.numpy()
        self.tokens, self.token_lengths = tokens.to(device), lengths.to(device)
        self.pad_id, self.start_id, self.end_id = text.word2idx[PAD], text.word2idx[START], text.word2idx[END]
        self.mask_id = text.word2idx[MASK]
        self.random_range = text.random_word_range()

    def images(self, image_index: torch.Tensor, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(float32 [B, width, D], lengths [B]): the kept rows of each image packed to the front in their order,
        zeros after them, at the fixed width."""
        b = image_index.shape[0]
        order, n = pack_order(keep)
        filled = torch.arange(self.width, device=keep.device) < n[:, None]
        starts = self.starts[image_index][:, None]
        if self.zero_row is not None:  # padding slots read the zero row: one gather, no masking pass
            src = torch.where(filled, starts + order, self.zero_row)
            out = self.flat.index_select(0, src.view(-1)).float()
        else:  # the CPU: padding slots read a real row, then are zeroed (only they are written)
            src = torch.where(filled, starts + order, starts)
            out = self.flat.index_select(0, src.view(-1)).float()
            out.index_fill_(0, (~filled).view(-1).nonzero().squeeze(1), 0.0)
        return out.view(b, self.width, self.dim), n


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.zeros(0, dtype=dtype)).dtype


def token_matrix(captions: list[str], text: Vocabulary) -> tuple[torch.Tensor, torch.Tensor]:
    """Every caption as `<start> word ids <end>` in an int32 matrix [captions, longest], pad 0, plus lengths."""
    words = [text.word_ids(c) for c in captions]
    lengths = np.fromiter((len(w) + 2 for w in words), dtype=np.int64, count=len(words))
    width = int(lengths.max())
    out = np.zeros((len(words), width), dtype=np.int32)
    slots = np.arange(width)[None, :]
    out[(slots >= 1) & (slots < lengths[:, None] - 1)] = np.fromiter(
        itertools.chain.from_iterable(words), np.int32
    )
    out[:, 0] = text.word2idx[START]
    out[np.arange(len(words)), lengths - 1] = text.word2idx[END]
    return torch.from_numpy(out), torch.from_numpy(lengths)


class DeviceBatches:
    """The epoch's batches made on the device from `DeviceData` (see the module's docstring). Iterating it
    yields the batches of `sampler.epoch` from batch `sampler.skip` on, like a DataLoader over the sampler.
    `widths`: the caption bucket widths (`caption_widths`; None: the one width of the longest caption, () each
    batch's own longest)."""

    def __init__(
        self,
        data: DeviceData,
        sampler: EpochBatches,
        cap2img: np.ndarray,
        seed: int,
        image_aug: AugmentConfig | None,
        text_prob: float,
        dist: DistContext | None = None,
        widths: Sequence[int] | None = None,
    ) -> None:
        self.data, self.sampler, self.seed = data, sampler, seed
        self.device = data.device
        self.cap2img = torch.as_tensor(np.asarray(cap2img, dtype=np.int64)).to(self.device)
        self.image_aug = image_aug if image_aug is not None and image_aug.enabled else None
        self.text_prob = float(text_prob)
        self.dist = dist or DistContext()
        self.generator = torch.Generator(device=self.device)
        self.widths = (int(data.tokens.shape[1]),) if widths is None else tuple(int(w) for w in widths)

    def width_for(self, captions: Sequence[int]) -> int:
        """The caption width of the global batch `captions` (host ids), from the host copy of the lengths."""
        return bucket_width(
            self.widths, int(self.data.caption_lengths[np.asarray(captions, dtype=np.int64)].max())
        )

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Batch]:
        epoch, skip = self.sampler.epoch, self.sampler.skip
        batches = self.sampler.batches()[skip:]
        if not batches:
            return
        # the epoch's caption order goes to the device once; each batch is a slice of it (no copy, no sync)
        order = torch.from_numpy(np.concatenate([np.asarray(b, dtype=np.int64) for b in batches])).to(
            self.device
        )
        start = 0
        for k, b in enumerate(batches):
            yield self.batch(order[start : start + len(b)], epoch, skip + k, self.width_for(b))
            start += len(b)

    def batch(self, captions: torch.Tensor, epoch: int, step: int, width: int | None = None) -> Batch:
        """Global batch `captions` (caption indices on the device) of (epoch, step), this rank's shard of it;
        captions cut to `width` tokens (None: the full width), which must hold the batch's longest caption."""
        d = self.data
        g = self.generator.manual_seed(derived_seed(self.seed, epoch, step))
        image_index = self.cap2img[captions]
        sizes = d.sizes[image_index]
        if self.image_aug is not None:
            keep = set_keep_mask(sizes, d.width, g, self.image_aug)
        else:
            keep = torch.arange(d.width, device=self.device) < sizes[:, None]
        tokens, lengths = d.tokens.index_select(0, captions).long(), d.token_lengths[captions]
        if self.text_prob > 0:
            tokens, lengths = augment_token_batch(
                tokens, lengths, g, self.text_prob, d.mask_id, d.random_range, d.start_id, d.end_id, d.pad_id
            )
        if width is not None and width < tokens.shape[1]:  # augmented at the full width: the same draws
            tokens = tokens[:, :width].contiguous()
        if (
            self.dist.enabled
        ):  # the draws above cover the global batch: a rank's shard is the same for any world size
            part = shard_slice(captions.shape[0], self.dist.rank, self.dist.world_size)
            captions, image_index, keep, tokens, lengths = (
                t[part] for t in (captions, image_index, keep, tokens, lengths)
            )
        images, image_lengths = d.images(image_index, keep)
        return Batch(
            images=images,
            image_lengths=image_lengths,
            tokens=tokens,
            token_lengths=lengths,
            image_index=image_index,
            caption_index=captions,
        )


# --------------------------------------------------------------------------------------- the choice
def train_feature_source(recipe: Recipe, split) -> FeatureSource:
    """The training images of a precomp recipe: features as stored, with the recipe's size augmentation.

    Multi-view (AVSE): the views are the size augmentation, each drawn from the full set (paper §4.2: 75 % /
    90 % of it); model.image.view_size_augment=true drops regions/cells first, as vsekit did before."""
    img, d = recipe.model.image, recipe.data
    drop = d.size_augment and (img.views <= 1 or img.view_size_augment)
    aug = AugmentConfig(drop, img.feature_type, d.region_keep_prob, d.grid_drop_max, d.text_augment_prob)
    return FeatureSource(split, aug, keep_dtype=True)


def train_pairs(recipe: Recipe, split, text, images) -> PairDataset:
    d = recipe.data
    return PairDataset(
        images,
        split.captions,
        split.cap2img,
        text,
        train=True,
        seed=recipe.train.seed,
        text_augment_prob=d.text_augment_prob if d.size_augment else 0.0,
    )


def device_path_blocker(pairs: PairDataset, split) -> str | None:
    """Why this recipe's batches cannot be made on the device (None: they can)."""
    if getattr(pairs.images, "kind", None) != "features":
        return "pixel recipes decode and transform each picture on the host (DataLoader workers)"
    if not isinstance(pairs.text, Vocabulary):
        return (
            "transformer text: its word-piece augmentation works on whole words, which only the tokenizer "
            "knows per caption"
        )
    feats = split.features
    source = feats.frames if isinstance(feats, RaggedFrames) else feats
    if not (isinstance(source, np.ndarray) and source.flags.c_contiguous):
        return "the feature array is not stored in C order"
    return None


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


@dataclass
class TrainData:
    """The training batches of a run: `epoch(e, skip)` yields epoch e's batches from batch `skip` on, ready on
    the device (float32 images). `loader` iterates the current epoch of `sampler` (tests, benchmarks);
    `path` is `device:<type>` or `loader`, `reason` why; `caption_widths` the caption bucket widths (() when
    each batch is padded to its own longest caption)."""

    loader: Iterable[Batch]
    sampler: EpochBatches
    device: torch.device
    path: str
    reason: str
    caption_widths: tuple[int, ...] = ()

    @property
    def on_device(self) -> bool:
        return self.path.startswith(DEVICE)

    def epoch(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        self.sampler.epoch, self.sampler.skip = epoch, skip
        if self.on_device:
            yield from self.loader
            return
        for batch in device_batches(self.loader, self.device):
            images = batch.images
            if images.is_floating_point() and images.dtype != torch.float32:
                batch = batch.replace(images=images.float())  # float16 sets became float32 on the device
            yield batch


def make_train_data(
    recipe: Recipe,
    split,
    pairs: PairDataset,
    sampler: EpochBatches,
    device: torch.device,
    dist: DistContext | None = None,
    recorded: str = "",
    pad_id: int = 0,
    log=None,
    alongside: TrainData | None = None,
    seed: int | None = None,
) -> TrainData:
    """Choose the data path (module docstring) and build it. `recorded`: the path a resumed run was trained
    with ('' for a new run). `log` gets the warnings a user should see (a resumed run on another path).
    `alongside`: a second stream of batches of the same pairs beside that one (another sampler: the
    co-teaching trainer's unlabeled batches), on its path and sharing its device copy of the set; `seed` its
    augmentation seed (default train.seed)."""
    setting = recipe.train.data_on_device
    buckets = recipe.train.caption_buckets
    seed = recipe.train.seed if seed is None else seed
    if alongside is not None:
        on_device, reason = alongside.on_device, "beside the run's training batches"
    else:
        on_device, reason = _choose(setting, pairs, split, device, recorded, log)
    if on_device:
        if alongside is not None and isinstance(alongside.loader, DeviceBatches):
            data = alongside.loader.data
        else:
            data = DeviceData(split, pairs.text, device)
        aug = getattr(pairs.images, "aug", None)
        widths = caption_widths(data.caption_lengths, buckets)
        loader = DeviceBatches(data, sampler, split.cap2img, seed, aug, pairs.text_augment_prob, dist, widths)
        return TrainData(
            loader,
            sampler,
            device,
            f"{DEVICE}:{device.type}",
            f"on the {device.type}: {reason}; {_widths_note(widths)}",
            widths,
        )
    workers = recipe.data.num_workers
    float32 = device.type == "cpu"
    widths: tuple[int, ...] = ()
    if buckets > 0 and isinstance(pairs.text, Vocabulary):
        widths = caption_widths(vocabulary_lengths(split.captions, pairs.text), buckets)
        image_width = (
            int(_feature_layout(split)[2].max())
            if getattr(pairs.images, "kind", None) == "features"
            else None
        )
        collate = FixedWidthCollate(pad_id, float32, widths, image_width)
    else:
        collate = Collate(pad_id, float32=float32).pairs
    # the workers' base seed from the loader's own generator: starting an epoch never draws from torch's global
    # generator, whose state a resumed run restores for in-model dropout (a draw there would shift every mask)
    loader = DataLoader(
        pairs,
        batch_sampler=TaggedBatches(sampler),
        collate_fn=collate,
        num_workers=workers,
        pin_memory=device.type == "cuda",
        persistent_workers=workers > 0,
        generator=torch.Generator().manual_seed(derived_seed(seed, 0x10AD)),
    )
    return TrainData(
        loader,
        sampler,
        device,
        LOADER,
        f"DataLoader ({workers} workers): {reason}; {_widths_note(widths)}",
        widths,
    )


def _widths_note(widths: tuple[int, ...]) -> str:
    if not widths:
        return "each batch padded to its own longest caption"
    return f"caption widths {', '.join(map(str, widths))} (train.caption_buckets)"


def _choose(setting, pairs: PairDataset, split, device: torch.device, recorded: str, log) -> tuple[bool, str]:
    if setting is False:
        return False, "train.data_on_device=false"
    blocker = device_path_blocker(pairs, split)
    if blocker is not None:
        if setting is True:
            raise SetupError(
                f"train.data_on_device=true, but {blocker}; use train.data_on_device=auto or false"
            )
        return False, blocker
    need = feature_bytes(split, device) + len(split.captions) * 4 * 64  # captions: a generous bound
    free = free_memory(device)
    have = f"{_gib(need)} of features and captions, {_gib(free) if free is not None else 'unknown'} free"
    if setting is True:
        if free is not None and need > free:
            raise SetupError(
                f"train.data_on_device=true: the training set needs {_gib(need)} on {device} but "
                f"only {_gib(free)} is free; use train.data_on_device=auto (the DataLoader when it "
                "does not fit) or false"
            )
        return True, f"train.data_on_device=true ({have})"
    if recorded:  # auto, resumed: keep the path the run was trained with, so the resumed batches are the same
        if recorded == LOADER:
            return False, "the run was trained with the DataLoader (resumed with the same path)"
        if free is None or need <= free:
            if recorded != f"{DEVICE}:{device.type}" and log is not None:
                log(
                    f"warning: this run made its batches on {recorded.split(':', 1)[-1]}, now on {device.type}: "
                    "the random draws of the size augmentation differ between devices, so the batches from here "
                    "on are not those of an uninterrupted run"
                )
            return True, f"the run was trained with batches made on the device ({have})"
        if log is not None:
            log(
                f"warning: this run made its batches on the device, but now {have}: the DataLoader makes them, "
                "with other augmentation draws than an uninterrupted run"
            )
        return False, f"the set does not fit ({have})"
    if free is None:
        return (
            False,
            f"the free memory of {device} is unknown (train.data_on_device=true keeps the set there)",
        )
    if need > AUTO_MEMORY_SHARE * free:
        return False, f"the set takes more than {AUTO_MEMORY_SHARE:.0%} of the free memory ({have})"
    return True, f"the set fits ({have})"
