"""`vse demo`: the embedded default, end to end on a 2-core CPU.

Builds the openclipart retrieval set if it is missing, trains VSE++ (average pooling) and VSE∞ (GPO) with
a BiGRU and with a MiniLM text encoder on its precomputed EfficientNet-Lite0 grid features, evaluates each
on the test split with the shared metrics module, and writes a Markdown/JSON table and a PNG of dev rsum
per epoch. Finished runs are reused and interrupted ones resumed, so running it twice costs nothing.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from vsekit.config import load_recipe
from vsekit.errors import VseInputError
from vsekit.utils.io import atomic_write_json, atomic_write_text

logger = logging.getLogger(__name__)

# Small-CPU settings shared by every demo run: 512-d embeddings, grid features (one linear layer, as VSE∞
# does for grids), batch 128, 8 epochs with the x0.1 step at epoch 6 (the 25/15 schedule, shortened).
DEMO_OVERRIDES = [
    "model.embed_dim=512",
    "model.image.feature_type=grid",
    "model.text.vocab_min_count=1",
    "train.batch_size=128",
    "train.log_every=0",
]
DEMO_EPOCHS = 8


# all-MiniLM-L6-v2 with its body frozen in place of a recipe's text encoder: on 2 CPU cores fine-tuning it
# would triple the step time; a frozen body's token states are cached, the projection and pooling train
MINILM_FROZEN = ("model.text.kind=transformer", "model.text.freeze=true")


@dataclass(frozen=True)
class Variant:
    name: str
    recipe: str
    text: str  # bigru | minilm | bow
    label: str
    # the floor keeps its own recipe's schedule (30 epochs of seconds each, no decay) instead of the demo's
    own_schedule: bool = False

    def overrides(self) -> list[str]:
        if self.text == "bow":
            return []
        if self.text == "minilm":
            # weight decay 1e-4: the released VSE∞ code's value for its transformer (BERT) branch
            return [*MINILM_FROZEN, "optim.weight_decay=0.0001"]
        # the released BiGRU code's settings: Treebank (nltk) tokens and AdamW's default weight decay 0.01
        return [
            "model.text.kind=bigru",
            "model.text.word_dim=300",
            "model.text.tokenizer=nltk",
            "optim.weight_decay=0.01",
        ]


VARIANTS = [
    Variant("bow", "bow", "bow", "Floor: bag of words (linear)", own_schedule=True),
    Variant("vsepp_bigru", "vsepp", "bigru", "VSE++ (avg pool), BiGRU"),
    Variant("vse_infty_bigru", "vse_infty", "bigru", "VSE∞ (GPO), BiGRU"),
    Variant("vsepp_minilm", "vsepp", "minilm", "VSE++ (avg pool), MiniLM"),
    Variant("vse_infty_minilm", "vse_infty", "minilm", "VSE∞ (GPO), MiniLM"),
]
TABLE_KEYS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum"]


def dataset_ready(data_dir: Path) -> bool:
    return all(
        (data_dir / f"{s}_caps.txt").is_file() and (data_dir / f"{s}_ims.npy").is_file()
        for s in ("train", "dev", "test")
    )


def dataset_outdated(data_dir: Path) -> str | None:
    """Why an existing openclipart set differs from what this vsekit builds (None when current or unknown).

    The demo reuses a built set; one built by an older vsekit (other caption rules or rendering) still
    trains, but its numbers will not match the README's table, so the user is told how to refresh it.
    """
    from vsekit.data.manifest import ManifestError, manifest_path, read_manifest
    from vsekit_lab.datasets.openclipart import CAPTION_RULES, RENDER_VERSION

    manifest_file = manifest_path(data_dir)
    try:
        manifest = read_manifest(data_dir) if manifest_file.is_file() else None
    except ManifestError:
        manifest = None
    if manifest is None:
        return None  # not built by `vse data openclipart` (or unreadable): nothing to compare with
    if manifest.get("caption_rules") != CAPTION_RULES:
        return f"{manifest_file}: built with other caption rules than this vsekit's"
    if manifest.get("build", {}).get("render") != RENDER_VERSION:
        return f"{manifest_file}: rendered as {manifest.get('build', {}).get('render')!r}, this vsekit renders {RENDER_VERSION!r}"
    return None


def run_is_complete(run_dir: Path, epochs: int) -> bool:
    state = run_dir / "last_state.json"
    if not state.is_file() or not (run_dir / "best.safetensors").is_file():
        return False
    try:
        return json.loads(state.read_text())["train_state"]["epoch"] >= epochs
    except (KeyError, json.JSONDecodeError):
        return False


def demo_overrides(variant: Variant, epochs: int) -> list[str]:
    """The recipe overrides of one demo run (seed and device aside), also used by the experiment scripts."""
    if variant.own_schedule:
        return DEMO_OVERRIDES + variant.overrides()
    decay = max(1, round(epochs * 0.75))
    return (
        DEMO_OVERRIDES + variant.overrides() + [f"train.epochs={epochs}", f"optim.lr_decay_epochs=[{decay}]"]
    )


def train_variant(
    variant: Variant, data_dir: Path, run_dir: Path, seed: int, epochs: int, device: str
) -> dict:
    """Train (or reuse / resume) one run and evaluate its best-on-dev weights on test."""
    from vsekit.evaluation import evaluate_model
    from vsekit.runs import load_run
    from vsekit.training.trainer import Trainer

    recipe = load_recipe(
        variant.recipe, demo_overrides(variant, epochs) + [f"train.seed={seed}", f"train.device={device}"]
    )
    epochs = recipe.train.epochs  # the floor's own schedule differs from the demo's
    timing_file = run_dir / "demo_timing.json"
    if not run_is_complete(run_dir, epochs):
        resume = (run_dir / "last_state.json").is_file()
        trainer = Trainer(
            recipe, data_dir, run_dir, resume=resume, overwrite=not resume and run_dir.exists(), progress=True
        )
        t0 = time.perf_counter()
        trainer.fit()
        spent = time.perf_counter() - t0
        if resume and timing_file.is_file():
            spent += json.loads(timing_file.read_text())["train_time_s"]
        atomic_write_json(timing_file, {"train_time_s": spent})
    model, _ = load_run(run_dir, "best", device if device != "auto" else "cpu")
    metrics, _, _ = evaluate_model(model, data_dir, "test", progress=False)
    history = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    dev_rsum = [h["rsum"] for h in history if h.get("kind") == "val"][-epochs:]
    train_time = (
        json.loads(timing_file.read_text())["train_time_s"] if timing_file.is_file() else float("nan")
    )
    return {"metrics": metrics, "dev_rsum": dev_rsum, "train_time_s": train_time}


def mean_std(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def results_table(results: dict[str, list[dict]], seeds: int) -> str:
    head = "| model | " + " | ".join(k.replace("_r", " R@") for k in TABLE_KEYS) + " | train time (s) |"
    lines = [head, "|" + "---|" * (len(TABLE_KEYS) + 2)]
    for v in VARIANTS:
        runs = results.get(v.name)
        if not runs:
            continue
        cells = []
        for k in TABLE_KEYS:
            m, s = mean_std([r["metrics"][k] for r in runs])
            cells.append(f"{m:.1f} ± {s:.1f}" if seeds > 1 else f"{m:.1f}")
        t, _ = mean_std([r["train_time_s"] for r in runs])
        lines.append(f"| {v.label} | " + " | ".join(cells) + f" | {t:.0f} |")
    return "\n".join(lines)


def plot_dev_rsum(results: dict[str, list[dict]], out_png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=120)
    for v in VARIANTS:
        runs = results.get(v.name)
        if not runs:
            continue
        curves = np.array([r["dev_rsum"] for r in runs if r["dev_rsum"]], dtype=float)
        if curves.size == 0:
            continue
        if (
            v.own_schedule
        ):  # the floor trains on its own schedule: drawn as its best dev rsum, a level to clear
            ax.axhline(curves.max(1).mean(), color="0.4", ls=":", lw=1.2, label=f"{v.label}, best dev")
            continue
        epochs = np.arange(1, curves.shape[1] + 1)
        mean = curves.mean(0)
        (line,) = ax.plot(
            epochs, mean, marker="o", ms=3, label=v.label, ls="-" if "infty" in v.name else "--"
        )
        if len(curves) > 1:
            ax.fill_between(epochs, curves.min(0), curves.max(0), color=line.get_color(), alpha=0.15)
    ax.set_xlabel("epoch")
    ax.set_ylabel("dev rsum")
    ax.set_title("openclipart: validation rsum per epoch")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png)
    plt.close(fig)


def run_demo(
    data_dir: str | Path = "data/openclipart",
    out_dir: str | Path = "runs/demo",
    seeds: int = 1,
    epochs: int | None = None,
    device: str = "auto",
    variants: list[str] | None = None,
    log: Callable[[str], None] = print,
) -> dict:
    """Build (once), train, evaluate and tabulate the demo; `log` gets its report (run headers, test scores,
    the table, what was written, how to search), like the trainer's `log`; diagnostics go to `logging`."""
    data_dir, out_dir = Path(data_dir), Path(out_dir)
    epochs = epochs or DEMO_EPOCHS
    chosen = [v for v in VARIANTS if variants is None or v.name in variants]
    if variants:
        unknown = set(variants) - {v.name for v in VARIANTS}
        if unknown:
            raise VseInputError(
                f"unknown demo variant(s) {sorted(unknown)}; choose from {[v.name for v in VARIANTS]}"
            )
    t_start = time.perf_counter()
    if not dataset_ready(data_dir):
        from vsekit_lab.datasets.openclipart import build_openclipart

        logger.info("building the openclipart set in %s (one time, a few minutes)…", data_dir)
        build_openclipart(data_dir)
    elif reason := dataset_outdated(data_dir):
        logger.warning(
            "%s; results will differ from the README's table. Refresh the set (rendered pictures and "
            "features are reused) with:  vse data openclipart --out %s",
            reason,
            data_dir,
        )
    results: dict[str, list[dict]] = {}
    for v in chosen:
        for seed in range(seeds):
            log(f"== {v.label}, seed {seed}")
            res = train_variant(v, data_dir, out_dir / v.name / f"seed{seed}", seed, epochs, device)
            results.setdefault(v.name, []).append(res)
            m = res["metrics"]
            log(
                f"   test: i2t R@1 {m['i2t_r1']:.1f} t2i R@1 {m['t2i_r1']:.1f} rsum {m['rsum']:.1f} "
                f"({res['train_time_s']:.0f} s training)"
            )
    table = results_table(results, seeds)
    out_dir.mkdir(parents=True, exist_ok=True)
    cmd = f"vse demo --seeds {seeds}" + (f" --epochs {epochs}" if epochs != DEMO_EPOCHS else "")
    md = (
        f"# vsekit demo: openclipart test split\n\nCommand: `{cmd}`; {seeds} seed(s)"
        f"{', mean ± std' if seeds > 1 else ''}; {epochs} epochs; recalls in %.\n\n{table}\n"
    )
    atomic_write_text(out_dir / "results.md", md)
    atomic_write_json(
        out_dir / "results.json", {"command": cmd, "epochs": epochs, "seeds": seeds, "runs": results}
    )
    plot_dev_rsum(results, out_dir / "dev_rsum.png")
    log("\n" + table)
    log(
        f"\nwrote {out_dir / 'results.md'}, {out_dir / 'results.json'}, {out_dir / 'dev_rsum.png'} "
        f"(total {time.perf_counter() - t_start:.0f} s)"
    )
    best = out_dir / chosen[-1].name / "seed0"
    log(search_hint(best, data_dir))
    return results


def search_hint(run_dir: Path, data_dir: Path) -> str:
    return (
        "\nSearch the test pictures with the trained model:\n"
        f"  vse index {run_dir} {data_dir}:test --out {run_dir.parent.parent / 'index'}\n"
        f'  vse search {run_dir.parent.parent / "index"} "a red apple" -k 5\n'
        f"  vse serve {run_dir.parent.parent / 'index'}    # then open http://127.0.0.1:8000"
    )
