"""AVSE ablation (paper Table 3) on a small dataset: views 1/2/4, block size d2, Sinkhorn on/off, the
Sinkhorn iteration count c, the view regulariser on/off — beside VSE∞ — with several seeds; and the
paper-vs-released-code switches (AEOM readout, L_reg normalisation, views of the full vs the size-augmented
set). Each run also records ‖∇ L_reg‖ / ‖∇ L_rank‖ on the image embedding (one training batch, at
initialisation and for the best checkpoint; `vsekit_lab.bench.view_reg.view_reg_grad_ratio`).

Each (variant, seed) trains with the same small config, keeps the best-on-dev epoch, and is scored on the
test split; the Markdown table goes into docs/avse.md between the `ablation` markers.

    nice -n 10 .venv/bin/python scripts/experiments/avse_ablation.py --data data/openclipart \\
        --out runs/avse/ablation --seeds 0 1 2
    .venv/bin/python scripts/experiments/avse_ablation.py --out runs/avse/ablation --report-only

Runs that finished (result.json present) are skipped, so an interrupted grid resumes; `--variants` picks
a subset, and the table is rewritten from whatever results exist (partial grids say so).
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

from vsekit.config import load_recipe, to_dict
from vsekit.evaluation import evaluate_model
from vsekit.runs import load_weights
from vsekit.training.trainer import Trainer
from vsekit_lab.bench.view_reg import view_reg_grad_ratio

REPO = Path(__file__).resolve().parents[2]

# the small, fast config every variant shares (openclipart: EfficientNet-Lite0 grid features, BiGRU text).
# d1 = 128 and d2 = 64 keep the paper's block layout (d1/d2 = 2 caption blocks, 2 views -> 4 image blocks).
SMALL = [
    "model.embed_dim=128",
    "model.image.feature_type=grid",
    "model.text.kind=bigru",
    "model.text.vocab_min_count=1",
    "model.text.word_dim=300",
    "train.batch_size=128",
    "data.captions_per_image=1",
    "train.log_every=0",
    "train.eval_batch_size=512",
]
AVSE_SMALL = ["model.similarity.block_dim=64"]

# key -> (table label, recipe, overrides)
# The avse recipe's defaults follow the released code where it and the paper differ (docs/reproduce.md):
# log-plan readout, L_reg with /B, views of the full set.
VARIANTS: dict[str, tuple[str, str, list[str]]] = {
    # the floor every table carries: the `bow` recipe with its own schedule (30 epochs), none of SMALL
    "floor": ("Floor: bag of words (linear, `bow` recipe)", "bow", []),
    "vse_infty": ("VSE∞ (1 view, cosine)", "vse_infty", []),
    "avse": ("AVSE: 2 views, d2 = d1/2, c = 20, L_reg", "avse", AVSE_SMALL),
    "views1": (
        "1 view (AEOM, no L_reg: needs 2 views)",
        "avse",
        AVSE_SMALL + ["model.image.views=1", "loss.view_reg_weight=0"],
    ),
    "views4": ("4 views", "avse", AVSE_SMALL + ["model.image.views=4"]),
    "d2_32": ("d2 = d1/4 (32)", "avse", ["model.similarity.block_dim=32"]),
    "d2_128": ("d2 = d1 (128)", "avse", ["model.similarity.block_dim=128"]),
    "no_sinkhorn": (
        "no Sinkhorn (released code: block max-sum)",
        "avse",
        AVSE_SMALL + ["model.similarity.use_sinkhorn=false"],
    ),
    "c5": ("c = 5 Sinkhorn iterations", "avse", AVSE_SMALL + ["model.similarity.sinkhorn_iters=5"]),
    "c50": ("c = 50 Sinkhorn iterations", "avse", AVSE_SMALL + ["model.similarity.sinkhorn_iters=50"]),
    "no_reg": ("no L_reg", "avse", AVSE_SMALL + ["loss.view_reg_weight=0"]),
    "reg_paper": ("L_reg as Eq. 3 (no /B)", "avse", AVSE_SMALL + ["loss.view_reg_variant=paper"]),
    "readout_plan": (
        "AEOM reads the plan's probabilities (Eq. 2 literally)",
        "avse",
        AVSE_SMALL + ["model.similarity.readout=plan"],
    ),
    "views_after_aug": (
        "views drawn after size augmentation (~60 % per view)",
        "avse",
        AVSE_SMALL + ["model.image.view_size_augment=true"],
    ),
    "earlier_defaults": (
        "vsekit's earlier defaults (plan readout, Eq. 3 L_reg, views after size aug., wd 1e-4)",
        "avse",
        AVSE_SMALL
        + [
            "model.similarity.readout=plan",
            "loss.view_reg_variant=paper",
            "model.image.view_size_augment=true",
            "optim.weight_decay=1e-4",
        ],
    ),
}
DEFAULT_VARIANTS = [
    "floor",
    "vse_infty",
    "avse",
    "no_sinkhorn",
    "no_reg",
    "views1",
    "views4",
    "d2_128",
    "c5",
    "readout_plan",
    "reg_paper",
    "views_after_aug",
]
KEYS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum"]
BEGIN = (
    "<!-- ablation:begin (written by scripts/experiments/avse_ablation.py; edits here are overwritten) -->"
)
END = "<!-- ablation:end -->"


def overrides_for(key: str, seed: int, args: argparse.Namespace) -> list[str]:
    _, recipe, own = VARIANTS[key]
    if recipe == "bow":  # the floor is one fixed recipe: only the seed changes
        return [f"train.seed={seed}", "train.log_every=0", "train.eval_batch_size=512"]
    sched = [
        f"train.seed={seed}",
        f"train.epochs={args.epochs}",
        f"optim.lr_decay_epochs=[{args.decay_epoch}]",
    ]
    return SMALL + sched + own + args.set


def run_one(key: str, seed: int, args: argparse.Namespace) -> dict:
    run_dir = Path(args.out) / key / f"seed{seed}"
    done = run_dir / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    label, recipe_name, _ = VARIANTS[key]
    over = overrides_for(key, seed, args)
    recipe = load_recipe(recipe_name, over)
    t0 = time.perf_counter()
    trainer = Trainer(recipe, args.data, run_dir, overwrite=True, progress=False, log=lambda *_: None)
    probe = next(iter(trainer.loader)) if uses_reg(recipe) else None  # the first training batch
    ratio_init = view_reg_grad_ratio(trainer.model, probe, recipe.loss) if probe else None
    trainer.fit()
    train_s = time.perf_counter() - t0
    load_weights(trainer.model, run_dir / "best.safetensors")
    ratio_best = view_reg_grad_ratio(trainer.model, probe, recipe.loss) if probe else None
    t1 = time.perf_counter()
    test, _, _ = evaluate_model(
        trainer.model,
        args.data,
        "test",
        batch_size=recipe.train.eval_batch_size,
        device=trainer.device,
        progress=False,
    )
    eval_s = time.perf_counter() - t1
    best = json.loads((run_dir / "best.json").read_text())
    dustbin = getattr(trainer.model.sim, "dustbin", None)
    result = {
        "variant": key,
        "label": label,
        "recipe": recipe_name,
        "seed": seed,
        "overrides": over,
        "test": {k: test[k] for k in KEYS},
        "best_dev_epoch": best["epoch"],
        "best_dev_rsum": best["rsum"],
        "train_s": train_s,
        "test_eval_s": eval_s,
        "dustbin": None if dustbin is None else dustbin.item(),
        "reg_grad_ratio_init": ratio_init,
        "reg_grad_ratio_best": ratio_best,
        "resolved_recipe": to_dict(recipe),
    }
    done.write_text(json.dumps(result, indent=1))
    print(
        f"{key} seed {seed}: test rsum {test['rsum']:.1f} (best dev epoch {best['epoch']}) {train_s:.0f}s",
        flush=True,
    )
    return result


def uses_reg(recipe) -> bool:
    return recipe.loss.view_reg_weight > 0 and recipe.model.image.views > 1


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def table(results: dict[str, list[dict]]) -> str:
    head = (
        "| Variant | seeds | i2t R@1 | i2t R@5 | i2t R@10 | t2i R@1 | t2i R@5 | t2i R@10 | RSUM | Δ vs AVSE | z "
        "| ‖∇reg‖/‖∇rank‖ init → best | train s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    ref = results.get("avse")
    base = statistics.fmean(r["test"]["rsum"] for r in ref) if ref else None
    for key, rs in results.items():
        cells = [VARIANTS[key][0], str(len(rs))] + [mean_std([r["test"][k] for r in rs]) for k in KEYS]
        rsum = statistics.fmean(r["test"]["rsum"] for r in rs)
        cells.append("—" if base is None or key == "avse" else f"{rsum - base:+.1f}")
        z = [r["dustbin"] for r in rs if r.get("dustbin") is not None]
        uses_z = "use_sinkhorn=false" not in " ".join(rs[0]["overrides"]) and z
        cells.append(f"{statistics.fmean(z):.2f}" if uses_z else "—")
        init = [r["reg_grad_ratio_init"]["ratio"] for r in rs if r.get("reg_grad_ratio_init")]
        best = [r["reg_grad_ratio_best"]["ratio"] for r in rs if r.get("reg_grad_ratio_best")]
        cells.append(f"{statistics.fmean(init):.3g} → {statistics.fmean(best):.3g}" if init and best else "—")
        cells.append(f"{statistics.fmean(r['train_s'] for r in rs):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def write_docs(results: dict[str, list[dict]], args: argparse.Namespace, command: str) -> None:
    path = Path(args.docs)
    missing = [k for k in args.variants if len(results.get(k, [])) < len(args.seeds)]
    block = [
        BEGIN,
        f"Test split of `{args.data}`; best-on-dev epoch of each run; mean ± std over seeds. R@K in %, "
        "RSUM = sum of the six; z = learned dustbin score at the end of training (mean over seeds); "
        "‖∇reg‖/‖∇rank‖ = gradient-norm ratio of weight × L_reg to the hardest-negative ranking loss on the image "
        "embedding, first training batch, at initialisation → best checkpoint (mean over seeds).",
        ""
        if not missing
        else f"**Partial grid**: fewer than {len(args.seeds)} seeds finished for: {', '.join(missing)}.",
        "",
        table(results),
        "",
        "Shared overrides: `"
        + " ".join(
            SMALL
            + ["train.seed=S", f"train.epochs={args.epochs}", f"optim.lr_decay_epochs=[{args.decay_epoch}]"]
            + args.set
        )
        + "`.",
        "",
        "Command: `" + command + "`",
        END,
    ]
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if BEGIN in text and END in text:
        text = text[: text.index(BEGIN)] + "\n".join(block) + text[text.index(END) + len(END) :]
    else:
        text = text.rstrip() + "\n\n" + "\n".join(block) + "\n"
    path.write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", default="data/openclipart")
    ap.add_argument("--out", required=True, help="directory for the runs (outside the repository)")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=sorted(VARIANTS))
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--decay-epoch", type=int, default=2)
    ap.add_argument("--set", nargs="*", default=[], help="extra key=value overrides for every run")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--docs", default=str(REPO / "docs" / "avse.md"))
    ap.add_argument("--report-only", action="store_true", help="only rewrite the table from finished runs")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    command = "nice -n 10 .venv/bin/python scripts/experiments/avse_ablation.py " + shlex.join(
        argv if argv is not None else sys.argv[1:]
    )
    results: dict[str, list[dict]] = {}
    for seed in args.seeds:  # seed-major: a stopped grid still has every variant at the first seeds
        for key in args.variants:
            done = Path(args.out) / key / f"seed{seed}" / "result.json"
            if args.report_only and not done.is_file():
                continue
            results.setdefault(key, []).append(run_one(key, seed, args))
            if not args.report_only:
                write_docs({k: results[k] for k in args.variants if k in results}, args, command)
    write_docs({k: results[k] for k in args.variants if k in results}, args, command)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
