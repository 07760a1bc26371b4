"""`vse bench epoch`: one epoch of `vse train`, end to end, on a synthetic set of COCO's size.

The step benchmark (`vse bench train-step`) times one batch shape over and over; what a user waits for is an
epoch: start-up, the vocabulary of 566k captions, the data path over a 16.7 GB memory-mapped set, every step
with its real batch shapes, validation and the checkpoint. This writes a COCO-shaped precomp set
(`write_coco_like`: the train split at COCO's 113,287 images x 5 captions, a 1,000-image dev split as the
validation the recipes run), runs `vse train --epochs 1` on it as its own process, and splits its wall time
with the run's own metrics.jsonl record of the epoch (training time, samples, data path):

    from vsekit_lab.bench.epoch import bench_epoch
    res = bench_epoch(n=113_287, device="cuda", overrides=["train.cuda_graph=true"])
    res["wall_s"], res["train_s"], res["samples_per_s"]

The features are random, so the dev recalls are chance and not reported: this measures time only.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from pathlib import Path

from vsekit.data.precomp import load_precomp_split
from vsekit.errors import VseInputError
from vsekit_lab.bench.data_path import DEFAULT_SETS, write_coco_like

COCO_TRAIN_IMAGES = 113_287  # Karpathy train + restval
DEV_IMAGES = 1_000  # validation runs on the first 1,000 dev images (data.val_max_images)
TAIL_LINES = 40  # of a failed run's output, kept in the error


class EpochRunError(RuntimeError):
    """`vse train` failed or ran past its time limit: no epoch figure."""


def write_epoch_set(
    out_dir: str | Path, n: int, regions: int, img_dim: int, dev_images: int, seed: int = 0
) -> Path:
    """The train split (n images) and a dev split (dev_images), both COCO-shaped, in `out_dir`."""
    write_coco_like(out_dir, n, regions, img_dim, seed=seed, split="train")
    write_coco_like(out_dir, dev_images, regions, img_dim, seed=seed + 1, split="dev")
    return Path(out_dir)


def epoch_record(run_dir: str | Path) -> dict:
    """The run's `epoch` record of metrics.jsonl: training time, samples, data path, peak memory."""
    path = Path(run_dir) / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    epochs = [r for r in records if r.get("kind") == "epoch"]
    if not epochs:
        raise EpochRunError(f"{path}: no epoch record (the run did not finish its epoch)")
    return epochs[-1]


def run_process(
    cmd: list[str], timeout: float | None, echo: Callable[[str], None] | None = None
) -> tuple[int, list[str]]:
    """Run `cmd` (its stderr into its stdout), keep the last TAIL_LINES lines of its output, and hand every
    line to `echo` as it comes (an epoch at COCO's size takes minutes). Past `timeout` seconds the process is
    killed and EpochRunError raised."""
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=os.environ.copy()
    )

    def pump() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            if echo is not None:
                echo(line.rstrip("\n"))

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired as e:
        proc.kill()
        proc.wait()
        raise EpochRunError(f"vse train ran past the time limit ({timeout:g} s); no epoch figure") from e
    finally:
        reader.join(timeout=10)
    return code, list(tail)


def bench_epoch(
    n: int = COCO_TRAIN_IMAGES,
    recipe: str = "vse_infty",
    device: str = "cpu",
    overrides: Sequence[str] = (),
    regions: int = 36,
    img_dim: int = 2048,
    dev_images: int = DEV_IMAGES,
    batch: int = 128,
    data_dir: str | Path | None = None,
    timeout: float | None = None,
    seed: int = 0,
    echo: Callable[[str], None] | None = None,
) -> dict:
    """Time `vse train --epochs 1` as a process on a synthetic COCO-shaped set (written to a temporary folder
    and removed after, unless `data_dir` names an existing precomp set: then its shapes are reported, not `n`,
    `regions` and `img_dim`). `overrides` are recipe keys; the synthetic captions are plain words, so the
    tokenizer is regex (any tokenizer reads them alike); `echo` receives the run's log lines as they come."""
    if n < 2 or dev_images < 2 or batch < 2:
        raise VseInputError(f"need n >= 2, dev_images >= 2 and batch >= 2; got {n}, {dev_images}, {batch}")
    tmp = Path(tempfile.mkdtemp(prefix="vsekit-bench-epoch-"))
    try:
        if data_dir is None:
            t0 = time.perf_counter()
            data_dir = write_epoch_set(tmp / "data", n, regions, img_dim, dev_images, seed)
            write_s = time.perf_counter() - t0
        else:
            write_s = 0.0
        run_dir = tmp / "run"
        sets = [*DEFAULT_SETS, f"data.val_max_images={dev_images}", *overrides]
        cmd = [sys.executable, "-m", "vsekit.cli", "train", "--data", str(data_dir), "--out", str(run_dir)]
        cmd += ["--recipe", recipe, "--epochs", "1", "--batch-size", str(batch), "--device", device]
        cmd += ["--seed", str(seed), "--no-progress"]
        for s in sets:
            cmd += ["--set", s]
        t0 = time.perf_counter()
        code, output = run_process(cmd, timeout, echo=echo)
        wall = time.perf_counter() - t0
        if code == 2:  # bad input (a recipe key, the --data folder): vse train's own one line
            lines = [x.strip() for x in output if x.strip()]
            msg = lines[-1] if lines else "refused its input (exit 2)"
            for prefix in ("vse train: error:", "error:"):
                msg = msg[len(prefix) :].strip() if msg.startswith(prefix) else msg
            raise VseInputError(f"vse train: {msg}")
        if code != 0:
            raise EpochRunError(f"vse train exited {code}:\n" + "\n".join(output))
        epoch = epoch_record(run_dir)
        n, regions, img_dim = load_precomp_split(data_dir, "train").features.shape  # what was trained on
        return {
            "recipe": recipe,
            "device": device,
            "overrides": list(overrides),
            "images": n,
            "captions": epoch["samples"],
            "regions": regions,
            "img_dim": img_dim,
            "batch": batch,
            "write_s": write_s,
            "wall_s": wall,
            "train_s": epoch["train_time_s"],
            "outside_epoch_s": wall - epoch["train_time_s"],  # start-up, vocabulary, validation, checkpoint
            "samples_per_s": epoch["samples_per_s"],
            "wall_samples_per_s": epoch["samples"] / wall,
            "data_path": epoch["data_path"],
            "peak_memory_gib": epoch["peak_memory_gib"],  # the run's: CUDA max allocated, or its peak RSS
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
