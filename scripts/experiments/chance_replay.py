"""Would the chance alarm (`train.chance_validations`) have fired on runs already trained? Replays each run's
validation history (the `val` records of its metrics.jsonl) through `vsekit.training.chance.ChanceAlarm` on the
dev split of the set it was trained on (the trainer's own truncation: the first `data.val_max_images`), and
prints per run the chance level, the dev rsums and the epoch it would have fired at.

    python scripts/experiments/chance_replay.py --data data/openclipart runs/methods/*/seed?
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from vsekit.config import load_recipe
from vsekit.data.precomp import load_precomp_split
from vsekit.training.chance import ChanceAlarm

SHOWN = 10  # epochs of dev rsum printed per run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", required=True, help="the precomp set the runs were trained on")
    ap.add_argument("--patience", type=int, default=load_recipe("vse_infty").train.chance_validations)
    ap.add_argument("runs", nargs="+", type=Path, help="run folders (each with metrics.jsonl)")
    args = ap.parse_args()
    data = load_recipe("vse_infty").data
    dev = load_precomp_split(args.data, data.val_split, data.captions_per_image).truncate(data.val_max_images)
    print(f"dev split: {dev.n_images} images, {len(dev.cap2img)} captions")
    print("| run | chance rsum (mean ± std) | at chance below | dev rsum per epoch | fires at epoch |")
    print("|---|---|---|---|---|")
    for run in [r for r in args.runs if (r / "metrics.jsonl").is_file()]:
        records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        vals = [r["rsum"] for r in records if r.get("kind") == "val"]
        alarm = ChanceAlarm(dev.cap2img, dev.n_images, args.patience)
        fired = next((e for e, v in enumerate(vals, 1) if alarm.update(e, v)), None)
        shown = ", ".join(f"{v:.0f}" for v in vals[:SHOWN]) + (", …" if len(vals) > SHOWN else "")
        print(
            f"| {run} | {alarm.mean:.1f} ± {alarm.std:.1f} | {alarm.limit:.1f} | {shown} | "
            f"{fired if fired else 'silent'} |"
        )


if __name__ == "__main__":
    main()
