"""`vse pooling`: the pooling weights a trained GPO learned, as a table and a plot."""

from __future__ import annotations

import argparse
from pathlib import Path

from vsekit.commands.argtypes import POSITIVE, in_range


def _label(run: str) -> str:
    p = Path(run).resolve()
    return f"{p.parent.name}/{p.name}" if p.name.startswith("seed") else p.name


def run_pooling(args: argparse.Namespace) -> int:
    from vsekit.pooling.inspect import gpo_profiles
    from vsekit.runs import load_run

    rows = []
    for run in args.runs:
        if not (Path(run) / "config.json").is_file():
            raise FileNotFoundError(f"{run}: not a run directory (no config.json)")
        model, _ = load_run(run, which=args.which)
        image_len = args.image_len or (49 if model.recipe.model.image.feature_type == "grid" else 36)
        profiles = gpo_profiles(model, {"image": image_len, "text": args.text_len})
        if not profiles:
            print(
                f"{run}: no GPO pooling (recipe pools with "
                f"{model.recipe.model.image.pooling.name} / {model.recipe.model.text.pooling.name})"
            )
        for p in profiles:
            rows.append({"run": _label(run), **p.as_dict()})
    if not rows:
        return 0
    print("| run | encoder | N | effective positions | distance from average | weights of positions 1-3 |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        top = ", ".join(f"{w:.3f}" for w in r["weights"][:3])
        print(
            f"| {r['run']} | {r['encoder']} | {r['length']} | {r['effective_positions']:.1f} | "
            f"{r['distance_from_average']:.2f} | {top} |"
        )
    print("(effective positions = exp(entropy): N for average pooling, 1 for max pooling)")
    from vsekit.commands.jsonout import emit_json

    emit_json(args, rows)
    if args.png:
        plot_profiles(rows, Path(args.png))
        print(f"plot: {args.png}")
    return 0


def plot_profiles(rows: list[dict], out_png: Path) -> None:
    """One panel per encoder: weight against sorted position, one line per run, average pooling dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    encoders = list(dict.fromkeys(r["encoder"] for r in rows))
    fig, axes = plt.subplots(1, len(encoders), figsize=(5.5 * len(encoders), 3.8), dpi=120, squeeze=False)
    for ax, enc in zip(axes[0], encoders):
        for r in (r for r in rows if r["encoder"] == enc):
            ax.plot(
                range(1, r["length"] + 1),
                r["weights"],
                marker="o",
                ms=2.5,
                label=f"{r['run']} (eff. {r['effective_positions']:.1f})",
            )
        n = max(r["length"] for r in rows if r["encoder"] == enc)
        ax.axhline(1.0 / n, color="grey", ls="--", lw=1, label=f"average pooling (1/{n})")
        ax.set_title(f"GPO weights: {enc}")
        ax.set_xlabel("sorted position (1 = largest value per dimension)")
        ax.set_ylabel("weight")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)


def register(sub) -> None:
    p = sub.add_parser("pooling", help="the pooling weights trained GPO runs learned (table, --png plot)")
    p.add_argument(
        "runs", nargs="+", metavar="RUN_DIR", help="training run folders (vse train --out); one row per GPO"
    )
    p.add_argument(
        "--image-len",
        type=int,
        default=0,
        action=in_range(0, note="0 = the default"),
        help="image set size (default: 49 for grid features, 36 for regions)",
    )
    p.add_argument(
        "--text-len", type=int, default=12, action=POSITIVE, help="caption length in tokens (default 12)"
    )
    p.add_argument(
        "--which", choices=["best", "last"], default="best", help="checkpoint to read (default: best on dev)"
    )
    p.add_argument("--png", help="plot weight against sorted position")
    from vsekit.commands.jsonout import add_json_args

    add_json_args(p, "every weight", path_form=True)
    p.set_defaults(func=run_pooling)
