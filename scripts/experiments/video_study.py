"""The video study on the moving-shapes set (docs/video.md): VSE++ vs VSE∞ video recipes, the bag-of-words
floor, and a frame-count generalisation check (train on 6-16 frames a clip, test on 2-4 and 24-32).

Steps, each a `vse` command run as a subprocess and recorded verbatim in the report:
1. build the set with real EfficientNet-Lite0 frame features (`vse data moving-shapes`), plus two test-only
   builds of the *same* test clips and captions with shorter and longer frame counts (`--splits test --frames`);
2. train every variant over the seeds (`vse train`), shrunk for a CPU with `--set` overrides (printed in the
   report): 256-d instead of 1024, fewer epochs at a higher lr, the lr x0.1 for the last epochs // 4,
   every word of the small vocabulary kept;
3. score each run's best-on-dev checkpoint on the three test sets (`vse eval --json-out`), and the VSE++ +
   VSE∞ ensemble of each seed (`vse eval RUN_A RUN_B`); then two-alternative probes in-process (`probe`):
   the right caption against the same events in swapped order, or with one action replaced by its opposite;
4. write the Markdown tables (mean ± std over seeds) into docs/video.md between the study markers.

    OMP_NUM_THREADS=1 nice -n 5 .venv/bin/python scripts/experiments/video_study.py --out runs/video_study
    .venv/bin/python scripts/experiments/video_study.py --out runs/video_study --report-only  # no training: probes + tables

Finished steps (manifest.json, a run's done.json, eval JSON present) are skipped, so an interrupted study resumes.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VSE = str(Path(sys.executable).parent / "vse")
BEGIN, END = "<!-- video-study:begin -->", "<!-- video-study:end -->"
TESTS = (("test", "data", "6-16 (as train)"), ("short", "data_short", "2-4"), ("long", "data_long", "24-32"))


@dataclass(frozen=True)
class Variant:
    name: str
    label: str
    recipe: str
    overrides: tuple[str, ...]
    cpu: bool = True  # takes the CPU shrink overrides (the floor runs its own recipe as is)


VARIANTS = (
    Variant("floor", "floor: `bow` (linear, mean of frames / words)", "bow", (), cpu=False),
    Variant("vsepp", "VSE++ `vsepp_video` (avg frames, avg words)", "vsepp_video", ()),
    Variant("vse_infty", "VSE∞ `vse_infty_video` (GPO frames, GPO words)", "vse_infty_video", ()),
    Variant(
        "max", "`vsepp_video`, max over frames (avg words)", "vsepp_video", ("model.image.pooling.name=max",)
    ),
    Variant(
        "gpo_frames",
        "`vsepp_video`, GPO over frames (avg words)",
        "vsepp_video",
        ("model.image.pooling.name=gpo",),
    ),
)
KEYS = ("i2t_r1", "i2t_r5", "i2t_r10", "t2i_r1", "t2i_r5", "t2i_r10", "rsum")


def cpu_overrides(epochs: int, embed_dim: int, lr: float) -> list[str]:
    decay = max(1, epochs - max(1, epochs // 4))
    return [
        f"model.embed_dim={embed_dim}",
        f"train.epochs={epochs}",
        f"optim.lr={lr:g}",
        f"optim.lr_decay_epochs=[{decay}]",
        "model.text.vocab_min_count=1",
        "train.log_every=0",
    ]


class Runner:
    """Runs `vse` commands, logs each one (with its wall time) for the report."""

    def __init__(self, out: Path, dry: bool = False) -> None:
        self.out = out
        self.log_path = out / "commands.jsonl"
        self.dry = dry

    def __call__(self, args: list[str], what: str) -> None:
        cmd = [VSE, *args]
        shown = "vse " + " ".join(shlex.quote(a) for a in args)
        print(f"[{time.strftime('%H:%M:%S')}] {what}: {shown}", flush=True)
        if self.dry:
            return
        start = time.time()
        with open(self.out / "logs" / f"{what}.log", "w", encoding="utf-8") as log:
            rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
        if rc != 0:
            raise SystemExit(f"{what} failed (exit {rc}); see {self.out / 'logs' / f'{what}.log'}")
        with open(self.log_path, "a", encoding="utf-8") as f:
            f.write(
                json.dumps({"what": what, "command": shown, "seconds": round(time.time() - start, 1)}) + "\n"
            )


def build(run: Runner, out: Path, clips: list[int], seed: int) -> None:
    common = ["--seed", str(seed), "--no-progress"]
    if not (out / "data" / "manifest.json").is_file():
        run(
            ["data", "moving-shapes", "--out", str(out / "data"), "--clips", *map(str, clips), *common],
            "build_data",
        )
    for name, frames in (("data_short", ("2", "4")), ("data_long", ("24", "32"))):
        if not (out / name / "manifest.json").is_file():
            run(
                [
                    "data",
                    "moving-shapes",
                    "--out",
                    str(out / name),
                    "--clips",
                    *map(str, clips),
                    "--splits",
                    "test",
                    "--frames",
                    *frames,
                    *common,
                ],
                f"build_{name}",
            )


def train_and_eval(run: Runner, out: Path, v: Variant, seed: int, shrink: list[str]) -> None:
    run_dir = out / "runs" / f"{v.name}_s{seed}"
    overrides = [*(shrink if v.cpu else ["train.log_every=0"]), *v.overrides]
    if not (run_dir / "done.json").is_file():  # written after `vse train` returned 0
        args = [
            "train",
            "--data",
            str(out / "data"),
            "--out",
            str(run_dir),
            "--recipe",
            v.recipe,
            "--seed",
            str(seed),
            "--device",
            "cpu",
            "--no-progress",
            "--overwrite",
        ]
        for o in overrides:
            args += ["--set", o]
        run(args, f"train_{v.name}_s{seed}")
        if not run.dry:
            (run_dir / "done.json").write_text("{}\n")
    (out / "eval").mkdir(parents=True, exist_ok=True)  # `--json-out` creates no folder
    for test, data, _ in TESTS:
        target = out / "eval" / f"{v.name}_s{seed}_{test}.json"
        if not target.is_file():
            run(
                [
                    "eval",
                    str(run_dir),
                    "--data",
                    str(out / data),
                    "--split",
                    "test",
                    "--device",
                    "cpu",
                    "--json-out",
                    str(target),
                ],
                f"eval_{v.name}_s{seed}_{test}",
            )


def ensemble(run: Runner, out: Path, seed: int) -> None:
    (out / "eval").mkdir(parents=True, exist_ok=True)  # `--json-out` creates no folder
    for test, data, _ in TESTS:
        target = out / "eval" / f"ensemble_s{seed}_{test}.json"
        if not target.is_file():
            runs = [str(out / "runs" / f"{n}_s{seed}") for n in ("vsepp", "vse_infty")]
            run(
                [
                    "eval",
                    *runs,
                    "--data",
                    str(out / data),
                    "--split",
                    "test",
                    "--device",
                    "cpu",
                    "--json-out",
                    str(target),
                ],
                f"eval_ensemble_s{seed}_{test}",
            )


# --------------------------------------------------------------------------------------------- probes

OPPOSITE = {
    "left": "right",
    "right": "left",
    "up": "down",
    "down": "up",
    "grow": "shrink",
    "shrink": "grow",
    "appear": "disappear",
    "disappear": "appear",
}


def phrase(e: dict, action: str | None = None) -> str:
    """One canonical wording of an event (first synonym of the shape and of the verb)."""
    from vsekit_lab.datasets.moving_shapes import SHAPE_WORDS, VERBS

    art = "an" if e["color"][0] in "aeiou" else "a"
    return f"{art} {e['color']} {SHAPE_WORDS[e['shape']][0]} {VERBS[action or e['action']][0]}"


def probe(run_dir: Path, data_dir: Path) -> dict:
    """Two-alternative probes on the test clips, chance 50 % (a tie counts half):
    order: two-event clips, "A, then B" against "B, then A" (a bag of words cannot tell them apart);
    action: each event's action against its opposite (left/right, up/down, grow/shrink, appear/disappear)."""
    import numpy as np
    import torch

    sys.path.insert(0, str(REPO / "src"))
    from vsekit import api
    from vsekit.data.frames import load_frames

    torch.set_num_threads(1)
    model = api.load(run_dir, "cpu")
    frames = load_frames(data_dir, "test")
    scripts = [json.loads(x)["events"] for x in (data_dir / "test_clips.jsonl").read_text().splitlines()]
    pairs: dict[str, list[tuple[int, str, str]]] = {"order": [], "action": []}
    for i, ev in enumerate(scripts):
        if len(ev) == 2:
            pairs["order"].append(
                (i, f"{phrase(ev[0])}, then {phrase(ev[1])}", f"{phrase(ev[1])}, then {phrase(ev[0])}")
            )
        for k in range(len(ev)):
            right = [phrase(e) for e in ev]
            wrong = [phrase(e, OPPOSITE[e["action"]]) if j == k else phrase(e) for j, e in enumerate(ev)]
            pairs["action"].append((i, ", then ".join(right), ", then ".join(wrong)))
    out: dict = {}
    with torch.no_grad():
        clips = torch.cat(
            [api.encode_image(model, np.asarray(frames[i], dtype=np.float32)) for i in range(len(frames))]
        )
        for name, items in pairs.items():
            idx = torch.tensor([i for i, _, _ in items])
            right = api.encode_text(model, [r for _, r, _ in items])
            wrong = api.encode_text(model, [w for _, _, w in items])
            s_right, s_wrong = (clips[idx] * right).sum(1), (clips[idx] * wrong).sum(1)
            tie = (
                s_right - s_wrong
            ).abs() < 1e-5  # the same bag of words summed in another order: float noise
            acc = ((s_right > s_wrong) & ~tie).float().mean() + 0.5 * tie.float().mean()
            out[name] = round(100 * float(acc), 2)
            out[f"n_{name}"] = len(items)
    return out


