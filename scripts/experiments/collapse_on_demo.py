"""Does the collapse alarm stay silent on the demo's healthy runs? Trains every demo variant (the demo's own
recipes and overrides, `vsekit_lab.demo.demo_overrides`) with a far more sensitive alarm than the default
(`train.collapse_steps` = --steps, default 3 instead of 200) and reports, per run, the steps trained, the
final dev rsum and whether the alarm fired (a `collapse` record in metrics.jsonl).

    python scripts/experiments/collapse_on_demo.py --data data/openclipart --out runs/collapse_demo
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vsekit.config import load_recipe
from vsekit.training.trainer import Trainer
from vsekit_lab.demo import DEMO_EPOCHS, VARIANTS, demo_overrides


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the openclipart set (vse data openclipart --out DIR)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=3, help="train.collapse_steps for these runs")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--epochs", type=int, default=DEMO_EPOCHS)
    ap.add_argument("--variants", nargs="+", default=[v.name for v in VARIANTS])
    args = ap.parse_args()
    rows = []
    for variant in [v for v in VARIANTS if v.name in args.variants]:
        run_dir = Path(args.out) / variant.name
        recipe = load_recipe(
            variant.recipe,
            demo_overrides(variant, args.epochs)
            + [f"train.seed={args.seed}", f"train.collapse_steps={args.steps}"],
        )
        Trainer(recipe, args.data, run_dir, overwrite=run_dir.exists(), progress=False).fit()
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        fired = [r for r in records if r.get("kind") == "collapse"]
        vals = [r["rsum"] for r in records if r.get("kind") == "val"]
        state = json.loads((run_dir / "last_state.json").read_text())["train_state"]
        rows.append(
            (
                variant.name,
                state["global_step"],
                vals[-1] if vals else float("nan"),
                f"fired at step {fired[0]['step']}" if fired else "silent",
            )
        )
    print(f"| run | steps trained | last dev rsum | alarm (train.collapse_steps={args.steps}) |")
    print("|---|---|---|---|")
    for name, steps, rsum, verdict in rows:
        print(f"| {name} | {steps} | {rsum:.1f} | {verdict} |")


if __name__ == "__main__":
    main()
