"""Pooling cost: forward + backward time of each pooling on one batch of sets.

VSE+2AD (§3.2) argues that ADPOOL is "much faster and simpler than complex aggregators, as it introduces
only a small number of parameters"; this measures its cost, and GPO's, against avg pooling on the machine
at hand. `adpool-ref` is the released code's token scorer (a D x D layer). Each pooling gets the same random features (requires_grad,
so avg/max pay for their backward too) and the sum of its output is back-propagated.

    from vsekit_lab.bench.pool import bench_pool
    rows = bench_pool(batch=128, n=36, dim=1024, device="cpu", repeats=20)

or from a shell: `vse bench pool --device cuda --batch 128 --n 36 --dim 1024`.
"""

from __future__ import annotations

import statistics
import time

import torch

from vsekit.config import PoolingConfig
from vsekit.errors import VseInputError
from vsekit.pooling import create_pooling

POOLINGS = ("avg", "max", "kmax", "gpo", "adpool", "adpool-ref")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench_pool(
    batch: int = 128,
    n: int = 36,
    dim: int = 1024,
    device: str = "cpu",
    repeats: int = 20,
    warmup: int = 3,
    poolings: tuple[str, ...] = POOLINGS,
    variable_lengths: bool = False,
    seed: int = 0,
    kmax_k: int = 5,
) -> list[dict]:
    """Time forward+backward of each pooling on `[batch, n, dim]` features; one dict per pooling.

    `variable_lengths` draws set sizes in [1, n] (text-like) instead of all sets full (region-like).
    Times are wall-clock milliseconds per forward+backward after `warmup` untimed calls; `vs_avg` is
    the ratio to the avg pooling's median when avg is in `poolings`.
    """
    if batch < 1 or n < 1 or dim < 1 or repeats < 1 or warmup < 0:
        raise VseInputError("batch, n, dim and repeats must be positive and warmup non-negative")
    unknown = [p for p in poolings if p not in POOLINGS]
    if unknown:
        raise VseInputError(f"unknown pooling(s) {unknown}; choose from {', '.join(POOLINGS)}")
    dev = torch.device(device)
    g = torch.Generator().manual_seed(seed)
    feats = torch.randn(batch, n, dim, generator=g)
    if variable_lengths:
        lengths = torch.randint(1, n + 1, (batch,), generator=g)
        lengths[0] = n
    else:
        lengths = torch.full((batch,), n, dtype=torch.long)
    feats, lengths = feats.to(dev), lengths.to(dev)
    rows = []
    for name in poolings:
        torch.manual_seed(seed)  # module init draws from the default generator
        # "adpool" = the paper's scorer (one weight per rank), "adpool-ref" = the released D x D one (the recipe default)
        cfg = (
            PoolingConfig(name="adpool", adpool_variant="reference")
            if name == "adpool-ref"
            else PoolingConfig(name=name, k=kmax_k, adpool_variant="paper")
        )
        pool = create_pooling(cfg, dim).to(dev)
        x = feats.clone().requires_grad_(True)
        times = []
        for i in range(warmup + repeats):
            x.grad = None
            pool.zero_grad(set_to_none=True)
            _sync(dev)
            t0 = time.perf_counter()
            pool(x, lengths).sum().backward()
            _sync(dev)
            if i >= warmup:
                times.append((time.perf_counter() - t0) * 1e3)
        rows.append(
            {
                "pooling": name,
                "batch": batch,
                "n": n,
                "dim": dim,
                "device": str(dev),
                "threads": torch.get_num_threads(),
                "variable_lengths": variable_lengths,
                "repeats": repeats,
                "params": sum(p.numel() for p in pool.parameters()),
                "ms_median": statistics.median(times),
                "ms_mean": statistics.fmean(times),
                "ms_std": statistics.stdev(times) if len(times) > 1 else 0.0,
                "ms_min": min(times),
            }
        )
    base = next((r["ms_median"] for r in rows if r["pooling"] == "avg"), None)
    for r in rows:
        r["vs_avg"] = r["ms_median"] / base if base else float("nan")
    return rows
