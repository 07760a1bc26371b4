"""The floor study on openclipart: the `bow` recipe over seeds, a learning
curve (25 / 50 / 100 % of the training images) for bow, VSE++ and VSE∞, one-change-per-row evidence for
why the BiGRU recipes sit at the floor, and the small-data recipe's margin over the floor.

Every run trains with `vse train`'s Trainer, keeps its best-on-dev epoch and is scored on the test split
with the shared metrics module (the last epoch is scored too, to show what dev selection is worth).
The demo models use the demo's own settings (`vsekit_lab.demo.demo_overrides`), so the 100 % points are the
demo table's runs: with `--demo-out runs/demo` they are written where `vse demo` finds and reuses them.

    nice -n 10 .venv/bin/python scripts/experiments/floor_study.py --data data/openclipart \\
        --out runs/floor --demo-out runs/demo --jobs 2 --groups floor curve small why ensemble
    .venv/bin/python scripts/experiments/floor_study.py --out runs/floor --demo-out runs/demo --report-only

Finished runs (result.json present) are skipped, so an interrupted study resumes. Tables go to
OUT/report.md; the learning-curve plot to docs/figures/learning_curve.png (`--figure`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FRACTIONS = (0.25, 0.5, 1.0)
SEEDS = (0, 1, 2)


@dataclass(frozen=True)
class Job:
    group: str
    name: str  # row label key
    recipe: str
    overrides: tuple[str, ...]
    seed: int
    fraction: float = 1.0
    demo_variant: str = ""  # set: the run is a demo run (its folder is the demo's when --demo-out is given)
    label: str = ""

    def run_dir(self, out: Path, demo_out: Path | None) -> Path:
        if self.demo_variant and self.fraction == 1.0 and demo_out is not None:
            return demo_out / self.demo_variant / f"seed{self.seed}"
        return out / self.group / self.name / f"f{self.fraction:g}_s{self.seed}"


@dataclass
class Study:
    jobs: list[Job] = field(default_factory=list)


def demo_job(
    group: str,
    variant_name: str,
    seed: int,
    fraction: float,
    extra: tuple[str, ...] = (),
    name: str | None = None,
    label: str = "",
) -> Job:
    from vsekit_lab.demo import DEMO_EPOCHS, VARIANTS, demo_overrides

    v = next(v for v in VARIANTS if v.name == variant_name)
    overrides = tuple(demo_overrides(v, DEMO_EPOCHS)) + extra + (f"data.train_fraction={fraction}",)
    return Job(
        group,
        name or variant_name,
        v.recipe,
        overrides,
        seed,
        fraction,
        demo_variant=variant_name if not extra else "",
        label=label or v.label,
    )


# The small-data recipe (src/vsekit/recipes/small_data.yaml) scored against the floor
SMALL_DATA = ("small_data", "Small data: MiniLM (frozen) + InfoNCE")

# One change per row from the demo's VSE++ BiGRU run (triplet, hardest negative, 512-d, 8 epochs, decay at 6)
WHY_ROWS = [
    (
        "all_negatives",
        ("loss.max_violation=false", "loss.warmup_epochs=0"),
        "triplet over all negatives (VSE0)",
    ),
    ("infonce", ("loss.name=infonce",), "InfoNCE over all negatives (τ 0.05)"),
    ("embed256", ("model.embed_dim=256",), "embedding 256-d"),
    ("embed1024", ("model.embed_dim=1024",), "embedding 1024-d (the recipe's)"),
    (
        "schedule30",
        ("train.epochs=30", "optim.lr_decay_epochs=[]"),
        "30 epochs, no decay (the floor's schedule)",
    ),
    ("no_augment", ("data.size_augment=false",), "no feature / word augmentation"),
    # all of the floor's training at once, so only the encoders differ from the floor (BiGRU vs bag of words)
    (
        "floor_training",
        (
            "loss.name=infonce",
            "train.epochs=30",
            "optim.lr_decay_epochs=[]",
            "optim.lr=1e-3",
            "optim.weight_decay=0",
            "optim.grad_clip=0",
        ),
        "the floor's loss and schedule together (InfoNCE, Adam 1e-3, no decay, 30 epochs)",
    ),
]


def build_jobs(groups: list[str], seeds: tuple[int, ...]) -> list[Job]:
    jobs: list[Job] = []
    for seed in seeds:
        if "floor" in groups or "ensemble" in groups:
            jobs.append(
                Job(
                    "floor",
                    "bow",
                    "bow",
                    ("train.log_every=0", "data.train_fraction=1.0"),
                    seed,
                    demo_variant="bow",
                    label="Floor: bag of words (linear)",
                )
            )
            jobs.append(
                Job(
                    "floor",
                    "bow_noaug",
                    "bow",
                    ("train.log_every=0", "data.size_augment=false"),
                    seed,
                    label="bag of words, no augmentation",
                )
            )
            jobs.append(
                Job(
                    "floor",
                    "bow_bare",
                    "bow",
                    (
                        "train.log_every=0",
                        "data.size_augment=false",
                        "loss.mask_same_image=false",
                        "model.text.tokenizer=regex",
                    ),
                    seed,
                    label="bag of words, no augmentation, same-image captions as negatives, regex tokens",
                )
            )
        if "curve" in groups:
            for fraction in FRACTIONS:
                jobs.append(
                    Job(
                        "curve",
                        "bow",
                        "bow",
                        ("train.log_every=0", f"data.train_fraction={fraction}"),
                        seed,
                        fraction,
                        demo_variant="bow",
                        label="Floor: bag of words (linear)",
                    )
                )
                for variant in ("vsepp_bigru", "vse_infty_bigru", "vsepp_minilm", "vse_infty_minilm"):
                    if variant == "vsepp_minilm" and fraction < 1.0:
                        continue  # in the demo table, not on the curve
                    jobs.append(demo_job("curve", variant, seed, fraction))
        if "small" in groups or "ensemble" in groups:
            jobs.append(
                Job("small", SMALL_DATA[0], SMALL_DATA[0], ("train.log_every=0",), seed, label=SMALL_DATA[1])
            )
        if "why" in groups:
            for name, extra, label in WHY_ROWS:
                jobs.append(demo_job("why", "vsepp_bigru", seed, 1.0, extra, name=name, label=label))
    # what the tables need most comes first (the demo table, the floor, the small-data margin), so a study
    # cut short still fills them; seeds inside each tier
    tier = {"floor": 0, "small": 2, "why": 4}
    return sorted(
        jobs,
        key=lambda j: (
            1 if j.group == "curve" and j.fraction == 1.0 else 3 if j.group == "curve" else tier[j.group],
            j.seed,
        ),
    )


def run_job(job: Job, data: str, out: str, demo_out: str | None, threads: int) -> dict:
    import torch

    from vsekit.config import load_recipe
    from vsekit.evaluation import evaluate_model
    from vsekit.runs import load_run
    from vsekit.training.trainer import Trainer
    from vsekit.utils.io import atomic_write_json
    from vsekit_lab.demo import run_is_complete

    torch.set_num_threads(threads)
    run_dir = job.run_dir(Path(out), Path(demo_out) if demo_out else None)
    result_file = run_dir / "study_result.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    recipe = load_recipe(job.recipe, list(job.overrides) + [f"train.seed={job.seed}", "train.device=cpu"])
    timing = run_dir / "demo_timing.json"
    if not run_is_complete(run_dir, recipe.train.epochs):
        resume = (run_dir / "last_state.json").is_file()
        t0 = time.perf_counter()
        Trainer(
            recipe,
            data,
            run_dir,
            resume=resume,
            overwrite=not resume and run_dir.exists(),
            progress=False,
            log=lambda *_: None,
        ).fit()
        atomic_write_json(timing, {"train_time_s": time.perf_counter() - t0})
    scores = {}
    for tag in ("best", "last"):
        model, _ = load_run(run_dir, tag, "cpu")
        metrics, _, _ = evaluate_model(model, data, "test", progress=False)
        scores[tag] = metrics
    best = json.loads((run_dir / "best.json").read_text())
    model, _ = load_run(run_dir, "best", "cpu")
    result = {
        "group": job.group,
        "name": job.name,
        "label": job.label,
        "recipe": job.recipe,
        "seed": job.seed,
        "fraction": job.fraction,
        "train_images": None,
        "overrides": list(job.overrides),
        "best_epoch": best.get("epoch"),
        "test": scores["best"],
        "test_last_epoch": scores["last"],
        "train_time_s": json.loads(timing.read_text())["train_time_s"] if timing.is_file() else None,
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    log = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    result["dev_rsum"] = [h["rsum"] for h in log if h.get("kind") == "val"]
    atomic_write_json(result_file, result)
    return result


def mean_std(xs: list[float]) -> str:
    if not xs:
        return "–"
    m = statistics.fmean(xs)
    return f"{m:.1f} ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else f"{m:.1f}"


def load_results(jobs: list[Job], out: Path, demo_out: Path | None) -> list[dict]:
    res = []
    for j in jobs:
        f = j.run_dir(out, demo_out) / "study_result.json"
        if f.is_file():  # one run can serve two tables (the floor's bow is the curve's 100 % point)
            res.append({**json.loads(f.read_text()), "group": j.group, "name": j.name, "label": j.label})
    return res


def group_rows(results: list[dict], group: str) -> dict[tuple[str, float], list[dict]]:
    rows: dict[tuple[str, float], list[dict]] = {}
    for r in results:
        if r["group"] == group:
            rows.setdefault((r["name"], r["fraction"]), []).append(r)
    return rows


KEYS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum"]


def recall_table(rows: dict, extra_cols: bool = True) -> str:
    head = "| model | runs | " + " | ".join(k.replace("_r", " R@") for k in KEYS)
    head += " | rsum, last epoch | best epoch | trainable params | train time (s) |" if extra_cols else " |"
    lines = [head, "|" + "---|" * (len(KEYS) + (6 if extra_cols else 2))]
    for (_, _), runs in rows.items():
        cells = [mean_std([r["test"][k] for r in runs]) for k in KEYS]
        line = f"| {runs[0]['label']} | {len(runs)} | " + " | ".join(cells)
        if extra_cols:
            times = [r["train_time_s"] for r in runs if r["train_time_s"]]
            line += (
                f" | {mean_std([r['test_last_epoch']['rsum'] for r in runs])}"
                f" | {', '.join(str(r['best_epoch']) for r in runs)} | {runs[0]['parameters']:,}"
                f" | {statistics.fmean(times):.0f} |"
                if times
                else " | – |"
            )
        else:
            line += " |"
        lines.append(line)
    return "\n".join(lines)


def curve_table(results: list[dict], n_train: int) -> tuple[str, dict]:
    rows = group_rows(results, "curve")
    names = []
    for name, _ in rows:
        if name not in names:
            names.append(name)
    lines = [
        "| model | " + " | ".join(f"{f:.0%} ({round(n_train * f):,} images)" for f in FRACTIONS) + " |",
        "|---|" + "---|" * len(FRACTIONS),
    ]
    curve = {}
    for name in names:
        label = next(r for (n, _), rs in rows.items() if n == name for r in rs)["label"]
        cells, pts = [], []
        for f in FRACTIONS:
            runs = rows.get((name, f), [])
            cells.append(
                mean_std([r["test"]["rsum"] for r in runs]) + (f" (n={len(runs)})" if len(runs) != 3 else "")
            )
            if runs:
                vals = [r["test"]["rsum"] for r in runs]
                pts.append(
                    (
                        round(n_train * f),
                        statistics.fmean(vals),
                        statistics.stdev(vals) if len(vals) > 1 else 0.0,
                    )
                )
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
        curve[label] = pts
    return "\n".join(lines), curve


def plot_curve(curve: dict, png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    for label, pts in curve.items():
        if not pts:
            continue
        xs, ms, ss = zip(*pts)
        style = ":" if label.startswith("Floor") else "-"
        if len(pts) == 1:
            label += " (100 % only)"
        ax.errorbar(xs, ms, yerr=ss, marker="o", ms=4, capsize=3, ls=style, label=label)
    ax.set_xscale("log")
    ax.set_xticks([p[0] for p in max(curve.values(), key=len)])
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.get_xaxis().set_minor_formatter(matplotlib.ticker.NullFormatter())  # only the three sizes are labelled
    ax.set_xlabel("training images (log scale)")
    ax.set_ylabel("test rsum (mean ± std, 3 seeds)")
    ax.set_title("openclipart: learning curve against the bag-of-words floor")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def oov_stats(data: str) -> str:
    """How many test-caption words the from-scratch training vocabulary has never seen (BiGRU and bow alike)."""
    from vsekit.data.precomp import load_precomp_split
    from vsekit.data.text import Vocabulary, tokenize_words

    train = load_precomp_split(data, "train", 5)
    test = load_precomp_split(data, "test", 5)
    vocab = Vocabulary.build(train.captions, 1, "nltk")
    known = set(vocab.idx2word)
    tokens = [w for c in test.captions for w in tokenize_words(c, "nltk")]
    unseen = [w for w in tokens if w not in known]
    caps_with = sum(any(w not in known for w in tokenize_words(c, "nltk")) for c in test.captions)
    return (
        f"training vocabulary {len(known):,} words (min count 1, nltk tokens); test captions: "
        f"{len(unseen):,} of {len(tokens):,} tokens unseen in training ({100 * len(unseen) / len(tokens):.1f} %), "
        f"{len(set(unseen)):,} distinct unseen words; {caps_with:,} of {len(test.captions):,} test captions "
        f"({100 * caps_with / len(test.captions):.1f} %) hold at least one"
    )


# Two-model ensembles scored as `vse eval RUN_A RUN_B` scores them (mean of the two similarity matrices):
# the small-data preset (bow + small_data, same seed) and, as controls for what ensembling alone gives, two
# bow runs and two small_data runs of different seeds. (name, label, member A, member B, seed offset of B)
ENSEMBLES = [
    (
        "bow+small_data",
        "Preset: `bow` + `small_data` (same seed), mean similarity",
        ("floor", "bow"),
        ("small", SMALL_DATA[0]),
        0,
    ),
    ("bow+bow", "Control: `bow` + `bow` (seeds s, s+1)", ("floor", "bow"), ("floor", "bow"), 1),
    (
        "small_data+small_data",
        "Control: `small_data` + `small_data` (seeds s, s+1)",
        ("small", SMALL_DATA[0]),
        ("small", SMALL_DATA[0]),
        1,
    ),
]


def ensemble_result(name: str, runs: list[Path], data: str, out: Path) -> dict:
    """Test metrics of the mean-similarity ensemble of `runs`, cached in OUT/ensemble (the same path as
    `vse eval RUN_A RUN_B`: each run's matrix from `evaluate_model`, averaged, scored by `evaluate_sims`)."""
    from vsekit.evaluation import evaluate_model
    from vsekit.metrics.retrieval import evaluate_sims
    from vsekit.runs import load_run

    cache = out / "ensemble" / f"{name}__{'__'.join(r.parent.name + '-' + r.name for r in runs)}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    sims_sum, cap2img = None, None
    for run in runs:
        model, _ = load_run(run, "best", "cpu")
        _, sims, cap2img = evaluate_model(model, data, "test", progress=False)
        sims_sum = sims if sims_sum is None else sims_sum + sims
    result = {
        "name": name,
        "runs": [str(r) for r in runs],
        "test": evaluate_sims(sims_sum / len(runs), cap2img),
    }
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(result, indent=1))
    return result


