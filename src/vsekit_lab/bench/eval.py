"""`vse eval-sims` speed on the COCO 5K protocol shape (N images x 5N captions) against the reference loop.

The reference code (vse_infty / VSE++ / SCAN `evaluation.py` fns `i2t` and `t2i`) ranks with one
`np.argsort` per query: 5,000 argsorts of 25,000 scores, then 25,000 argsorts of 5,000 — about 8 s on a
CPU. vsekit's metrics module counts, per query, the candidates scoring strictly above the positive, in
vectorised shards. `bench_eval` writes a random N x 5N matrix (with a planted signal, so recalls are neither
0 nor 100) to a temporary .npy, times what `vse eval-sims` does with it (load + evaluate), and — unless
`reference=False` — the loop, and checks that both give the same metrics.

    from vsekit_lab.bench.eval import bench_eval
    row = bench_eval(n_images=5000)   # row["eval_sims_s"], row["reference_s"], row["speedup"]
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from vsekit.errors import VseInputError
from vsekit.metrics import cap2img_for_k, evaluate_sims


def reference_loop_metrics(sims: np.ndarray, captions_per_image: int = 5) -> dict[str, float]:
    """The reference `i2t` / `t2i` loops (argsort per query), kept as the speed and correctness baseline."""
    n_img = sims.shape[0]
    k = captions_per_image
    ranks = np.zeros(n_img)
    for i in range(n_img):
        inds = np.argsort(sims[i])[::-1]
        rank = 1e20
        for j in range(k * i, k * i + k):
            tmp = np.where(inds == j)[0][0]
            rank = min(rank, tmp)
        ranks[i] = rank
    sims_t = sims.T
    ranks_t = np.zeros(k * n_img)
    for i in range(n_img):
        for j in range(k):
            inds = np.argsort(sims_t[k * i + j])[::-1]
            ranks_t[k * i + j] = np.where(inds == i)[0][0]
    out: dict[str, float] = {}
    for prefix, r in (("i2t", ranks), ("t2i", ranks_t)):
        for kk in (1, 5, 10):
            out[f"{prefix}_r{kk}"] = 100.0 * len(np.where(r < kk)[0]) / len(r)
        out[f"{prefix}_medr"] = float(np.floor(np.median(r)) + 1)
        out[f"{prefix}_meanr"] = float(r.mean() + 1)
    out["rsum"] = sum(out[f"{d}_r{kk}"] for d in ("i2t", "t2i") for kk in (1, 5, 10))
    return out


def planted_sims(
    n_images: int, captions_per_image: int = 5, signal: float = 3.0, seed: int = 0
) -> np.ndarray:
    """float32 N x kN standard-normal scores, `signal` added where caption c belongs to image c // k."""
    rng = np.random.default_rng(seed)
    sims = rng.standard_normal((n_images, n_images * captions_per_image), dtype=np.float32)
    cols = np.arange(n_images * captions_per_image)
    sims[cols // captions_per_image, cols] += signal
    return sims


def bench_eval(
    n_images: int = 5000,
    captions_per_image: int = 5,
    repeats: int = 3,
    reference: bool = True,
    signal: float = 3.0,
    seed: int = 0,
    tmp_dir: str | None = None,
) -> dict:
    """Seconds for `vse eval-sims` on an N x kN .npy (median of `repeats`, file load included) and for the
    reference loop (once); `max_abs_diff` is the largest metric difference between the two."""
    from vsekit.data.sims import load_sims

    if n_images < 1 or captions_per_image < 1 or repeats < 1:
        raise VseInputError("n_images, captions_per_image and repeats must be positive")
    sims = planted_sims(n_images, captions_per_image, signal, seed)
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        path = Path(tmp) / "sims.npy"
        np.save(path, sims)
        times, metrics = [], {}
        for _ in range(repeats):
            t0 = time.perf_counter()
            loaded = load_sims([str(path)])  # exactly what `vse eval-sims FILE` runs
            metrics = evaluate_sims(loaded, cap2img_for_k(*loaded.shape, captions_per_image))
            times.append(time.perf_counter() - t0)
            del loaded
    t0 = time.perf_counter()
    evaluate_sims(sims, cap2img_for_k(*sims.shape, captions_per_image))
    in_memory = time.perf_counter() - t0
    row = {
        "images": n_images,
        "captions": n_images * captions_per_image,
        "repeats": repeats,
        "eval_sims_s": statistics.median(times),
        "eval_sims_min_s": min(times),
        "in_memory_s": in_memory,
        "rsum": metrics["rsum"],
        "reference_s": float("nan"),
        "speedup": float("nan"),
        "max_abs_diff": float("nan"),
    }
    if reference:
        t0 = time.perf_counter()
        ref = reference_loop_metrics(sims, captions_per_image)
        row["reference_s"] = time.perf_counter() - t0
        row["speedup"] = row["reference_s"] / row["eval_sims_s"]
        row["max_abs_diff"] = max(abs(ref[k] - metrics[k]) for k in ref)
    return row


# ------------------------------------------------------------------------ whole processes (vse bench eval-sims)
# The baseline: the least code that computes the same metrics with vectorised numpy, run as its own process
# (`python -c MINIMAL_EVAL_SIMS FILE K`): load the matrix, count the scores at or above each positive.
MINIMAL_EVAL_SIMS = """
import json, sys
import numpy as np
s = np.load(sys.argv[1])
k = int(sys.argv[2])
n_img, n_cap = s.shape
cols = np.arange(n_cap)
pos = s[cols // k, cols]
t2i = (s >= pos).sum(0) - 1
own = pos.reshape(n_img, k)
best = own.max(1)
i2t = (s >= best[:, None]).sum(1) - (own >= best[:, None]).sum(1)
out = {}
for p, r in (("i2t", i2t), ("t2i", t2i)):
    for kk in (1, 5, 10):
        out[f"{p}_r{kk}"] = float(100.0 * np.mean(r < kk))
    out[f"{p}_medr"] = float(np.floor(np.median(r)) + 1)
    out[f"{p}_meanr"] = float(r.mean() + 1)
out["rsum"] = sum(out[f"{d}_r{kk}"] for d in ("i2t", "t2i") for kk in (1, 5, 10))
print(json.dumps(out))
"""


def _run_process(cmd: list[str]) -> str:
    import subprocess

    from vsekit.errors import SetupError

    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SetupError(
            f"{cmd[2] if cmd[1] == '-m' else 'the minimal script'} exited with {proc.returncode}: "
            f"{proc.stderr.strip()[-1000:]}"
        )
    return proc.stdout


def bench_eval_sims_process(
    n_images: int = 5000,
    captions_per_image: int = 5,
    repeats: int = 3,
    signal: float = 3.0,
    seed: int = 0,
    tmp_dir: str | None = None,
) -> dict:
    """Wall seconds of `vse eval-sims FILE --json` and of `MINIMAL_EVAL_SIMS` on the same N x kN .npy, each
    a whole process (interpreter start, imports, load, metrics), alternated `repeats` times after one untimed
    run of each (the file is then in the page cache for both); medians, their ratio, and the largest
    difference between the metrics the two print (0.0: the same numbers)."""
    import json
    import sys

    if n_images < 1 or captions_per_image < 1 or repeats < 1:
        raise VseInputError("n_images, captions_per_image and repeats must be positive")
    with tempfile.TemporaryDirectory(dir=tmp_dir) as tmp:
        path = Path(tmp) / "sims.npy"
        np.save(path, planted_sims(n_images, captions_per_image, signal, seed))
        k = str(captions_per_image)
        vse = [
            sys.executable,
            "-m",
            "vsekit.cli",
            "eval-sims",
            str(path),
            "--captions-per-image",
            k,
            "--json",
        ]
        minimal = [sys.executable, "-c", MINIMAL_EVAL_SIMS, str(path), k]
        ours, theirs = json.loads(_run_process(vse)), json.loads(_run_process(minimal))  # untimed warm-up
        t_vse, t_min = [], []
        for _ in range(repeats):
            for cmd, times in ((vse, t_vse), (minimal, t_min)):
                t0 = time.perf_counter()
                _run_process(cmd)
                times.append(time.perf_counter() - t0)
    vse_s, min_s = statistics.median(t_vse), statistics.median(t_min)
    return {
        "images": n_images,
        "captions": n_images * captions_per_image,
        "repeats": repeats,
        "eval_sims_s": vse_s,
        "minimal_s": min_s,
        "ratio": vse_s / min_s,
        "eval_sims_min_s": min(t_vse),
        "minimal_min_s": min(t_min),
        "max_abs_diff": max(abs(ours[key] - theirs[key]) for key in theirs),
        "rsum": ours["rsum"],
    }
