"""Peak memory of one training step with and without gradient caching (`vse bench grad-cache`).

Each setting (`train.grad_cache_chunk` = 0, i.e. one pass over the whole batch, then each chunk size asked
for) runs in a fresh process (spawned), so that one measurement never inherits another's high-water mark or
allocator cache: the process builds the recipe's model and `TrainStep` at the given shapes (the same
synthetic batch and initial weights for every setting: `vsekit_lab.bench.train_step.build_train_step`), then
runs exactly one step and reports:

- CUDA: `torch.cuda.max_memory_allocated` over the step (reset just before it), and the memory allocated
  before it (model, optimizer, batch): what the step itself needs on top is `peak - before`;
- CPU: the process's peak resident set size (`getrusage(RUSAGE_SELF).ru_maxrss`, the kernel's high-water mark
  of touched pages, which sees torch's allocations, unlike tracemalloc) and the resident size just before the
  step (from /proc/self/statm). `peak - before` is then what the step added on top of what was resident, an
  upper bound of its live tensors (it also counts allocator slack and libraries first loaded by the step).
  If the setup's own transient peak was higher than the step's, the step's figure is not observable and the
  row says so (`step_peak_observed: false`).

The loss of the step is reported too: every setting scores the same batch with the same weights, so the
losses agree (up to float rounding), which shows the rows measure the same computation.

    from vsekit_lab.bench.grad_cache import bench_grad_cache
    rows = bench_grad_cache("vse_infty", batch=1024, chunks=[128], device="cpu")
"""

from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor

import torch

from vsekit.errors import VseInputError
from vsekit.utils.memory import peak_memory_bytes, rss_now_bytes, rss_peak_bytes


def measure_one_step(
    recipe: str,
    batch: int,
    chunk: int,
    device: str,
    overrides: list[str],
    regions: int,
    img_dim: int,
    embed_dim: int,
    vocab: int,
    threads: int,
    seed: int,
) -> dict:
    """One training step in *this* process (call it in a fresh one): its peak memory and wall time."""
    from vsekit_lab.bench.train_step import build_train_step

    if threads > 0:
        torch.set_num_threads(threads)
    dev = torch.device(device)
    sets = [*overrides, f"train.grad_cache_chunk={chunk}"]
    step_fn, data, epoch = build_train_step(
        recipe,
        batch=batch,
        device=device,
        overrides=sets,
        regions=regions,
        img_dim=img_dim,
        embed_dim=embed_dim,
        vocab=vocab,
        seed=seed,
    )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before, setup_peak = torch.cuda.memory_allocated(dev), 0
    else:
        before, setup_peak = rss_now_bytes(), rss_peak_bytes()
    t0 = time.perf_counter()
    out = step_fn(data, epoch=epoch, step=0)
    loss = float(out["loss"])  # waits for the device
    seconds = time.perf_counter() - t0
    peak, kind = peak_memory_bytes(dev)
    observed = dev.type == "cuda" or peak > setup_peak  # RSS: a step below the set-up's peak is not seen
    return {
        "chunk": chunk,
        "loss": loss,
        "seconds": seconds,
        "before_bytes": before,
        "peak_bytes": peak,
        "step_bytes": peak - before,
        "step_peak_observed": observed,
        "measure": kind,
        "params": sum(p.numel() for p in step_fn.model.parameters()),
        # encoder calls of the step (image + caption side per pass): 2 for the whole batch at once
        "encoder_calls": step_fn.grad_cache.passes if step_fn.grad_cache is not None else 2,
    }


def bench_grad_cache(
    recipe: str = "vse_infty",
    batch: int = 1024,
    chunks: list[int] | tuple[int, ...] = (128,),
    device: str = "cpu",
    overrides: list[str] | tuple[str, ...] = (),
    regions: int = 36,
    img_dim: int = 2048,
    embed_dim: int = 1024,
    vocab: int = 10_000,
    threads: int = 0,
    seed: int = 0,
) -> list[dict]:
    """One row per setting: the whole batch at once (chunk 0), then each chunk size, each in a fresh process."""
    if batch < 2:
        raise VseInputError(f"a training step needs at least 2 samples (negatives), got batch={batch}")
    bad = [c for c in chunks if c < 1]
    if bad:
        raise VseInputError(f"chunk sizes must be >= 1, got {bad}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise VseInputError(f"device {device!r}: CUDA is not available on this machine; use --device cpu")
    rows = []
    ctx = multiprocessing.get_context("spawn")
    for chunk in (0, *chunks):
        with ProcessPoolExecutor(max_workers=1, mp_context=ctx) as pool:  # a fresh process per setting
            row = pool.submit(
                measure_one_step,
                recipe,
                batch,
                chunk,
                device,
                list(overrides),
                regions,
                img_dim,
                embed_dim,
                vocab,
                threads,
                seed,
            ).result()
        rows.append(row)
    full = rows[0]
    for row in rows:
        row.update(
            recipe=recipe,
            batch=batch,
            device=device,
            shapes=f"{regions}x{img_dim} regions, embed {embed_dim}, vocab {vocab}",
            setting="whole batch" if row["chunk"] == 0 else f"chunks of {row['chunk']}",
            step_gib=row["step_bytes"] / 2**30,
            peak_gib=row["peak_bytes"] / 2**30,
            before_gib=row["before_bytes"] / 2**30,
            step_ratio=row["step_bytes"] / full["step_bytes"] if full["step_bytes"] > 0 else float("nan"),
            loss_diff=abs(row["loss"] - full["loss"]),
        )
    return rows
