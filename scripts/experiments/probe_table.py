"""The order probe's table (docs/probes.md): every run of a set scored on the same items, mean ± std over seeds,
with chance and the text-only baseline in the table.

Each `--run LABEL=PATTERN` names a row; PATTERN is a run folder with `{seed}` where the seed goes. The first run
found writes the items (`vse eval --probe order --probe-seed S`); every other run and seed is scored on exactly
those items (`--probe-items`), so the rows differ by the model only.

    .venv/bin/python scripts/experiments/probe_table.py --data data/openclipart --out runs/probes/openclipart \\
        --run "Floor: bag of words=runs/noisy/c00/bow/seed{seed}" \\
        --run "VSE∞ (GPO), BiGRU=runs/noisy/c00/vse_infty_bigru/seed{seed}" --seeds 0 1 2

A run not trained to its last epoch is left out and named; a probe already scored is reused. Writes
OUT/probe_table.md and OUT/probe_table.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

PERTURBATIONS = ("shuffle_all", "shuffle_trigrams", "shuffle_within_trigrams", "shuffle_nouns_adjectives")


def slug(label: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in label.lower()).strip("_")


def finished(run: Path) -> bool:
    """Whether a run trained to its last epoch (its `last` state says so): a run still training has a best
    checkpoint already, which must not be probed."""
    try:
        epochs = json.loads((run / "config.json").read_text())["recipe"]["train"]["epochs"]
        state = json.loads((run / "last_state.json").read_text())["train_state"]
    except (OSError, KeyError, ValueError):
        return False
    return state["epoch"] >= epochs and state["step_in_epoch"] == 0 and (run / "best.json").is_file()


def score(run: Path, data: str, split: str, json_out: Path, items: Path | None, seed: int) -> dict:
    """One run's order probe (reused when its JSON exists)."""
    if not json_out.is_file():
        vse = Path(sys.executable).with_name("vse")
        cmd = [
            str(vse),
            "eval",
            str(run),
            "--data",
            data,
            "--split",
            split,
            "--device",
            "cpu",
            "--probe",
            "order",
        ]
        cmd += ["--probe-items", str(items)] if items else ["--probe-seed", str(seed)]
        subprocess.run(cmd + ["--json-out", str(json_out)], check=True)
    return json.loads(json_out.read_text())


def cell(values: list[float]) -> str:
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def table(rows: dict[str, list[dict]]) -> str:
    first = next(r for runs in rows.values() for r in runs)["results"]
    shown = [p for p in PERTURBATIONS if p in first and "skipped" not in first[p]]
    head = "| run | seeds | " + " | ".join(f"{p} (n={first[p]['n']})" for p in shown) + " |"
    lines = [head, "|" + "---|" * (len(shown) + 2)]
    lines.append("| chance | | " + " | ".join(f"{first[p]['chance']:.1f}" for p in shown) + " |")
    text_only = [
        f"{first[p]['text_only']:.1f} [{first[p]['text_only_ci_low']:.1f}, {first[p]['text_only_ci_high']:.1f}]"
        for p in shown
    ]
    lines.append("| text-only trigram baseline | | " + " | ".join(text_only) + " |")
    for label, runs in rows.items():
        seeds = ", ".join(str(r["_seed"]) for r in runs)
        cells = [cell([r["results"][p]["precision_at_1"] for r in runs]) for p in shown]
        lines.append(f"| {label} | {seeds} | " + " | ".join(cells) + " |")
    skipped = [f"{p}: {first[p]['skipped']}" for p in PERTURBATIONS if p in first and "skipped" in first[p]]
    return "\n".join(lines) + ("\n\nSkipped: " + "; ".join(skipped) if skipped else "") + "\n"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="the dataset every run is scored on")
    p.add_argument("--out", required=True, help="folder for the probes' JSON and the table")
    p.add_argument("--run", action="append", required=True, metavar="LABEL=PATTERN")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--split", default="test")
    p.add_argument("--probe-seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    items = out / "first.items.json"  # written beside first.json by the first run found
    rows: dict[str, list[dict]] = {}
    missing = []
    for spec in args.run:
        label, _, pattern = spec.partition("=")
        for s in args.seeds:
            run = Path(pattern.format(seed=s))
            if not finished(run):
                missing.append(str(run))
                continue
            json_out = out / f"{slug(label)}_s{s}.json"
            if not items.is_file():  # the first run found writes the items every other run reads
                score(run, args.data, args.split, out / "first.json", None, args.probe_seed)
            res = score(run, args.data, args.split, json_out, items, args.probe_seed)
            rows.setdefault(label, []).append({**res, "_seed": s})
    if not rows:
        print("no finished run found: " + ", ".join(missing), file=sys.stderr)
        return 2
    text = f"# Order probe on {args.data}, split {args.split} (precision@1 %, mean ± std over seeds)\n\n"
    text += table(rows)
    if missing:
        text += "\nNot finished (left out): " + ", ".join(missing) + "\n"
    (out / "probe_table.md").write_text(text, encoding="utf-8")
    (out / "probe_table.json").write_text(json.dumps(rows, indent=1, default=str), encoding="utf-8")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
