"""The methods table on the Wesnoth clips: HREM, ESA and CHAN beside the floor, VSE++ and VSE∞ (docs/wesnoth.md).

Every row × seed trains with `vse train` (its best-on-dev epoch kept) and is scored on the test split with
`vse eval` (the shared metrics). The protocol is docs/wesnoth.md's: the floor (`bow`) runs its recipe
unchanged; every deep row gets the same shrink (`SHRINK`: 256-d, 30 epochs at lr 5e-4 with x0.1 from epoch
23, every training word kept) on top of its recipe, plus only what the set forces (`ROWS`, `NOTES`).

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python scripts/experiments/wesnoth_methods_table.py \\
        --data data/wesnoth --out runs/wesnoth_methods
    .venv/bin/python scripts/experiments/wesnoth_methods_table.py --data data/wesnoth \\
        --out runs/wesnoth_methods --report-only

One run at a time, seed by seed (a table cut short has every row at the same seed count). A finished run
(result.json) is skipped, an interrupted one resumes (`vse train --resume`). Each run's output goes to
OUT/<row>/seed<S>.log. Writes OUT/wesnoth_methods.md and OUT/wesnoth_methods.json (finished runs only).
Train losses are logged once an epoch (`train.log_every` = the steps of an epoch), so a ranking loss stuck at
its collapse value (vsekit.training.collapse: 2 B m for the hardest-negative hinge) shows in the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

# the openclipart table owns the shared rules (release warm-up share, mean ± std, training seconds)
from methods_table import (
    count_lines,
    failed_runs,
    hrem_warmup_iters,
    table_head,
    table_row,
    training_seconds,
    write_report,
)

from vsekit_lab.demo import MINILM_FROZEN  # the demo's MiniLM rows: the body frozen, its optimizer not taken

SEEDS = (0, 1, 2)
KEYS = ["i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum"]
BATCH = 128
EPOCHS = 30
DIM = 256
SHRINK = (
    f"model.embed_dim={DIM}",
    f"train.epochs={EPOCHS}",
    "optim.lr=5e-4",
    "optim.lr_decay_epochs=[23]",
    "model.text.vocab_min_count=1",
)


@dataclass(frozen=True)
class Row:
    name: str  # run folder and JSON key
    recipe: str
    label: str
    shrink: bool = True
    extra: tuple[str, ...] = ()


ROWS = [
    Row("bow", "bow", "floor: bag of words (bow, recipe unchanged)", shrink=False),
    Row("vsepp_video", "vsepp_video", "VSE++ (vsepp_video)"),
    Row("vse_infty_video", "vse_infty_video", "VSE∞ (vse_infty_video)"),
    Row("vsepp_video_minilm", "vsepp_video", "VSE++ (vsepp_video), MiniLM body frozen", extra=MINILM_FROZEN),
    Row(
        "vse_infty_video_minilm",
        "vse_infty_video",
        "VSE∞ (vse_infty_video), MiniLM body frozen",
        extra=MINILM_FROZEN,
    ),
    Row("esa", "esa", "ESA (aggregator + SEL), BiGRU"),
    Row("chan", "chan", "CHAN (late interaction), BiGRU, margin 0.05", extra=(f"train.batch_size={BATCH}",)),
    Row(
        "chan_m05",
        "chan",
        "CHAN, BiGRU, margin 0.5 (0.05 on the cosine scale)",
        extra=(f"train.batch_size={BATCH}", "loss.margin=0.5"),
    ),
    Row(
        "hrem",
        "hrem",
        "HREM (relation graph in the loss), MiniLM body frozen",
        extra=("model.text.freeze=true",),
    ),
]

NOTES = [
    "Every row: best-on-dev epoch, scored on the test split (131 clips, 131 captions; chance R@1 0.8, "
    "R@10 7.6). The floor runs its recipe unchanged (30 epochs, batch 128); every other row its recipe plus "
    "the shrink (256-d joint space, 30 epochs, lr 5e-4 with x0.1 from epoch 23, vocabulary min count 1) and "
    "what the row's note adds. Batch 128 everywhere (8 steps an epoch, 240 in all).",
    "ESA: the clips' frames are read as regions (`model.image.feature_type=region`, the recipe's own), so the "
    "image side makes the two masked views the SEL loss needs, as the captions do. Adam without weight decay, "
    "SEL margin 0.2, hardest negative after one all-negatives epoch, BiGRU words from U(-0.1, 0.1).",
    "CHAN: `train.batch_size=128` instead of the recipe's 384 (more than a third of the 1,004 training clips "
    "in one batch; 128 as every other row). Margin 0.05 is the release's, applied to scores on a 1/τ = 10x "
    "scale; the second CHAN row uses 0.5, the same margin on the cosine scale.",
    "MiniLM rows: the recipe with all-MiniLM-L6-v2 for the BiGRU, its body frozen as in the demo's MiniLM "
    "rows (the projection and the pooling train); the recipe's optimizer (Adam without weight decay) kept.",
    "HREM: all-MiniLM-L6-v2 body frozen (`model.text.freeze=true`), `loss.hrem_embed_dim=256` (= the joint "
    "space), `loss.hrem_warmup_iters` scaled from the release's 8,000 of 33,960 steps (23.6 %) to the same "
    "share of this run's steps; AdamW 1e-4 weight decay, graph and loss terms as the recipe.",
]


def row_overrides(row: Row, data: Path) -> list[str]:
    """The `--set` overrides of a row (seed and device come on the command line)."""
    sets = list(SHRINK if row.shrink else ()) + list(row.extra)
    if row.recipe == "hrem":
        warm = hrem_warmup_iters(count_lines(data / "train_caps.txt"), BATCH, EPOCHS)
        sets += [f"loss.hrem_embed_dim={DIM}", f"loss.hrem_warmup_iters={warm}"]
    steps_per_epoch = math.ceil(count_lines(data / "train_caps.txt") / BATCH)
    return sets + [f"train.log_every={steps_per_epoch}"]


def collapse_value(data: Path, loss_cfg, batch: int) -> float | None:
    """The loss's value on a constant score matrix (`vsekit.training.collapse.collapse_value`, hardest negative,
    no two captions of one clip counted apart), averaged over one epoch's batches (the last is the partial
    one); None for a loss without one."""
    from vsekit.training.collapse import collapse_value as hinge_value
    from vsekit.training.collapse import negatives_per_row

    n = count_lines(data / "train_caps.txt")
    sizes = [batch] * (n // batch) + ([n % batch] if n % batch else [])
    values = [hinge_value(loss_cfg, negatives_per_row(None, b, False), hardest=True) for b in sizes]
    return None if values[0] is None else statistics.fmean(float(v) for v in values)


def run_dir(out: Path, row: Row, seed: int) -> Path:
    return out / row.name / f"seed{seed}"


def vse(args: list[str], log: Path) -> None:
    """Run the `vse` CLI next to this interpreter, its output appended to `log`; raise when it fails."""
    exe = Path(sys.executable).with_name("vse")
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    with open(log, "a", encoding="utf-8") as f:
        f.write(f"$ vse {' '.join(args)}\n")
        f.flush()
        rc = subprocess.run([str(exe), *args], stdout=f, stderr=subprocess.STDOUT, env=env).returncode
    if rc != 0:
        tail = log.read_text(encoding="utf-8").strip().splitlines()[-1:]
        raise RuntimeError(f"vse {args[0]} exited {rc}: {tail[0] if tail else ''}")


def train_losses(folder: Path) -> dict[int, float]:
    """Epoch -> mean train loss of its steps (one train record an epoch)."""
    losses = {}
    for line in (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines():
        rec = json.loads(line) if line.strip() else {}
        if rec.get("kind") == "train":
            losses[rec["epoch"]] = rec["loss"]
    return losses


def dev_scores(folder: Path) -> dict:
    """How spread the last checkpoint's dev scores are: the std of the clip x caption matrix and the mean
    positive minus the mean negative (one caption per dev clip, so the positives are the diagonal), on the
    model's own score scale. A ranking loss near its collapse value with every score equal shows here;
    the same loss value with spread scores is a hard set (e.g. equal captions of two training clips), not a
    collapse."""
    import numpy as np

    sims_file = folder.parent / f"{folder.name}_dev_last.npy"
    if not sims_file.is_file():
        cmd = ["eval", str(folder), "--split", "dev", "--device", "cpu", "--checkpoint", "last"]
        vse(cmd + ["--save-sims", str(sims_file)], folder.parent / f"{folder.name}.log")
    s = np.load(sims_file).astype(np.float64)
    if s.shape[0] != s.shape[1]:
        raise ValueError(f"{sims_file}: {s.shape} dev scores, expected one caption per clip")
    neg = s[~np.eye(len(s), dtype=bool)]
    return {"std": float(s.std()), "pos_minus_neg": float(np.diag(s).mean() - neg.mean())}


def run_one(row: Row, seed: int, data: Path, out: Path) -> dict:
    """Train (or resume, or reuse) one run, score its best-on-dev checkpoint on test."""
    from vsekit.config import load_recipe
    from vsekit.runs import load_run
    from vsekit.utils.io import atomic_write_json

    folder = run_dir(out, row, seed)
    result_file = folder / "result.json"
    if result_file.is_file():
        return json.loads(result_file.read_text())
    log = folder.parent / f"seed{seed}.log"
    folder.parent.mkdir(parents=True, exist_ok=True)
    sets = row_overrides(row, data)
    recipe = load_recipe(row.recipe, sets + [f"train.seed={seed}", "train.device=cpu"])
    if row.recipe == "esa" and recipe.model.image.feature_type != "region":
        raise ValueError(f"ESA needs region-type frames, the recipe reads {recipe.model.image.feature_type}")
    done = folder / "trained.json"
    if not done.is_file():
        if (folder / "last.manifest.json").is_file():
            vse(["train", "--resume", str(folder), "--no-progress"], log)
        else:
            cmd = ["train", "--recipe", row.recipe, "--data", str(data), "--out", str(folder)]
            cmd += ["--seed", str(seed), "--device", "cpu", "--no-progress", "--overwrite"]
            vse(cmd + [a for s in sets for a in ("--set", s)], log)
        atomic_write_json(done, {"trained": True})
    test_file = folder.parent / f"seed{seed}_test.json"  # a result file may not lie inside the run it reads
    vse(["eval", str(folder), "--split", "test", "--device", "cpu", "--json-out", str(test_file)], log)
    best = json.loads((folder / "best.json").read_text())
    model, _ = load_run(folder, "best", "cpu")
    losses = train_losses(folder)
    collapses = [
        json.loads(x)
        for x in (folder / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
        if x.strip() and json.loads(x).get("kind") == "collapse"
    ]
    result = {
        "row": row.name,
        "label": row.label,
        "recipe": row.recipe,
        "seed": seed,
        "overrides": sets,
        "epochs": recipe.train.epochs,
        "batch_size": recipe.train.batch_size,
        "best_epoch": best.get("epoch"),
        "dev_rsum": best.get("rsum"),
        "test": json.loads(test_file.read_text()),
        "train_loss_by_epoch": losses,
        "collapse_value_epoch_mean": collapse_value(data, recipe.loss, recipe.train.batch_size),
        "collapse_alarms": collapses,
        "dev_last_scores": dev_scores(folder),
        "train_time_s": training_seconds(folder),
        "parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    atomic_write_json(result_file, result)
    return result


def load_results(out: Path, seeds: list[int]) -> dict[str, list[dict]]:
    from vsekit.utils.io import atomic_write_json

    found: dict[str, list[dict]] = {}
    for row in ROWS:
        for s in seeds:
            f = run_dir(out, row, s) / "result.json"
            if f.is_file():
                result = json.loads(f.read_text())
                if "dev_last_scores" not in result:  # runs scored before this measure was added
                    result["dev_last_scores"] = dev_scores(f.parent)
                    atomic_write_json(f, result)
                found.setdefault(row.name, []).append(result)
    return found


def loss_note(runs: list[dict]) -> str:
    """The last epoch's train loss per seed beside the hinge's collapse value, when the row has one."""
    cv = runs[0].get("collapse_value_epoch_mean")
    last = [r["train_loss_by_epoch"][max(r["train_loss_by_epoch"], key=int)] for r in runs]
    text = "last-epoch train loss " + " / ".join(f"{x:.2f}" for x in last)
    if cv:
        text += f" (collapse value 2 B m = {cv:.2f} an epoch on average)"
    sc = [r["dev_last_scores"] for r in runs]
    text += "; last checkpoint's dev scores: std " + " / ".join(f"{x['std']:.3f}" for x in sc)
    text += ", positive - negative " + " / ".join(f"{x['pos_minus_neg']:.3f}" for x in sc)
    alarms = sum(bool(r["collapse_alarms"]) for r in runs)
    return text + (f"; collapse alarm in {alarms} of {len(runs)} runs" if alarms else "")


def report(args) -> str:
    out = Path(args.out)
    results = load_results(out, args.seeds)
    folders = {f"{row.name} seed {s}": run_dir(out, row, s) for row in ROWS for s in args.seeds}
    lines, missing, per_seed = table_head(), [], []
    for row in ROWS:
        runs = results.get(row.name, [])
        done = {r["seed"] for r in runs}
        missing += [f"{row.name} seed {s}" for s in args.seeds if s not in done]
        if not runs:
            continue
        lines.append(table_row(row.label, runs))
        rs = ", ".join(f"seed {r['seed']} {r['test']['rsum']:.1f} (dev {r['dev_rsum']:.1f})" for r in runs)
        per_seed.append(f"- {row.name}: test rsum {rs}; {loss_note(runs)}")
    cmd = (
        "OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python scripts/experiments/wesnoth_methods_table.py "
        "--data data/wesnoth --out runs/wesnoth_methods"
    )
    sections = [
        "# Methods on the Wesnoth clips (test split, mean ± std over seeds, recalls in %)\n",
        f"Command: `{cmd}`\n",
        "\n".join(lines),
        "",
        "Per seed:\n",
        *per_seed,
        "",
    ]
    notes = [
        *NOTES,
        "Train time: the trainer's training seconds summed over the epochs (validation excluded), one torch "
        "thread, one run at a time, niced, on a shared 2-core CPU: compare within this table only, loosely.",
    ]
    return write_report(
        out, "wesnoth_methods", sections, notes, missing, failed_runs(folders, "result.json"), results
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/wesnoth")
    p.add_argument("--out", default="runs/wesnoth_methods")
    p.add_argument("--seeds", nargs="+", type=int, default=list(SEEDS))
    p.add_argument("--rows", nargs="+", default=[r.name for r in ROWS], choices=[r.name for r in ROWS])
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    if not args.report_only:
        for s in args.seeds:  # seed by seed, one run at a time
            for row in (r for r in ROWS if r.name in args.rows):
                try:
                    res = run_one(row, s, Path(args.data), Path(args.out))
                    print(
                        f"{row.name} seed {s}: test rsum {res['test']['rsum']:.1f}, best epoch "
                        f"{res['best_epoch']}, {res['train_time_s']:.0f} s",
                        flush=True,
                    )
                except Exception as e:  # one failed run must not lose the others; the error is a finding
                    folder = run_dir(Path(args.out), row, s)
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / "failed.txt").write_text(f"{type(e).__name__}: {e}\n", encoding="utf-8")
                    print(f"FAILED {row.name} seed {s}: {type(e).__name__}: {e}", flush=True)
    print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
