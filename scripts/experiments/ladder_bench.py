"""Step-time benchmark of the ladder losses (the budget: adaptive ladder step <= 1.3x a VSE++ step at
batch 128), plus a device-agnosticism check: the loss and the adaptive levels on `--device` equal CPU's.

    nice -n 10 .venv/bin/python scripts/experiments/ladder_bench.py --device cpu --threads 1
    PYTHONPATH=src python3 scripts/experiments/ladder_bench.py --device cuda      # on a GPU machine
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from vsekit.losses.ladder import LadderLoss
from vsekit_lab.bench.ladder import bench_ladder_step


def device_matches_cpu(device: str, batch: int = 128, seed: int = 0) -> dict:
    """Adaptive ladder loss on `device` vs CPU on one random batch: same levels, same loss (float tolerance)."""
    g = torch.Generator().manual_seed(seed)
    sims = torch.rand(batch, batch, generator=g) * 2 - 1
    topics = torch.nn.functional.normalize(torch.randn(16, 384, generator=g), dim=-1)
    emb = topics[torch.randint(0, 16, (batch,), generator=g)] + 0.08 * torch.randn(batch, 384, generator=g)
    e = torch.nn.functional.normalize(emb, dim=-1)
    rel = e @ e.T
    rel = (rel + rel.T) / 2
    ids = torch.arange(batch)
    out = {}
    for dev in ("cpu", device):
        loss = LadderLoss([0.2, 0.01, 0.01, 0.01], [1, 0.25, 0.125, 0.0625], adaptive=True).to(dev)
        lv, k = loss.levels(rel.to(dev), torch.eye(batch, dtype=torch.bool, device=dev))
        value, _ = loss(sims.to(dev), image_ids=ids.to(dev), relevance=rel.to(dev))
        out[dev] = (lv.cpu(), k.cpu(), float(value))
    return {
        "levels_equal": bool(torch.equal(out["cpu"][0], out[device][0])),
        "k_equal": bool(torch.equal(out["cpu"][1], out[device][1])),
        "loss_cpu": out["cpu"][2],
        f"loss_{device}": out[device][2],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, nargs="+", default=[128])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = leave as is)")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device != "cpu":
        print(json.dumps(device_matches_cpu(args.device)), flush=True)
    for b in args.batch:
        row = bench_ladder_step(batch=b, device=args.device, repeats=args.repeats)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