def run_probes(out: Path, names: list[str], seeds: list[int]) -> None:
    for name in names:
        for seed in seeds:
            for test, data, _ in TESTS:
                target = out / "eval" / f"{name}_s{seed}_{test}_probe.json"
                run_dir = out / "runs" / f"{name}_s{seed}"
                if not target.is_file() and (run_dir / "done.json").is_file():
                    target.write_text(json.dumps(probe(run_dir, out / data)) + "\n")


# --------------------------------------------------------------------------------------------- report


def load_metrics(out: Path, name: str, seeds: list[int], test: str) -> list[dict]:
    found = []
    for s in seeds:
        p = out / "eval" / f"{name}_s{s}_{test}.json"
        if p.is_file():
            found.append(json.loads(p.read_text()))
    return found


def cell(values: list[float]) -> str:
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.1f}"
    return f"{statistics.mean(values):.1f} ± {statistics.stdev(values):.1f}"


def chance_rsum(out: Path) -> str:
    """Expected rsum of a random ranking of the test split (exact for its clip and caption counts)."""
    from math import comb

    sys.path.insert(0, str(REPO / "src"))
    from vsekit.data.precomp import load_precomp_split

    split = load_precomp_split(out / "data", "test")
    n, c = split.n_images, split.n_captions
    per = [int((split.cap2img == i).sum()) for i in range(n)]
    i2t = sum(statistics.mean(1 - comb(c - m, k) / comb(c, k) for m in per) for k in (1, 5, 10))
    t2i = sum(k / n for k in (1, 5, 10))
    return f"{100 * (i2t + t2i):.1f} ({n} clips, {c} captions)"


