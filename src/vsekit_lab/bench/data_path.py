"""`vse bench data`: the training data path alone, against the bare gather that bounds it.

A COCO-shaped synthetic precomp split is written once (`write_coco_like`: N images of R x D float16
features, 5 captions of 8-25 words each), then the batches `vse train` would draw from it are timed:
consecutive batches of epoch 0 through `make_train_data`, exactly as the trainer builds and iterates them
(`TrainData.epoch`: on the device, augmented, float32; or through the DataLoader and its copy to the device).
In the same run, alternating with it, a bare `features[idx].float()` of the same shapes (random idx, the
float16 array in memory: the memory-mapped file on the CPU, a device copy on CUDA) is timed as the physical
limit of any data path: one gather and one conversion of the batch's bytes. PyTorch's advanced indexing of
a 3-D half tensor is not its fastest gather, so a second, tighter bound is timed too: `index_select` of the
same rows from the array seen as [N x R, D], then `.float()` (`bare_index_select_samples_per_s`). On CUDA every
timed block ends with a device synchronisation, so the batches are ready on the device.

    from vsekit_lab.bench.data_path import bench_data
    res = bench_data(n=20000, regions=36, img_dim=2048, batch=128, device="cpu")
    res["samples_per_s"], res["bare_gather_samples_per_s"], res["ratio"]
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from vsekit.config import Recipe, load_recipe
from vsekit.data.batch import Batch
from vsekit.data.precomp import IMS, load_precomp_split, split_path, writing_split
from vsekit.data.text import SPECIALS, Vocabulary
from vsekit.errors import VseInputError
from vsekit.models.tokenizers import pad_id_for
from vsekit.training.data_path import (
    EpochBatches,
    TrainData,
    make_train_data,
    train_feature_source,
    train_pairs,
)

# the synthetic captions are plain words: any tokenizer reads them alike, and regex is the steady-state cost
# of the DataLoader path (nltk's ids are cached after the first epoch)
DEFAULT_SETS = ("model.text.tokenizer=regex", "model.text.vocab_min_count=1")


def synthetic_words(vocab: int) -> list[str]:
    return [f"w{i}" for i in range(max(1, vocab - len(SPECIALS)))]


def write_coco_like(
    out_dir: str | Path,
    n: int,
    regions: int = 36,
    img_dim: int = 2048,
    captions_per_image: int = 5,
    min_words: int = 8,
    max_words: int = 25,
    vocab: int = 10_000,
    seed: int = 0,
    chunk_bytes: int = 128 << 20,
    split: str = "train",
    threads: int = 0,
) -> Path:
    """A split (`train` unless named) in the precomp layout: float16 features [n, regions, img_dim] (standard
    normal), written chunk by chunk (never the whole array in memory; chunk i drawn from its own generator
    seeded (seed, i), by `threads` threads, default min(8, cores): the same bytes for any thread count), and
    `captions_per_image` captions per image of min_words..max_words words drawn from `synthetic_words(vocab)`.
    A COCO-sized train split (113,287 images of 36 x 2048) is 16.7 GB."""
    if n < 2 or regions < 1 or img_dim < 1 or captions_per_image < 1:
        raise VseInputError(
            f"need n >= 2 images and positive regions/img-dim/captions, got {n}, {regions}, {img_dim}, "
            f"{captions_per_image}"
        )
    if not 1 <= min_words <= max_words:
        raise VseInputError(f"need 1 <= min_words <= max_words, got {min_words}, {max_words}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per = max(1, chunk_bytes // (regions * img_dim * 4))
    with writing_split(out, split) as w:
        feats = w.memmap(IMS, (n, regions, img_dim), np.float16)

        def fill(i: int, dest: np.ndarray = feats) -> None:  # numpy's generators release the GIL
            a, b = i * per, min(n, (i + 1) * per)
            gen = np.random.default_rng([seed, i])
            dest[a:b] = gen.standard_normal((b - a, regions, img_dim), dtype=np.float32)

        workers = threads if threads > 0 else min(8, os.cpu_count() or 1)
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(fill, range(-(-n // per))))
        del fill, feats  # the writer flushes the memory map when the block ends
        rng = np.random.default_rng(seed)
        words = np.array(synthetic_words(vocab))
        total = n * captions_per_image
        lengths = rng.integers(min_words, max_words + 1, size=total)
        ids = rng.integers(0, len(words), size=int(lengths.sum()))
        bounds = np.concatenate([[0], np.cumsum(lengths)])
        w.captions(" ".join(words[ids[bounds[i] : bounds[i + 1]]]) for i in range(total))
    return out


def build_data(
    data_dir: str | Path,
    recipe: str | Recipe = "vse_infty",
    batch: int = 128,
    device: str = "cpu",
    overrides: Sequence[str] = (),
    text=None,
    captions_per_image: int = 5,
) -> TrainData:
    """The training data path of `recipe` over `data_dir`'s train split, built as the trainer builds it
    (`text`: the run's text processor; default a vocabulary of the split's captions)."""
    r = (
        recipe
        if isinstance(recipe, Recipe)
        else load_recipe(recipe, [*DEFAULT_SETS, f"train.batch_size={batch}", *overrides])
    )
    split = load_precomp_split(data_dir, r.data.train_split, captions_per_image)
    if text is None:
        text = Vocabulary.build(split.captions, r.model.text.vocab_min_count, r.model.text.tokenizer)
    pairs = train_pairs(r, split, text, train_feature_source(r, split))
    lengths = np.array([len(c.split()) for c in split.captions]) if r.train.length_bucketing else None
    sampler = EpochBatches(len(pairs), r.train.batch_size, r.train.seed, lengths)
    return make_train_data(r, split, pairs, sampler, torch.device(device), pad_id=pad_id_for(text))


def endless_batches(data: TrainData) -> Iterator[Batch]:
    """Consecutive batches as the trainer draws them: epoch 0, then 1, …"""
    epoch = 0
    while True:
        yield from data.epoch(epoch)
        epoch += 1


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_batches(batches: Iterator[Batch], n: int, device: torch.device) -> float:
    """Seconds for the next `n` batches, each ready on the device (one synchronisation at the end)."""
    _sync(device)
    t0 = time.perf_counter()
    for _ in range(n):
        batch = next(batches)
    _sync(device)
    del batch
    return time.perf_counter() - t0


def bare_gather_source(data_dir: str | Path, device: torch.device) -> torch.Tensor:
    """The split's stored features as one tensor [N, R, D] in the device's memory (no copy on the CPU)."""
    import warnings

    feats = np.load(split_path(data_dir, "train", IMS), mmap_mode="r")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only memory map: only read
        t = torch.from_numpy(feats)
    return t if device.type == "cpu" else t.to(device)


def time_bare_gather(
    features: torch.Tensor, batch: int, n: int, generator: torch.Generator, index_select: bool = False
) -> float:
    """Seconds for `n` bare gathers `features[idx].float()` of `batch` random images (`index_select`: the same
    rows by `index_select` from the [N x R, D] view)."""
    dev = features.device
    idx = [torch.randint(features.shape[0], (batch,), generator=generator, device=dev) for _ in range(n)]
    if index_select:
        n_img, regions, dim = features.shape
        rows = [(i[:, None] * regions + torch.arange(regions, device=dev)).view(-1) for i in idx]
        flat = features.view(n_img * regions, dim)
    _sync(dev)
    t0 = time.perf_counter()
    if index_select:
        for r in rows:
            out = flat.index_select(0, r).float()
    else:
        for i in idx:
            out = features[i].float()
    _sync(dev)
    del out
    return time.perf_counter() - t0


def bench_data(
    n: int = 20_000,
    regions: int = 36,
    img_dim: int = 2048,
    batch: int = 128,
    device: str = "cpu",
    steps: int = 20,
    warmup: int = 3,
    rounds: int = 5,
    recipe: str = "vse_infty",
    overrides: Sequence[str] = (),
    paths: Sequence[str] = ("auto",),
    data_dir: str | Path | None = None,
    seed: int = 0,
) -> dict:
    """samples/s of the training data path(s) and of the bare gather, timed alternately in `rounds` rounds of
    `steps` batches each (after `warmup` untimed ones); `paths` are values of train.data_on_device, each a row.
    The first row's figures are the result's top-level `samples_per_s` / `bare_gather_samples_per_s` / `ratio`."""
    if steps < 1 or warmup < 0 or rounds < 1 or batch < 2:
        raise VseInputError(
            f"need steps >= 1, warmup >= 0, rounds >= 1, batch >= 2; got {steps}, {warmup}, {rounds}, {batch}"
        )
    dev = torch.device(device)
    tmp = None
    try:
        if data_dir is None:
            tmp = Path(tempfile.mkdtemp(prefix="vsekit-bench-data-"))
            t0 = time.perf_counter()
            data_dir = write_coco_like(tmp, n, regions, img_dim, seed=seed)
            write_s = time.perf_counter() - t0
        else:
            write_s = 0.0
        built = []
        for p in paths:
            t0 = time.perf_counter()
            data = build_data(data_dir, recipe, batch, device, [*overrides, f"train.data_on_device={p}"])
            built.append((p, data, endless_batches(data), time.perf_counter() - t0))
        features = bare_gather_source(data_dir, dev)
        g = torch.Generator(device=dev).manual_seed(seed)
        for _, _, it, _ in built:
            time_batches(it, warmup, dev)
        time_bare_gather(features, batch, max(1, warmup), g)
        time_bare_gather(features, batch, max(1, warmup), g, index_select=True)
        spent = {p: 0.0 for p in paths}
        bare = bare_sel = 0.0
        for _ in range(rounds):  # alternate, so a shared machine's load falls on all of them alike
            for p, _, it, _ in built:
                spent[p] += time_batches(it, steps, dev)
            bare += time_bare_gather(features, batch, steps, g)
            bare_sel += time_bare_gather(features, batch, steps, g, index_select=True)
        samples = rounds * steps * batch
        bare_rate, sel_rate = samples / bare, samples / bare_sel
        rows = []
        for p, data, _, setup in built:
            rate = samples / spent[p]
            rows.append(
                {
                    "setting": str(p).lower(),
                    "path": data.path,
                    "reason": data.reason,
                    "samples_per_s": rate,
                    "bare_gather_samples_per_s": bare_rate,
                    "ratio": rate / bare_rate,
                    "bare_index_select_samples_per_s": sel_rate,
                    "ratio_index_select": rate / sel_rate,
                    "setup_s": setup,
                }
            )
        first = rows[0]
        return {
            "samples_per_s": first["samples_per_s"],
            "bare_gather_samples_per_s": bare_rate,
            "ratio": first["ratio"],
            "bare_index_select_samples_per_s": sel_rate,
            "ratio_index_select": first["ratio_index_select"],
            "rows": rows,
            "n": int(features.shape[0]),
            "regions": int(features.shape[1]),
            "img_dim": int(features.shape[2]),
            "batch": batch,
            "device": str(dev),
            "steps": steps,
            "rounds": rounds,
            "warmup": warmup,
            "recipe": recipe,
            "write_s": write_s,
            "threads": torch.get_num_threads(),
        }
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