def ensemble_section(results: list[dict], jobs: list[Job], args) -> list[str]:
    out, demo_out = Path(args.out), Path(args.demo_out) if args.demo_out else None
    by_key = {(j.group, j.name, j.seed): j.run_dir(out, demo_out) for j in jobs}
    seeds = sorted({j.seed for j in jobs})
    floor = [r["test"]["rsum"] for r in results if r["group"] == "floor" and r["name"] == "bow"]
    lines = [
        "| model | pairs | "
        + " | ".join(k.replace("_r", " R@") for k in KEYS)
        + " | vs floor | margin / std |",
        "|" + "---|" * (len(KEYS) + 4),
    ]
    for name, label, (ga, na), (gb, nb), offset in ENSEMBLES:
        pairs = []
        for s in seeds:
            a, b = (
                by_key.get((ga, na, s)),
                by_key.get((gb, nb, seeds[(seeds.index(s) + offset) % len(seeds)])),
            )
            if a and b and (a / "study_result.json").is_file() and (b / "study_result.json").is_file():
                pairs.append(ensemble_result(name, [a, b], args.data, out))
        if not pairs:
            continue
        rs = [p["test"]["rsum"] for p in pairs]
        margin = statistics.fmean(rs) - statistics.fmean(floor) if floor else float("nan")
        sd = (
            max(statistics.stdev(floor), statistics.stdev(rs))
            if len(floor) > 1 and len(rs) > 1
            else float("nan")
        )
        lines.append(
            f"| {label} | {len(pairs)} | "
            + " | ".join(mean_std([p["test"][k] for p in pairs]) for k in KEYS)
            + f" | {margin:+.1f} | {margin / sd:.1f} |"
        )
    return [
        "## Two-model ensembles against the floor (mean similarity, as `vse eval RUN_A RUN_B`)\n",
        "\n".join(lines),
        "",
        "margin / std: the margin over the floor divided by the larger seed std of the "
        "floor and the row (the bar is > 2).\n",
    ]