def report(out: Path, seeds: list[int], shrink: list[str], doc: Path) -> str:
    lines = []
    manifest = json.loads((out / "data" / "manifest.json").read_text())
    lines.append(
        f"Set: `{out / 'data'}`: "
        + ", ".join(
            f"{k} {v['clips']} clips / {v['captions']} captions / {v['frames']} frames"
            for k, v in manifest["splits"].items()
        )
        + f"; features {manifest['extractor']['name']} ({manifest['extractor']['dim']}-d a frame). "
        f"Random ranking of its test split: rsum {chance_rsum(out)}. Seeds {', '.join(map(str, seeds))}; "
        "mean ± sample std over seeds; best-on-dev checkpoint."
    )
    lines.append("")
    lines.append(f"CPU shrink, every row but the floor: `{' '.join('--set ' + s for s in shrink)}`.")
    lines.append("")
    lines.append("**Test split (6–16 frames a clip, as in training).**")
    lines.append("")
    lines.append("| model | V→T R@1 | R@5 | R@10 | T→V R@1 | R@5 | R@10 | rsum |")
    lines.append("|---|---|---|---|---|---|---|---|")
    rows = [(v.label, v.name) for v in VARIANTS] + [
        ("ensemble VSE++ + VSE∞ (same seed, mean similarity)", "ensemble")
    ]
    rows = [
        (label, name) for label, name in rows if load_metrics(out, name, seeds, "test")
    ]  # variants not run: no row
    for label, name in rows:
        ms = load_metrics(out, name, seeds, "test")
        lines.append(f"| {label} | " + " | ".join(cell([m[k] for m in ms]) for k in KEYS) + " |")
    lines.append("")
    lines.append(
        "**Frame-count generalisation: rsum on the same test clips and captions rendered with other "
        "frame counts (models trained on 6–16 frames).**"
    )
    lines.append("")
    lines.append("| model | " + " | ".join(f"{frames} frames" for _, _, frames in TESTS) + " |")
    lines.append("|---|" + "---|" * len(TESTS))
    for label, name in rows:
        lines.append(
            f"| {label} | "
            + " | ".join(cell([m["rsum"] for m in load_metrics(out, name, seeds, t)]) for t, _, _ in TESTS)
            + " |"
        )
    lines.append("")
    lines.append(
        "**Probes: does the model tell the right caption from a minimally wrong one?** Accuracy over test "
        'clips (chance 50 %). *Order*: two-event clips, "A, then B" against "B, then A". *Action*: one '
        "event's action against its opposite (left/right, up/down, grow/shrink, appear/disappear). Canonical "
        "wording; `probe()` in the script."
    )
    lines.append("")
    lines.append(
        "| model | " + " | ".join(f"order, {f} frames | action, {f} frames" for _, _, f in TESTS) + " |"
    )
    lines.append("|---|" + "---|---|" * len(TESTS))
    for v in VARIANTS:
        if not load_metrics(out, v.name, seeds, "test"):
            continue
        cells = []
        for t, _, _ in TESTS:
            ps = [
                json.loads(p.read_text())
                for s in seeds
                if (p := out / "eval" / f"{v.name}_s{s}_{t}_probe.json").is_file()
            ]
            cells += [cell([x["order"] for x in ps]), cell([x["action"] for x in ps])]
        lines.append(f"| {v.label} | " + " | ".join(cells) + " |")
    lines.append("")
    cmds = (
        [json.loads(x) for x in (out / "commands.jsonl").read_text().splitlines()]
        if (out / "commands.jsonl").is_file()
        else []
    )
    if cmds:
        lines.append(
            "<details><summary>Every command of the study, with its wall time on the shared 2-core machine"
            "</summary>\n\n```"
        )
        lines += [f"{c['command']}    # {c['seconds']:.0f} s" for c in cmds]
        lines.append("```\n</details>")
    table = "\n".join(lines)
    if doc.is_file():
        text = doc.read_text(encoding="utf-8")
        if BEGIN in text and END in text:
            head, rest = text.split(BEGIN, 1)
            _, tail = rest.split(END, 1)
            doc.write_text(f"{head}{BEGIN}\n{table}\n{END}{tail}", encoding="utf-8")
    (out / "report.md").write_text(table + "\n", encoding="utf-8")
    return table


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=Path("runs/video_study"))
    p.add_argument("--clips", type=int, nargs=3, default=[600, 150, 150], metavar=("TRAIN", "DEV", "TEST"))
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--data-seed", type=int, default=0)
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--embed-dim", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    # gpo_frames (GPO over frames, average over words) isolates the frame pooling; off by default for CPU time
    p.add_argument(
        "--variants",
        nargs="+",
        default=["floor", "vsepp", "vse_infty", "max"],
        choices=[v.name for v in VARIANTS],
    )
    p.add_argument("--doc", type=Path, default=REPO / "docs" / "video.md")
    p.add_argument("--report-only", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="print the commands only")
    args = p.parse_args()
    out = args.out
    (out / "logs").mkdir(parents=True, exist_ok=True)
    (out / "eval").mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    shrink = cpu_overrides(args.epochs, args.embed_dim, args.lr)
    if not args.report_only:
        run = Runner(out, args.dry_run)
        build(run, out, args.clips, args.data_seed)
        for seed in args.seeds:  # seed-major: a partial study has every variant at the first seeds
            for v in VARIANTS:
                if v.name in args.variants:
                    train_and_eval(run, out, v, seed, shrink)
            if {"vsepp", "vse_infty"} <= set(args.variants):
                ensemble(run, out, seed)
    if not args.dry_run:
        run_probes(
            out,
            [v for v in args.variants if v != "floor"] + (["floor"] if "floor" in args.variants else []),
            args.seeds,
        )
        print(report(out, args.seeds, shrink, args.doc))


if __name__ == "__main__":
    main()
