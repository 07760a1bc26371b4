"""Resumable encoding: items embedded chunk by chunk under a work folder, each finished chunk saved, so a rerun
after Ctrl-C or a crash skips the finished ones and feeds the model exactly the batches an uninterrupted run
feeds it (`chunk_batches`). `vse index`, `vse index --refresh` and `vse embed` batch through this."""

from __future__ import annotations

import contextlib
import io
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from vsekit.data.precomp import DataFormatError
from vsekit.errors import VseInputError
from vsekit.utils.io import atomic_write_bytes, atomic_write_json

logger = logging.getLogger(__name__)


def _save_npz(path: Path, **arrays: np.ndarray) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    atomic_write_bytes(path, buf.getvalue())


def chunk_batches(lo: int, hi: int, batch_size: int) -> list[range]:
    """The batches rows lo..hi-1 of one chunk are encoded in: runs of `batch_size` rows starting at the chunk's
    own first row. A batch never spans two chunks and a chunk's batches do not depend on which chunks were
    encoded before it, so a resumed run feeds the model exactly the tensors an uninterrupted run feeds it, and
    its embeddings are bit-identical on any CPU, given the same number of threads (float32 products of other
    shapes, or split over other thread counts, may round differently, e.g. with AVX-512 kernels). `vse index`
    and `vse embed` both batch through this."""
    return [range(b, min(hi, b + batch_size)) for b in range(lo, hi, batch_size)]


def _work_plan(work_dir: Path, n: int, chunk_size: int) -> int:
    """The chunk size of `work_dir`'s finished chunks: the one its plan.json records when a run with the same
    items was interrupted (finished chunks are only reusable with their own boundaries), else `chunk_size`,
    recorded for a later resume. Chunk files without a readable plan are removed (their rows are unknown)."""
    plan = work_dir / "plan.json"
    old = None
    if plan.is_file():
        with contextlib.suppress(OSError, ValueError):
            old = json.loads(plan.read_text(encoding="utf-8"))
    if (
        isinstance(old, dict)
        and old.get("items") == n
        and isinstance(old.get("chunk_size"), int)
        and old["chunk_size"] > 0
    ):
        if old["chunk_size"] != chunk_size:
            logger.info(
                "%s: resuming with the chunk size this run started with (%d, not --chunk-size %d)",
                work_dir,
                old["chunk_size"],
                chunk_size,
            )
        return int(old["chunk_size"])
    for stale in work_dir.glob("chunk_*"):
        stale.unlink(missing_ok=True)
    atomic_write_json(plan, {"items": n, "chunk_size": chunk_size})
    return chunk_size


def encode_resumable(
    work_dir: Path,
    n: int,
    load: Callable[[int], Any],
    embed: Callable[[list], torch.Tensor],
    chunk_size: int = 256,
    batch_size: int = 16,
    strict: bool = False,
    progress: bool = True,
    desc: str = "index",
) -> tuple[np.ndarray, np.ndarray, list[str], list[int]]:
    """Embed items 0..n-1 chunk by chunk, saving each finished chunk, so a rerun skips finished work.

    Returns (embeddings flattened to [kept, F], kept item indices, problems, per-item embedding shape).
    An item whose `load` raises DataFormatError is skipped and reported (with `strict`, it stops the run).
    """
    from vsekit.utils.progress import progress_bar

    if chunk_size < 1 or batch_size < 1:
        raise VseInputError(f"--chunk-size and --batch-size must be >= 1, got {chunk_size} and {batch_size}")
    work_dir.mkdir(parents=True, exist_ok=True)
    chunk_size = _work_plan(work_dir, n, chunk_size)
    n_chunks = (n + chunk_size - 1) // chunk_size
    done = [c for c in range(n_chunks) if (work_dir / f"chunk_{c:06d}.npz").is_file()]
    start_count = sum(min(chunk_size, n - c * chunk_size) for c in done)
    bar = progress_bar(total=n, initial=start_count, desc=desc, unit="img", enabled=progress)
    for c in range(n_chunks):
        path = work_dir / f"chunk_{c:06d}.npz"
        if path.is_file():
            continue
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        embs, kept, problems, shape = [], [], [], []
        for batch in chunk_batches(lo, hi, batch_size):
            items = []
            for i in batch:
                try:
                    items.append(load(i))
                    kept.append(i)
                except DataFormatError as e:
                    if strict:
                        raise
                    problems.append(str(e))
            if items:
                out = embed(items)
                shape = list(out.shape[1:])
                embs.append(out.reshape(out.shape[0], -1).float().cpu())
            bar.update(len(batch))
        emb = torch.cat(embs).numpy() if embs else np.zeros((0, 0), dtype=np.float32)
        atomic_write_json(work_dir / f"chunk_{c:06d}.json", problems)
        _save_npz(
            path,
            emb=emb.astype(np.float32),
            kept=np.asarray(kept, dtype=np.int64),
            shape=np.asarray(shape, dtype=np.int64),
        )
    bar.close()
    embs, kept, problems, shape = [], [], [], []
    for c in range(n_chunks):
        with np.load(work_dir / f"chunk_{c:06d}.npz", allow_pickle=False) as z:
            if len(z["kept"]):
                embs.append(z["emb"])
                kept.append(z["kept"])
                shape = [int(v) for v in z["shape"]]
        problems += json.loads((work_dir / f"chunk_{c:06d}.json").read_text(encoding="utf-8"))
    if not embs:
        return np.zeros((0, 0), dtype=np.float32), np.zeros(0, dtype=np.int64), problems, shape
    return np.concatenate(embs), np.concatenate(kept), problems, shape