def report(jobs: list[Job], args) -> str:
    out, demo_out = Path(args.out), Path(args.demo_out) if args.demo_out else None
    results = load_results(jobs, out, demo_out)
    parts = [f"# Floor study on {args.data}\n", f"Command: `{' '.join(['python', *sys.argv])}`\n"]
    floor = group_rows(results, "floor")
    if floor:
        parts += ["## The floor\n", recall_table(floor), ""]
    from vsekit.data.precomp import load_precomp_split

    n_train = load_precomp_split(args.data, "train", 5).n_images
    if group_rows(results, "curve"):
        table, curve = curve_table(results, n_train)
        parts += ["## Learning curve (test rsum)\n", table, ""]
        full = {k: v for k, v in group_rows(results, "curve").items() if k[1] == 1.0}
        parts += ["### At 100 % (the demo table)\n", recall_table(full), ""]
        if args.figure:
            plot_curve(curve, Path(args.figure))
            parts.append(f"Plot: {args.figure}\n")
    why = group_rows(results, "why")
    if why:
        base = {k: v for k, v in group_rows(results, "curve").items() if k == ("vsepp_bigru", 1.0)}
        parts += [
            "## Why the BiGRU recipe sits below the floor (one change per row from the demo's VSE++ BiGRU)\n",
            recall_table({**base, **why}),
            "",
            oov_stats(args.data),
            "",
        ]
    small = group_rows(results, "small")
    if small:
        parts += ["## Small-data recipe against the floor\n", recall_table({**floor, **small}), ""]
        f_rs = [r["test"]["rsum"] for rs in floor.values() for r in rs if r["name"] == "bow"]
        s_rs = [r["test"]["rsum"] for rs in small.values() for r in rs]
        if len(f_rs) > 1 and len(s_rs) > 1:
            margin = statistics.fmean(s_rs) - statistics.fmean(f_rs)
            sd = max(statistics.stdev(f_rs), statistics.stdev(s_rs))
            parts.append(
                f"Margin over the floor: {margin:+.1f} rsum; larger seed std of the two {sd:.1f}; "
                f"margin / std = {margin / sd:.1f} (the bar is > 2)\n"
            )
    if "ensemble" in args.groups:
        parts += ensemble_section(results, jobs, args)
    text = "\n".join(parts)
    (out / "report.md").parent.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text(text)
    return text


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/openclipart")
    p.add_argument("--out", default="runs/floor")
    p.add_argument(
        "--demo-out", default=None, help="put the 100 %% demo-model runs where `vse demo --out` reuses them"
    )
    p.add_argument(
        "--groups",
        nargs="+",
        default=["floor", "curve", "small", "why", "ensemble"],
        help="ensemble: the two-model ensembles of the floor and small runs (trains those if missing)",
    )
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--jobs", type=int, default=1, help="runs in parallel (processes)")
    p.add_argument("--threads", type=int, default=0, help="torch threads per run (default: cores / jobs)")
    p.add_argument("--figure", default=str(REPO / "docs" / "figures" / "learning_curve.png"))
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    jobs = build_jobs(args.groups, tuple(args.seeds))
    if not args.report_only:
        threads = args.threads or max(1, (os.cpu_count() or 1) // args.jobs)
        # the expensive runs first, so the parallel workers finish together
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {pool.submit(run_job, j, args.data, args.out, args.demo_out, threads): j for j in jobs}
            for fut in as_completed(futures):
                j = futures[fut]
                try:
                    r = fut.result()
                    print(
                        f"{j.group}/{j.name} f={j.fraction:g} seed {j.seed}: test rsum {r['test']['rsum']:.1f} "
                        f"(last epoch {r['test_last_epoch']['rsum']:.1f})",
                        flush=True,
                    )
                except Exception as e:  # one failed run must not lose the others
                    print(f"FAILED {j}: {type(e).__name__}: {e}", flush=True)
    print(report(jobs, args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
