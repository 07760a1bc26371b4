"""Training through mismatched pairs on openclipart or the Wesnoth clips: the floor, VSE∞, RCL, NCR and IN2R at
several caption-level noise rates, under the demo's protocol (openclipart) or the Wesnoth methods table's
(`--protocol wesnoth`: its 256-d, 30-epoch shrink on every deep row), docs/noisy.md.

For each rate a noisy copy of the set is written once by `vse data noise` (caption level as NCR draws it,
noise seed 0; dev and test untouched), then every row x seed trains through the methods table's runner
(`methods_table.run_one`: the demo's overrides, best-on-dev epoch, test split). NCR's row is the pair (the
mean of both networks' similarities) with each network alone beside it, and IN2R's likewise; the audit's AUC (how well the run
ranks the truly mismatched training pairs below the clean ones, against the copy's recorded ground truth) is
computed for the floor and VSE∞ (per-pair loss) and for NCR and IN2R both ways: the best weights' per-pair
loss, and each network's split made from the best weights (read from the run's metrics.jsonl, split_auc.py).

    nice -n 10 .venv/bin/python scripts/experiments/noisy_table.py --data data/openclipart \\
        --out runs/noisy --rates 0.4 --seeds 0 1 2 --jobs 2
    .venv/bin/python scripts/experiments/noisy_table.py --data data/openclipart --out runs/noisy --report-only
    nice -n 10 .venv/bin/python scripts/experiments/noisy_table.py --protocol wesnoth --data data/wesnoth \\
        --out runs/noisy_wesnoth --rates 0.0 0.2 0.5 0.8 --seeds 0 --jobs 2

Finished runs are reused, interrupted ones resume. Writes OUT/noisy.md, OUT/noisy.json and OUT/noisy.png.
`--records FILE` (docs/results/noisy_openclipart.json) keeps one compact line per finished run (its rsums, AUCs,
seed, the build of the set and the machine it started on) across machines: the table and the plot are made from
the file's runs and this machine's, a local run replacing the file's line of the same rate, row and seed, and the
union is written back.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import traceback
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

from methods_table import Busy, Row, run_dir, run_one
from methods_table import mean_std as cell

ROWS = [
    Row("bow", "bow"),
    Row("vse_infty_bigru", "vse_infty_bigru"),
    Row("rcl_bigru", "", "rcl", "RCL (complementary contrastive), BiGRU"),
    # the release warms up 5 of 40 epochs; the same share of the demo's 8 is 1
    Row("ncr_bigru", "", "ncr", "NCR (co-divide, two networks), BiGRU", ("loss.warmup_epochs=1",)),
    # the release warms up 1 epoch, then co-trains 40
    Row("in2r_bigru", "", "in2r", "IN2R (co-divide, peer queues), BiGRU", ("loss.warmup_epochs=1",)),
]
PAIRS = {"ncr_bigru": "NCR", "in2r_bigru": "IN2R"}  # two-network rows: the pair and network A alone
AUDITED = ("bow", "vse_infty_bigru", "ncr_bigru", "in2r_bigru")  # the floor first, as in every table


LEVEL = {"caption": "c", "image": "i"}
RESULT_FILE = {"demo": "study_result.json", "wesnoth": "result.json"}  # what each protocol's runner writes
RELEASE_NCR_WARMUP = (5, 40)  # NCR's release: 5 warm-up epochs of 40


def wesnoth_row(row: Row):
    """`row` under the Wesnoth methods table's protocol (docs/wesnoth.md): the floor's recipe unchanged, every
    deep row its recipe plus the table's shrink. VSE∞ is the `vse_infty` recipe itself (not `vse_infty_video`),
    the one the three noise-robust recipes are built on, so each row differs from it by its method only."""
    from wesnoth_methods_table import EPOCHS
    from wesnoth_methods_table import Row as WesnothRow

    if row.name == "bow":
        return WesnothRow("bow", "bow", "floor: bag of words", shrink=False)
    extra = tuple(row.extra)
    if row.recipe == "ncr":  # the release's warm-up share of this schedule
        extra = (f"loss.warmup_epochs={round(RELEASE_NCR_WARMUP[0] / RELEASE_NCR_WARMUP[1] * EPOCHS)}",)
    return WesnothRow(row.name, row.recipe or "vse_infty", row.label or "VSE∞ (GPO), BiGRU", extra=extra)


def rate_tag(rate: float, level: str = "caption") -> str:
    return f"{LEVEL[level]}{round(rate * 100):02d}"


def noisy_copy(data: Path, rate: float, root: Path, level: str = "caption") -> Path:
    """The set with `rate` of its training pairs reassigned at `level` (written once; rate 0: the set itself)."""
    if rate == 0:
        return data
    dst = root / f"{data.name}_{rate_tag(rate, level)}"
    if not (dst / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        vse = Path(sys.executable).with_name("vse")
        subprocess.run(
            [str(vse), "data", "noise", str(data), "--out", str(dst), "--rate", str(rate), "--seed", "0"]
            + ["--level", level],
            check=True,
        )
    return dst


def run_machine(folder: Path) -> dict | None:
    """The machine the run started on (config.json's, recorded by runs trained on the current code)."""
    from vsekit.runs import read_run_config

    machine = read_run_config(folder)[2].get("machine")
    return machine if isinstance(machine, dict) else None


def run_seed(folder: Path) -> int:
    from vsekit.runs import read_run_config

    return int(read_run_config(folder)[0].train.seed)


def extras(row: Row, folder: Path, data: Path) -> dict:
    """What the table adds to a finished run: each network alone (a pair) and the audit's AUC."""
    out_file = folder / "noisy_extra.json"
    out: dict = json.loads(out_file.read_text()) if out_file.is_file() else {}
    seed = run_seed(folder)
    if out.get("audit_seed", 0) != seed:  # scored in another caption order than `vse data audit`'s: redo
        out = {k: v for k, v in out.items() if k not in ("audit", "audit_loss", "audit_seed")}
    needed = [f"test_{m}" for m in ("A", "B") if row.name in PAIRS]
    if row.name in AUDITED and (data / "train_noise_clean.npy").exists():
        needed += ["audit"] + (["audit_loss"] if row.name in PAIRS else [])
    missing = [key for key in needed if key not in out]
    if out_file.is_file() and not missing:
        return out
    from vsekit.evaluation import evaluate_model
    from vsekit.evaluation.audit import audit_split, prepare, scores_of
    from vsekit.runs import load_run

    if "test_A" in missing:
        for member in ("A", "B"):
            model, _ = load_run(folder, "best", "cpu", member)
            out[f"test_{member}"] = evaluate_model(model, data, "test", progress=False)[0]
    if "audit" in missing or "audit_loss" in missing:
        model, _ = load_run(folder, "best", "cpu")
        split, source, state, clean = prepare(model, folder, data, "train")
        if "audit" in missing:  # as `vse data audit` scores it: the split of the best weights where saved
            audit = audit_split(model, folder, data, progress=False, prepared=(split, source, state, clean))
            out["audit"] = scores_of(audit)
        if "audit_loss" in missing:  # the best weights' own per-pair losses
            audit = audit_split(model, folder, data, progress=False, prepared=(split, source, None, clean))
            out["audit_loss"] = scores_of(audit)
        out["audit_seed"] = seed  # the order's seed: the run's own, as `vse data audit` draws it
    out_file.write_text(json.dumps(out, indent=1))
    return out


def train_and_score(
    row: Row, seed: int, data: str, out: str, epochs: int, threads: int, protocol: str
) -> dict:
    if protocol == "wesnoth":
        import wesnoth_methods_table

        res = wesnoth_methods_table.run_one(wesnoth_row(row), seed, Path(data), Path(out))
    else:
        res = run_one(row, seed, data, out, epochs, threads)
    return {**res, **extras(row, run_dir(Path(out), row, seed), Path(data))}


def best_weights_split_auc(folder: Path) -> dict | None:
    """The AUC (fraction) of the split the best weights made, mean of both networks' (split_auc.py), or None:
    no recorded noise, or the best epoch was the last, whose weights never split."""
    from split_auc import summary

    found = summary(folder)
    if found is None or found["A"]["best_weights"] is None:
        return None
    return {"auc": (found["A"]["best_weights"] + found["B"]["best_weights"]) / 200}


def results(
    out: Path, rates: list[float], seeds: list[int], level: str = "caption", protocol: str = "demo"
) -> dict:
    found: dict = {}
    for rate in rates:
        for row in ROWS:
            for s in seeds:
                folder = run_dir(out / rate_tag(rate, level), row, s)
                result_file = folder / RESULT_FILE[protocol]
                if result_file.is_file() and (folder / "noisy_extra.json").is_file():
                    r = {**json.loads(result_file.read_text())}
                    r.update(json.loads((folder / "noisy_extra.json").read_text()))
                    if row.name in PAIRS:
                        r["split_auc"] = best_weights_split_auc(folder)
                    machine = run_machine(folder)
                    if machine:
                        r["machine"] = machine
                    found.setdefault((rate, row.name), []).append(r)
    return found


RECORDS_MAX_BYTES = 64 << 20  # ~1,000 bytes a run: room for far more runs than any table holds
RECORD_KEYS = (
    "seed",
    "best_epoch",
    "test",
    "test_A",
    "test_B",
    "audit",
    "audit_loss",
    "audit_seed",
    "split_auc",
    "machine",
)


def build_of(data: Path) -> str:
    """A short name of the set's build: the start of its training features' sha256 (the manifest's, else
    hashed here: the Wesnoth set's manifest records none for its frames)."""
    from vsekit.data.manifest import read_manifest
    from vsekit.utils.io import sha256_file

    files = read_manifest(data).get("files_sha256") or {}
    if "train_ims.npy" in files:
        return str(files["train_ims.npy"])[:12]
    for name in ("train_ims.npy", "train_frames.npy"):
        if (data / name).is_file():
            return sha256_file(data / name)[:12]
    return "unknown"


def compact(rate: float, level: str, row: str, build: str, r: dict) -> dict:
    """One run as the records file keeps it: rsums and recalls, the audits' scores, where it ran."""
    rec = {"rate": rate, "level": level, "row": row, "build": build}
    return rec | {k: r[k] for k in RECORD_KEYS if k in r}


def merge_records(path: Path, found: dict, level: str, build: str) -> list[dict]:
    """The file's records with this machine's runs put in (one line per rate, level, row and seed)."""
    from vsekit.utils.safe_json import read_json_file

    kept = read_json_file(path, RECORDS_MAX_BYTES, "a noisy table's records") if path.is_file() else []
    local = [compact(rate, level, row, build, r) for (rate, row), rs in found.items() for r in rs]
    key = lambda rec: (rec["rate"], rec["level"], rec["row"], rec["seed"])  # noqa: E731
    merged = {key(rec): rec for rec in kept} | {key(rec): rec for rec in local}
    return sorted(merged.values(), key=lambda rec: (rec["level"], rec["rate"], rec["row"], rec["seed"]))


def from_records(records: list[dict], rates: list[float], seeds: list[int], level: str) -> dict:
    found: dict = {}
    for rec in records:
        if rec["level"] == level and rec["rate"] in rates and rec["seed"] in seeds:
            found.setdefault((rec["rate"], rec["row"]), []).append(rec)
    return found


def report(args) -> str:
    out = Path(args.out)
    found = results(out, args.rates, args.seeds, args.level, args.protocol)
    if args.records:
        records = merge_records(Path(args.records), found, args.level, build_of(Path(args.data)))
        Path(args.records).write_text(json.dumps(records, indent=1) + "\n")
        found = from_records(records, args.rates, args.seeds, args.level)
    set_name = "the Wesnoth clips" if args.protocol == "wesnoth" else "openclipart"
    head = "| model | " + " | ".join(f"{round(r * 100)} % noise" for r in args.rates) + " |"
    lines = [head, "|" + "---|" * (len(args.rates) + 1)]
    labels = {
        "bow": "Floor: bag of words (linear)",
        "vse_infty_bigru": "VSE∞ (GPO), BiGRU",
        "rcl_bigru": "RCL, BiGRU",
    }
    for row in ROWS:
        if row.name in PAIRS:
            name = PAIRS[row.name]
            for key, label in (
                ("test", f"{name} pair (mean of A and B)"),
                ("test_A", f"{name} network A alone"),
            ):
                cells = [
                    cell([r[key]["rsum"] for r in found.get((rate, row.name), [])]) for rate in args.rates
                ]
                lines.append(f"| {label}, BiGRU | " + " | ".join(cells) + " |")
            continue
        cells = [cell([r["test"]["rsum"] for r in found.get((rate, row.name), [])]) for rate in args.rates]
        lines.append(f"| {labels[row.name]} | " + " | ".join(cells) + " |")
    audit = [
        "| run | " + " | ".join(f"{round(r * 100)} %" for r in args.rates) + " |",
        "|" + "---|" * (len(args.rates) + 1),
    ]
    audited = (
        ("bow", "audit", "Floor (bag of words), per-pair loss"),
        ("vse_infty_bigru", "audit", "VSE∞, per-pair loss"),
        ("ncr_bigru", "audit_loss", "NCR pair, per-pair loss"),
        ("ncr_bigru", "split_auc", "NCR, each network's split of the best weights (mean AUC of A and B)"),
        ("in2r_bigru", "audit_loss", "IN2R pair, per-pair loss"),
        ("in2r_bigru", "split_auc", "IN2R, each network's split of the best weights (mean AUC of A and B)"),
    )
    for name, key, label in audited:
        cells = []
        for rate in args.rates:
            aucs = [r[key]["auc"] for r in found.get((rate, name), []) if r.get(key)]
            cells.append(cell([100 * a for a in aucs]))
        audit.append(f"| {label} | " + " | ".join(cells) + " |")
    seeds_done = {k: sorted(r["seed"] for r in v) for k, v in found.items()}
    builds = sorted({r["build"] for v in found.values() for r in v if "build" in r})
    machines = sorted(
        {
            f"{m.get('cpu')} ({m.get('cpu_kernels')} kernels)"
            for v in found.values()
            for r in v
            if (m := r.get("machine"))
        }
    )
    text = "\n".join(
        [
            f"# Noisy pairs on {set_name}, {args.level}-level noise (test rsum, mean ± std over seeds)\n",
            "\n".join(lines),
            "",
            "Audit AUC (%), training pairs, mismatched = positive:\n",
            "\n".join(audit),
            "",
            "Seeds per cell: "
            + "; ".join(f"{round(k[0] * 100)} % {k[1]}: {v}" for k, v in sorted(seeds_done.items())),
            "",
            *([f"Builds of the set: {', '.join(builds)}", ""] if builds else []),
            *([f"Machines the runs started on: {'; '.join(machines)}", ""] if machines else []),
        ]
    )
    stem = "noisy" if args.level == "caption" else f"noisy_{args.level}"
    (out / f"{stem}.md").write_text(text)
    (out / f"{stem}.json").write_text(
        json.dumps({f"{k[0]}:{k[1]}": v for k, v in found.items()}, indent=1, default=str)
    )
    plot(found, args.rates, out / f"{stem}.png", set_name)
    return text


def plot(found: dict, rates: list[float], path: Path, set_name: str = "openclipart") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    series = [
        ("bow", "test", "floor (bag of words)"),
        ("vse_infty_bigru", "test", "VSE∞"),
        ("rcl_bigru", "test", "RCL"),
    ]
    for row, name in PAIRS.items():
        series += [(row, "test", f"{name} pair"), (row, "test_A", f"{name} network A")]
    for name, key, label in series:
        xs, ys, es = [], [], []
        for rate in rates:
            vals = [r[key]["rsum"] for r in found.get((rate, name), []) if key in r]
            if vals:
                xs.append(100 * rate)
                ys.append(statistics.fmean(vals))
                es.append(statistics.stdev(vals) if len(vals) > 1 else 0.0)
        if xs:
            style = "--" if key == "test_A" else "-"  # a network alone: dashed beside its pair
            colour = f"C{[r.name for r in ROWS].index(name)}"  # a pair and its network A share one
            ax.errorbar(xs, ys, yerr=es, marker="o", capsize=3, linestyle=style, color=colour, label=label)
    ax.set_xlabel("training captions reassigned (%)")
    ax.set_ylabel("test rsum")
    ax.set_title(f"{set_name}: test rsum against the noise rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", default="data/openclipart")
    p.add_argument("--out", default="runs/noisy")
    p.add_argument("--noisy-root", default="data/noisy", help="where the noisy copies are written")
    p.add_argument("--rates", nargs="+", type=float, default=[0.0, 0.2, 0.5, 0.8])
    p.add_argument("--level", choices=tuple(LEVEL), default="caption", help="caption (NCR) or image (RCL)")
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--rows", nargs="+", default=[r.name for r in ROWS], choices=[r.name for r in ROWS])
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--protocol",
        choices=tuple(RESULT_FILE),
        default="demo",
        help="demo: the demo's overrides (openclipart); wesnoth: the Wesnoth methods table's shrink",
    )
    p.add_argument("--report-only", action="store_true")
    p.add_argument(
        "--records",
        help="a JSON file of finished runs (one line per rate, row and seed) merged with this machine's",
    )
    args = p.parse_args()
    from vsekit_lab.demo import DEMO_EPOCHS

    if not args.report_only:
        copies = {
            rate: noisy_copy(Path(args.data), rate, Path(args.noisy_root), args.level) for rate in args.rates
        }
        slow_first = {"in2r_bigru": 0, "ncr_bigru": 1, "rcl_bigru": 2, "vse_infty_bigru": 3}
        jobs = sorted(
            ((rate, r, s) for rate in args.rates for r in ROWS if r.name in args.rows for s in args.seeds),
            key=lambda j: (j[2], slow_first.get(j[1].name, 9)),
        )
        with ProcessPoolExecutor(max_workers=args.jobs) as pool:
            futures = {
                pool.submit(
                    train_and_score,
                    r,
                    s,
                    str(copies[rate]),
                    str(Path(args.out) / rate_tag(rate, args.level)),
                    DEMO_EPOCHS,
                    args.threads,
                    args.protocol,
                ): (rate, r, s)
                for rate, r, s in jobs
            }
            for fut in as_completed(futures):
                rate, r, s = futures[fut]
                try:
                    res = fut.result()
                    print(
                        f"{rate_tag(rate, args.level)} {r.name} seed {s}: test rsum {res['test']['rsum']:.1f}",
                        flush=True,
                    )
                except Busy as e:
                    print(f"skipped: {e}", flush=True)
                except Exception as e:  # one failed run must not lose the others
                    folder = run_dir(Path(args.out) / rate_tag(rate, args.level), r, s)
                    folder.mkdir(parents=True, exist_ok=True)
                    (folder / "failed.txt").write_text(f"{type(e).__name__}: {e}\n", encoding="utf-8")
                    print(f"FAILED {rate_tag(rate, args.level)} {r.name} seed {s}: {e}", flush=True)
                    traceback.print_exception(e)
    print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
