"""How well each epoch's NCR / IN2R split finds the mismatched pairs, read from the runs' own records: every
`kind: split` line of RUN/metrics.jsonl carries each network's AUC against the dataset's recorded noise. The
split of epoch e+1 is made at its start from the weights that ended epoch e, so the split of the best weights is
the one recorded one epoch after best.json's; none exists when the best epoch is the last.

    .venv/bin/python scripts/experiments/split_auc.py runs/noisy_wesnoth/c*/ncr_bigru/seed* \\
        runs/noisy_wesnoth/c*/in2r_bigru/seed* --png docs/figures/noisy_wesnoth_split_auc.png [--json-out F]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np


def split_records(run: Path) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, filter(None, lines)) if r.get("kind") == "split"]


def summary(run: Path) -> dict | None:
    """Per network: the AUC (%) of the best weights' split, of the last split, and every epoch's; None for a
    run whose dataset records no noise (its splits carry no AUC)."""
    best_epoch = json.loads((run / "best.json").read_text())["epoch"]
    records = split_records(run)
    if not records or "auc" not in records[0].get("A", {}):
        return None
    out: dict = {"run": str(run), "best_epoch": best_epoch, "epochs": [r["epoch"] for r in records]}
    of_best = [r for r in records if r["epoch"] == best_epoch + 1]
    for net in ("A", "B"):
        aucs = [100 * r[net]["auc"] for r in records]
        out[net] = {
            "per_epoch": aucs,
            "best_weights": 100 * of_best[0][net]["auc"] if of_best else None,
            "last": aucs[-1],
            "labeled_last": records[-1][net]["labeled"],
        }
    return out


TITLES = {"ncr_bigru": "NCR", "in2r_bigru": "IN2R", "ncr_no_unlabeled": "NCR, no unlabeled steps"}
LEVELS = {"c": "", "i": ", image level"}


def rate_label(tag: str) -> str:
    """`c20` (noisy_table's folder of a rate) as `20 %`."""
    return f"{int(tag[1:])} %{LEVELS.get(tag[0], '')}" if tag[1:].isdigit() else tag


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        run = Path(r["run"])
        groups.setdefault((run.parent.name, run.parent.parent.name), []).append(r)
    methods = sorted({m for m, _ in groups})
    rates = sorted({t for _, t in groups})
    fig, axes = plt.subplots(1, len(methods), figsize=(5.5 * len(methods), 4), squeeze=False, sharey=True)
    colours = plt.get_cmap("viridis")(np.linspace(0, 0.85, len(rates)))
    for ax, method in zip(axes[0], methods):
        for colour, tag in zip(colours, rates):
            for k, r in enumerate(groups.get((method, tag), [])):
                auc = np.mean([r["A"]["per_epoch"], r["B"]["per_epoch"]], axis=0)
                ax.plot(r["epochs"], auc, color=colour, alpha=0.8, label=rate_label(tag) if k == 0 else None)
                if r["A"]["best_weights"] is not None:
                    best = (r["A"]["best_weights"] + r["B"]["best_weights"]) / 2
                    ax.plot([r["best_epoch"] + 1], [best], "o", color=colour)
        ax.set_title(f"{TITLES.get(method, method)}: each epoch's split (mean of A and B)", fontsize=10)
        ax.set_xlabel("epoch (dot: the split of the best-on-dev weights)")
        ax.grid(alpha=0.3)
        ax.legend(title="noise")
    axes[0][0].set_ylabel("AUC (%) of finding the mismatched pairs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--png", type=Path)
    p.add_argument("--json-out", type=Path)
    args = p.parse_args()
    rows = []
    for run in args.runs:
        row = summary(run)
        if row is None:
            print(f"{run}: skipped, its splits carry no AUC (the dataset records no noise)")
        else:
            rows.append(row)
    print(
        "| run | best epoch | split of the best weights A / B | last split A / B | labeled at the end A / B |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        best = " / ".join(
            "–" if r[n]["best_weights"] is None else f"{r[n]['best_weights']:.1f}" for n in "AB"
        )
        last = " / ".join(f"{r[n]['last']:.1f}" for n in "AB")
        labeled = " / ".join(str(r[n]["labeled_last"]) for n in "AB")
        print(f"| {r['run']} | {r['best_epoch']} | {best} | {last} | {labeled} |")
    if args.json_out:
        args.json_out.write_text(json.dumps(rows, indent=1))
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
