"""`vse bench co-teaching`: what NCR's two networks cost against one, in one process on one dataset.

Trains, one after the other in this process, `--epochs` epochs of VSE∞ (one network) and of NCR (two networks,
the co-teaching trainer) on the same precomp set with the same overrides, NCR warmed up for one epoch and
training its unlabeled pairs from its second epoch on (so every later epoch is a full co-teaching epoch:
split pass, both phases, labeled and unlabeled steps). From the runs' own metrics.jsonl records it reports:

- one network's epoch (VSE∞'s training seconds per epoch, the warm-up epoch left out as for NCR);
- a two-network epoch (NCR's training seconds per split epoch, both phases) and its ratio to the one above;
- the split pass per network against that network's phase of the epoch (the pass scores every pair; the
  phase trains on the peer's labeled pairs and as many unlabeled batches).

    from vsekit_lab.bench.co_teaching import bench_co_teaching
    res = bench_co_teaching("data/noisy/openclipart_c40", epochs=2, overrides=[...])
"""

from __future__ import annotations

import json
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

from vsekit.config import load_recipe
from vsekit.training.trainer import Trainer


def _records(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if x.strip()]


def bench_co_teaching(
    data_dir: str | Path,
    epochs: int = 2,
    device: str = "cpu",
    overrides: Sequence[str] = (),
    work: str | Path | None = None,
    pair_recipe: str = "ncr",
) -> dict:
    """Train VSE∞ and a two-network recipe (`pair_recipe`: ncr, or in2r) for `epochs` epochs each (module
    docstring) and return the timings (seconds) and ratios; `work` keeps the runs (default: a temporary
    folder, removed)."""
    if epochs < 2:
        raise ValueError("epochs must be at least 2 (NCR's first epoch is its warm-up)")
    base = [*overrides, f"train.epochs={epochs}", f"train.device={device}", "optim.lr_decay_epochs=[1000]"]
    with tempfile.TemporaryDirectory(dir=work) as tmp:
        runs = {}
        for name, recipe_name, extra in (
            ("one", "vse_infty", ["loss.warmup_epochs=1"]),
            ("pair", pair_recipe, ["loss.warmup_epochs=1", "train.sample_policy.unlabeled_start_epoch=1"]),
        ):
            run = Path(tmp) / name
            recipe = load_recipe(recipe_name, base + extra)
            Trainer(recipe, data_dir, run, progress=False, log=lambda *_: None).fit()
            runs[name] = _records(run)
    one = [r["train_time_s"] for r in runs["one"] if r["kind"] == "epoch" and r["epoch"] > 1]
    pair = [r["train_time_s"] for r in runs["pair"] if r["kind"] == "epoch" and r["epoch"] > 1]
    splits = [r for r in runs["pair"] if r["kind"] == "split"]
    phases = {r["epoch"]: r for r in runs["pair"] if r["kind"] == "phases"}
    ratios = []
    for s in splits:
        for net in ("A", "B"):
            ratios.append(s[net]["pass_s"] / phases[s["epoch"]]["train_time_s"][net])
    one_s, pair_s = statistics.fmean(one), statistics.fmean(pair)
    return {
        "data": str(data_dir),
        "pair_recipe": pair_recipe,
        "epochs": epochs,
        "device": device,
        "overrides": list(overrides),
        "one_network_epoch_s": one_s,
        "two_network_epoch_s": pair_s,
        "two_over_one": pair_s / one_s,
        "split_pass_s": statistics.fmean(s["split_time_s"] for s in splits),
        "split_over_phase": statistics.fmean(ratios),
        "split_over_phase_max": max(ratios),
        "split_per_network_over_one_epoch": statistics.fmean(
            s[n]["pass_s"] for s in splits for n in ("A", "B")
        )
        / one_s,
        "phase_steps": [phases[s["epoch"]]["steps"] for s in splits],
    }
