"""Coherent-retrieval metrics (CS@K under both protocols, mean rank, mAP) of finished runs, e.g. the floor's:

    .venv/bin/python scripts/experiments/floor_coherence.py --data data/openclipart \\
        runs/demo/bow/seed0 runs/demo/bow/seed1 runs/demo/bow/seed2

Each run's best-on-dev weights are scored on the test split with `vsekit.evaluation.evaluate_model` and
`vsekit.metrics.coherence.coherence_metrics` (relevance: the split's MiniLM caption relevance, cached in the
dataset folder); printed as mean ± std over the runs.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from vsekit.evaluation import evaluate_model
from vsekit.metrics.coherence import coherence_metrics
from vsekit.relevance import split_relevance
from vsekit.runs import load_run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+")
    p.add_argument("--data", required=True)
    p.add_argument("--split", default="test")
    p.add_argument("--cs-k", type=int, nargs="+", default=[100, 500])
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    relevance = split_relevance(args.data, args.split)
    rows = []
    for run in args.runs:
        model, _ = load_run(run, "best", "cpu")
        metrics, sims, cap2img = evaluate_model(model, args.data, args.split, progress=False)
        for protocol in ("all_captions", "paper"):
            metrics.update(coherence_metrics(sims, cap2img, relevance, args.cs_k, protocol=protocol))
        rows.append(metrics)
    for key in rows[0]:
        values = [r[key] for r in rows]
        std = statistics.stdev(values) if len(values) > 1 else 0.0
        print(f"{key}: {statistics.fmean(values):.3f} ± {std:.3f}")


if __name__ == "__main__":
    main()
