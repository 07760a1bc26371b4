"""VSE+2AD ablation (paper Table 3) + convergence curve (Appendix A.2) + K per iteration (Appendix C).

Trains each variant for each seed with the same small config, selects the best-on-dev epoch, scores it on
test, and writes the Markdown table into docs/vse_2ad.md (between the `ablation` markers) and two PNGs
into docs/figures/. Dev rsum is also measured every `--eval-every` iterations for the variants with and
without ADOPT (training is chunked with `Trainer.fit(max_steps=...)`; the evaluation in between does not
touch the training randomness, so the trajectory is the one an unchunked run takes).

    nice -n 10 .venv/bin/python scripts/experiments/vse_2ad_ablation.py --data data/openclipart \
        --out runs/vse_2ad --seeds 0 1 2
    .venv/bin/python scripts/experiments/vse_2ad_ablation.py --out runs/vse_2ad --report-only

Runs that finished (result.json present) are skipped, so an interrupted grid resumes.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from vsekit.config import load_recipe, to_dict
from vsekit.evaluation import evaluate_model, split_similarities
from vsekit.runs import load_weights
from vsekit.training.trainer import Trainer

REPO = Path(__file__).resolve().parents[2]

# the small, fast config every variant shares (openclipart: EfficientNet-Lite0 grid features, BiGRU text)
SMALL = [
    "model.embed_dim=256",
    "model.image.feature_type=grid",
    "model.text.kind=bigru",
    "model.text.vocab_min_count=1",
    "train.batch_size=128",
    "data.captions_per_image=1",
    "train.log_every=10",
    "train.eval_batch_size=512",
]

# key -> (table label, recipe, overrides, dense dev evaluation)
VARIANTS: dict[str, tuple[str, str, list[str], bool]] = {
    # the floor every table carries: the `bow` recipe with its own schedule (30 epochs), none of SMALL
    "floor": ("Floor: bag of words (linear, `bow` recipe)", "bow", [], False),
    # the recipe's defaults: the released code's ADPOOL scorer (D x D + ReLU) and K rule (docs/reproduce.md)
    "full": ("VSE+2AD (ADPOOL + ADOPT)", "vse_2ad", [], True),
    "no_tok": (
        "− *tok* ADPOOL (embedding-level only)",
        "vse_2ad",
        ["model.image.pooling.token_level=false", "model.text.pooling.token_level=false"],
        False,
    ),
    "no_emb": (
        "− *emb* ADPOOL (token-level only)",
        "vse_2ad",
        ["model.image.pooling.embedding_level=false", "model.text.pooling.embedding_level=false"],
        False,
    ),
    "no_adpool": (
        "− ADPOOL (mean pooling)",
        "vse_2ad",
        ["model.image.pooling.name=avg", "model.text.pooling.name=avg"],
        False,
    ),
    "no_adopt": (
        "− ADOPT (hardest-negative triplet)",
        "vse_2ad",
        ["loss.name=triplet", "loss.margin=0.2", "loss.max_violation=true", "loss.warmup_epochs=0"],
        True,
    ),
    "vse_infty": ("VSE∞ (GPO + triplet, 1 warm-up epoch)", "vse_infty", [], False),
    "no_adopt_warmup": (
        "− ADOPT, triplet after 1 all-negatives warm-up epoch",
        "vse_2ad",
        ["loss.name=triplet", "loss.margin=0.2", "loss.max_violation=true", "loss.warmup_epochs=1"],
        False,
    ),
    "infonce": ("ADOPT → InfoNCE over all in-batch negatives", "vse_2ad", ["loss.name=infonce"], False),
    "paper": (
        "VSE+2AD, printed forms (Eq. 3 one weight per rank + Eq. 6 K rule)",
        "vse_2ad",
        [
            "model.image.pooling.adpool_variant=paper",
            "model.text.pooling.adpool_variant=paper",
            "loss.adopt_variant=paper",
        ],
        False,
    ),
    # the recipe's defaults since they follow the released code: the same runs as `full` (kept for old grids)
    "reference": (
        "VSE+2AD, released-code variants (ADPOOL + ADOPT)",
        "vse_2ad",
        [
            "model.image.pooling.adpool_variant=reference",
            "model.text.pooling.adpool_variant=reference",
            "loss.adopt_variant=reference",
        ],
        False,
    ),
}
DEFAULT_VARIANTS = ["floor", "full", "no_tok", "no_emb", "no_adpool", "no_adopt", "vse_infty"]
KEYS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum"]


def overrides_for(key: str, seed: int, epochs: int, decay: int, extra: list[str]) -> list[str]:
    _, recipe, own, _ = VARIANTS[key]
    if recipe == "bow":  # the floor is one fixed recipe: only the seed changes
        return [f"train.seed={seed}", "train.log_every=0", "train.eval_batch_size=512"]
    return (
        SMALL
        + [f"train.seed={seed}", f"train.epochs={epochs}", f"optim.lr_decay_epochs=[{decay}]"]
        + own
        + extra
    )


@torch.no_grad()
def balance_weights(trainer: Trainer) -> dict[str, float]:
    """Mean ADPOOL balance weight of the token-level branch on the test split (image and text side)."""
    from vsekit.pooling.adpool import ADPool

    out: dict[str, list[float]] = {}
    hooks = []
    for side, enc in (("image", trainer.model.image_encoder), ("text", trainer.model.text_encoder)):
        pool = getattr(enc, "pool", None)
        if isinstance(pool, ADPool):

            def hook(module, args, _output, side=side):
                _, w = module.forward(*args, return_weights=True)
                out.setdefault(side, []).extend(w["balance"][:, 0].float().cpu().tolist())

            hooks.append(pool.register_forward_hook(hook))
    try:
        from vsekit.data.precomp import load_precomp_split

        split = load_precomp_split(trainer.data_dir, "test", trainer.recipe.data.captions_per_image)
        split_similarities(trainer.model, split, trainer.recipe.train.eval_batch_size, trainer.device)
    finally:
        for h in hooks:
            h.remove()
    return {f"omega_tok_{side}": float(np.mean(v)) for side, v in out.items()}


@torch.no_grad()
def branch_diagnostics(run_dir: Path, data: str, split_name: str = "test") -> dict[str, dict[str, float]]:
    """Why ADPOOL's balance does (not) move: per side, over the split's sets with more than one element,
    the mean per-dimension spread (max − min over the set) of the pooled features, the relative gap
    |t_tok − t_emb| / |t_tok| between the two branches, how far θ is from uniform (L1) and the learned ω_tok."""
    from vsekit.data.precomp import load_precomp_split
    from vsekit.evaluation import encode_captions, encode_images, image_source_for, text_processor_for
    from vsekit.pooling.adpool import ADPool
    from vsekit.runs import load_run

    model, _ = load_run(run_dir)
    split = load_precomp_split(data, split_name, 1)
    acc: dict[str, dict[str, list[torch.Tensor]]] = {}

    def make_hook(side: str):
        def hook(module: ADPool, args, _output) -> None:
            x, lengths = args
            lengths = lengths.to(x.device)
            _, w = module.forward(x, lengths, return_weights=True)
            tok_only = ADPool(module.dim, embedding_level=False, variant=module.variant)
            tok_only.token_scorer.load_state_dict(module.token_scorer.state_dict())
            t, e = tok_only(x, lengths), ADPool(module.dim, token_level=False)(x, lengths)
            xs = x[:, : int(lengths.max())]
            valid = (torch.arange(xs.shape[1], device=x.device)[None] < lengths[:, None]).unsqueeze(-1)
            spread = xs.masked_fill(~valid, float("-inf")).amax(1) - xs.masked_fill(
                ~valid, float("inf")
            ).amin(1)
            theta = w["token"] if w["token"].ndim == 2 else w["token"].mean(-1)
            uniform = valid[..., 0].float() / lengths[:, None].float()
            many = lengths > 1
            a = acc.setdefault(side, {"spread": [], "gap": [], "theta_l1": [], "omega_tok": []})
            a["spread"].append(spread.mean(1)[many])
            a["gap"].append(((t - e).norm(dim=1) / t.norm(dim=1).clamp_min(1e-12))[many])
            a["theta_l1"].append((theta - uniform).abs().sum(1)[many])
            a["omega_tok"].append(w["balance"][:, 0])

        return hook

    pools = {"image": model.image_encoder.pool, "text": model.text_encoder.pool}
    hooks = [
        p.register_forward_hook(make_hook(side))
        for side, p in pools.items()
        if isinstance(p, ADPool) and p.token_level and p.embedding_level
    ]
    try:
        encode_images(model, image_source_for(model, split))
        encode_captions(model, split.captions, text_processor_for(model))
    finally:
        for h in hooks:
            h.remove()
    return {side: {k: float(torch.cat(v).mean()) for k, v in a.items()} for side, a in acc.items()}


def run_one(key: str, seed: int, args: argparse.Namespace) -> dict:
    run_dir = Path(args.out) / key / f"seed{seed}"
    done = run_dir / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    label, recipe_name, _, dense = VARIANTS[key]
    over = overrides_for(key, seed, args.epochs, args.decay_epoch, args.set)
    recipe = load_recipe(recipe_name, over)
    t0 = time.perf_counter()
    trainer = Trainer(recipe, args.data, run_dir, overwrite=True, progress=False, log=lambda *_: None)
    curve = []
    if dense and args.eval_every > 0:
        curve.append({"step": 0, "epoch": 0, **trainer.validate()})
        while trainer.state.epoch < recipe.train.epochs:
            trainer.fit(max_steps=args.eval_every)
            curve.append(
                {"step": trainer.state.global_step, "epoch": trainer.state.epoch, **trainer.validate()}
            )
    trainer.fit()
    train_s = time.perf_counter() - t0
    load_weights(trainer.model, run_dir / "best.safetensors")
    test, _, _ = evaluate_model(
        trainer.model,
        args.data,
        "test",
        batch_size=recipe.train.eval_batch_size,
        device=trainer.device,
        progress=False,
    )
    best = json.loads((run_dir / "best.json").read_text())
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
        "curve": curve,
        **balance_weights(trainer),
        "resolved_recipe": to_dict(recipe),
    }
    done.write_text(json.dumps(result, indent=1))
    print(
        f"{key} seed {seed}: test rsum {test['rsum']:.1f} (best dev epoch {best['epoch']}) {train_s:.0f}s",
        flush=True,
    )
    return result


def read_val_records(run_dir: Path) -> list[dict]:
    """End-of-epoch dev evaluations of a run (kind "val" in metrics.jsonl)."""
    path = run_dir / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in recs if r.get("kind") == "val"]


def read_step_records(run_dir: Path) -> list[dict]:
    """The per-iteration records (ADOPT's K, align, uniform) the trainer writes for losses with step_log_keys."""
    path = run_dir / "metrics.jsonl"
    recs = [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []
    return [r for r in recs if r.get("kind") == "step"]


def mean_std(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.fmean(values):.1f} ± {statistics.stdev(values):.1f}"


def table(results: dict[str, list[dict]]) -> str:
    head = (
        "| Method | i2t R@1 | i2t R@5 | i2t R@10 | t2i R@1 | t2i R@5 | t2i R@10 | RSUM | Δ RSUM | dev RSUM | "
        "best epoch | ω_tok img / txt | train s |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    full = results.get("full")
    base = statistics.fmean(r["test"]["rsum"] for r in full) if full else None
    for key, rs in results.items():
        cells = [VARIANTS[key][0]] + [mean_std([r["test"][k] for r in rs]) for k in KEYS]
        rsum = statistics.fmean(r["test"]["rsum"] for r in rs)
        cells.append("—" if base is None or key == "full" else f"{rsum - base:+.1f}")
        cells.append(mean_std([r["best_dev_rsum"] for r in rs]))
        cells.append(", ".join(str(r["best_dev_epoch"]) for r in rs))  # best.json counts epochs from 1
        om = [(r.get("omega_tok_image"), r.get("omega_tok_text")) for r in rs]
        cells.append(
            f"{statistics.fmean(o[0] for o in om):.2f} / {statistics.fmean(o[1] for o in om):.2f}"
            if all(o[0] is not None and o[1] is not None for o in om)
            else "—"
        )
        cells.append(f"{statistics.fmean(r['train_s'] for r in rs):.0f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_convergence(results: dict[str, list[dict]], path: Path, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=110)
    for key, color in (("full", "tab:red"), ("no_adopt", "tab:blue")):
        rs = [r for r in results.get(key, []) if r["curve"]]
        if not rs:
            continue
        steps = [c["step"] for c in rs[0]["curve"]]
        n = min(len(r["curve"]) for r in rs)
        vals = np.array([[c["rsum"] for c in r["curve"][:n]] for r in rs])
        mean, std = vals.mean(0), vals.std(0, ddof=1) if len(rs) > 1 else np.zeros(n)
        label = "with ADOPT (VSE+2AD)" if key == "full" else "without ADOPT (hardest-negative triplet)"
        ax.plot(steps[:n], mean, color=color, label=f"{label}, {len(rs)} seeds")
        ax.fill_between(steps[:n], mean - std, mean + std, color=color, alpha=0.2, lw=0)
    # rows without a dense curve: their end-of-epoch dev RSUM (mean over seeds), dashed with markers
    for key, color in (
        ("no_adopt_warmup", "tab:purple"),
        ("infonce", "tab:orange"),
        ("vse_infty", "tab:gray"),
    ):
        per_run = [read_val_records(out / key / f"seed{r['seed']}") for r in results.get(key, [])]
        per_run = [v for v in per_run if v]
        if not per_run:
            continue
        n = min(len(v) for v in per_run)
        mean = np.mean([[v["rsum"] for v in vs[:n]] for vs in per_run], axis=0)
        ax.plot(
            [v["step"] for v in per_run[0][:n]],
            mean,
            ls="--",
            marker="o",
            ms=3,
            lw=1,
            color=color,
            label=f"{VARIANTS[key][0]} (per epoch), {len(per_run)} seeds",
        )
    ax.set_xlabel("iteration")
    ax.set_ylabel("dev RSUM")
    ax.set_title("Convergence with and without ADOPT (openclipart, mean ± std)")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper left", fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


K_RULES = {
    "full": ("default rule (released code)", "tab:green"),
    "paper": ("printed rule (Eq. 6)", "tab:red"),
}


def plot_k(run_dirs: dict[str, list[Path]], path: Path, batch: int) -> None:
    """K per iteration for each K rule and seed, like the paper's appendix figure (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=110)
    epoch_starts: dict[int, int] = {}
    for key, dirs in run_dirs.items():
        label, color = K_RULES[key]
        for i, d in enumerate(dirs):
            recs = read_step_records(d)
            if not recs:
                continue
            ax.plot(
                [r["step"] for r in recs],
                [r["K_i2t"] for r in recs],
                lw=0.9,
                color=color,
                alpha=1.0 - 0.25 * i,
                label=f"{label}, {d.name}",
            )
            for r in recs:
                epoch_starts.setdefault(r["epoch"], r["step"])
    for _, s in sorted(epoch_starts.items())[1:]:
        ax.axvline(s - 0.5, color="grey", lw=0.5, ls=":")
    ax.set_yscale("log")
    ax.set_ylim(0.8, batch * 1.25)
    ax.set_xlabel("iteration (dotted: epoch boundaries)")
    ax.set_ylabel("K (negatives per anchor)")
    ax.set_title(f"ADOPT negative-group size per iteration (openclipart, batch {batch})")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def k_summary(d: Path) -> str:
    """Per-epoch mean K over full batches (each epoch's last batch is partial: 5080 = 39 x 128 + 88 captions
    on openclipart, and K scales with |B|), and the last full batch's K with its γ's."""
    recs = read_step_records(d)
    if not recs:
        return f"{d.parent.name}/{d.name}: no step records"
    last_of_epoch = {}
    for r in recs:
        last_of_epoch[r["epoch"]] = max(last_of_epoch.get(r["epoch"], 0), r["step"])
    full = [r for r in recs if r["step"] != last_of_epoch[r["epoch"]]] or recs
    per_epoch: dict[int, list[float]] = {}
    for r in full:
        per_epoch.setdefault(r["epoch"], []).append(r["K_i2t"])
    last = full[-1]
    return (
        f"{d.parent.name}/{d.name}: first {recs[0]['K_i2t']:.0f}, "
        + ", ".join(
            f"epoch {e} mean {np.mean(v):.1f}" for e, v in sorted(per_epoch.items())
        )  # 1-based in metrics.jsonl
        + f", last full batch {last['K_i2t']:.0f} (γ_align {last['align']:.2f}, γ_uniform {last['uniform']:.2f})"
    )


def write_docs(results: dict[str, list[dict]], args: argparse.Namespace, command: str) -> None:
    docs = Path(args.docs)
    figs = docs / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    plot_convergence(results, figs / "vse_2ad_convergence.png", Path(args.out))
    k_dirs = {
        key: [Path(args.out) / key / f"seed{r['seed']}" for r in results.get(key, [])] for key in K_RULES
    }
    batch = next(iter(results.values()))[0]["resolved_recipe"]["train"]["batch_size"]
    plot_k(k_dirs, figs / "vse_2ad_k_per_iteration.png", batch)
    k_stats = [k_summary(d) for dirs in k_dirs.values() for d in dirs]
    any_result = next(iter(results.values()))[0]
    n_seeds = {k: len(v) for k, v in results.items()}
    block = [
        "<!-- ablation:begin (written by scripts/experiments/vse_2ad_ablation.py; edits here are overwritten) -->",
        f"Test split of `{args.data}`; best-on-dev epoch of each run; mean ± std over seeds "
        f"({', '.join(f'{k}: {n}' for k, n in n_seeds.items())}). R@K in %, RSUM = sum of the six.",
        "",
        table(results),
        "",
        "Shared overrides: `"
        + " ".join(
            SMALL
            + ["train.seed=S", f"train.epochs={args.epochs}", f"optim.lr_decay_epochs=[{args.decay_epoch}]"]
            + args.set
        )
        + "`; each variant adds its own (see the script's `VARIANTS`).",
        "",
        "ADOPT K per iteration (i2t; t2i is equal; epoch means over full batches): "
        + ("; ".join(k_stats) if k_stats else "n/a"),
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {torch.get_num_threads()} torch thread(s), device {any_result['resolved_recipe']['train']['device']}, "
        f"torch {torch.__version__}.",
        "<!-- ablation:end -->",
    ]
    md = docs / "vse_2ad.md"
    text = (
        md.read_text(encoding="utf-8")
        if md.is_file()
        else "# VSE+2AD\n\n<!-- ablation:begin -->\n<!-- ablation:end -->\n"
    )
    start, end = text.find("<!-- ablation:begin"), text.find("<!-- ablation:end -->")
    if start < 0 or end < 0:
        text += "\n<!-- ablation:begin -->\n<!-- ablation:end -->\n"
        start, end = text.find("<!-- ablation:begin"), text.find("<!-- ablation:end -->")
    text = text[:start] + "\n".join(block) + text[end + len("<!-- ablation:end -->") :]
    md.write_text(text, encoding="utf-8")
    (Path(args.out) / "summary.json").write_text(
        json.dumps(
            {
                k: [
                    {kk: r[kk] for kk in ("seed", "test", "best_dev_epoch", "best_dev_rsum", "train_s")}
                    for r in v
                ]
                for k, v in results.items()
            },
            indent=1,
        )
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/openclipart", help="precomp dataset folder (train/dev/test)")
    p.add_argument("--out", required=True, help="where runs go (outside the repo)")
    p.add_argument(
        "--docs", default=str(REPO / "docs"), help="docs folder to write vse_2ad.md and figures into"
    )
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--variants", nargs="+", default=DEFAULT_VARIANTS, choices=list(VARIANTS))
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--decay-epoch", type=int, default=2, help="lr x0.1 once from this epoch")
    p.add_argument(
        "--eval-every", type=int, default=10, help="dev evaluation every N iterations (0 = per epoch)"
    )
    p.add_argument("--set", action="append", default=[], help="extra recipe override for every run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--report-only", action="store_true", help="only rebuild the table/figures from finished runs"
    )
    p.add_argument(
        "--diagnose",
        action="store_true",
        help="print ADPOOL branch diagnostics (spread, |tok-emb| gap, θ vs uniform, ω) of finished runs",
    )
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.diagnose:
        print("| run | side | per-dim spread | abs(t_tok − t_emb) / abs(t_tok) | L1(θ − uniform) | ω_tok |")
        print("|---|---|---|---|---|---|")
        for key in args.variants:
            for seed in args.seeds:
                run_dir = Path(args.out) / key / f"seed{seed}"
                if not (run_dir / "result.json").is_file():
                    continue
                for side, d in branch_diagnostics(run_dir, args.data).items():
                    print(
                        f"| {key}/seed{seed} | {side} | {d['spread']:.3f} | {d['gap']:.4f} | {d['theta_l1']:.3f} | "
                        f"{d['omega_tok']:.4f} |",
                        flush=True,
                    )
        return
    command = "nice -n 10 .venv/bin/python scripts/experiments/vse_2ad_ablation.py " + " ".join(
        shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]) if a != "--report-only"
    )
    results: dict[str, list[dict]] = {}
    # seed-major order: every variant gets seed 0 before any gets seed 1, so a cut-short grid is balanced
    for seed in args.seeds:
        for key in args.variants:
            done = Path(args.out) / key / f"seed{seed}" / "result.json"
            if args.report_only:
                if done.is_file():
                    results.setdefault(key, []).append(json.loads(done.read_text()))
                continue
            results.setdefault(key, []).append(run_one(key, seed, args))
    results = {k: results[k] for k in args.variants if k in results}
    if not results:
        sys.exit(f"no finished runs under {args.out}")
    write_docs(results, args, command)
    print((Path(args.docs) / "vse_2ad.md").resolve())


if __name__ == "__main__":
    main()
