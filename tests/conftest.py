import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit_lab.datasets.synthetic import make_synthetic_precomp


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A very small synthetic precomp set for CLI tests that train for seconds (copy it before changing it)."""
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("tiny"), n_train=48, n_dev=12, n_test=12, regions=4, dim=8
    )


@pytest.fixture(scope="session")
def synthetic_dir(tmp_path_factory):
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("syn"), n_train=240, n_dev=50, n_test=50, regions=10, dim=32, noise=0.8
    )


@pytest.fixture
def rng():
    return np.random.default_rng(0)


@pytest.fixture(scope="session")
def shapes_model(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset dir, run dir): the coloured-shapes set and a small model trained on its EfficientNet-Lite0
    features, built once per test run (both steps are idempotent) for the search tests."""
    pytest.importorskip("efficientnet_lite_pytorch")
    from vsekit_lab.datasets.shapes import make_shapes_dataset

    base = tmp_path_factory.getbasetemp() / "shapes"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: much faster than two on a shared 2-core machine
    try:
        data = make_shapes_dataset(base / "data")
        run = train_shapes_model(data, base / "run")
    finally:
        torch.set_num_threads(threads)
    return data, run


def train_shapes_model(data_dir: str | Path, run_dir: str | Path, epochs: int = 15, seed: int = 0) -> Path:
    """A small VSE++ model on the shapes set (seconds on a CPU). Idempotent: a finished run is reused."""
    from vsekit.config import load_recipe
    from vsekit.training.trainer import Trainer
    from vsekit_lab.datasets.shapes import SHAPES_RECIPE_OVERRIDES

    run = Path(run_dir)
    done = run / "shapes_done.json"
    if done.is_file():
        return run
    recipe = load_recipe("vsepp", SHAPES_RECIPE_OVERRIDES + [f"train.epochs={epochs}", f"train.seed={seed}"])
    result = Trainer(recipe, data_dir, run, overwrite=True, progress=False, log=lambda *_: None).fit()
    done.write_text(json.dumps({"best_rsum": result.get("best_rsum")}) + "\n", encoding="utf-8")
    return run


def interrupt_on_call(monkeypatch, module, name: str, n: int) -> dict:
    """Make `module.name` raise KeyboardInterrupt on its n-th call (a Ctrl-C mid-work); the other calls run
    the real function. Returns the call counter {"n": calls so far}."""
    real = getattr(module, name)
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == n:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, flaky)
    return calls


def reference_fixture_dir(name: str | None = None) -> Path:
    """Folder of the released-code parity fixtures (or one item's subfolder); skips the test when absent.

    `VSE_REFERENCE_FIXTURES` points at another set (e.g. the held-out one); default: the shared checkout's.
    """
    default = Path(__file__).resolve().parents[1].parent / "shared" / "fixtures" / "reference"
    root = Path(os.environ.get("VSE_REFERENCE_FIXTURES") or default)
    path = root / name if name else root
    if not path.is_dir():
        pytest.skip(f"reference fixtures not found at {path} (set VSE_REFERENCE_FIXTURES)")
    return path


class StepClock:
    """A stand-in for a benchmark module's `time.perf_counter`: its calls come in (start, stop) pairs and pair i
    measures exactly `durations[i]` seconds, so what a benchmark derives from its timings (medians, ratios,
    samples/s) can be checked against values computed by hand. `install` swaps the module's `time` for it."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = list(durations)
        self.calls = 0
        self.now = 100.0

    def perf_counter(self) -> float:
        self.now += self.durations[self.calls // 2] if self.calls % 2 else 1.0
        self.calls += 1
        return self.now

    def install(self, monkeypatch, module) -> "StepClock":
        import types

        monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=self.perf_counter))
        return self


def spy_search_ids(monkeypatch) -> list[np.ndarray]:
    """The ids every index returned in `vsekit_lab.bench.search` (one [queries, k] array per timed index), in order."""
    import vsekit_lab.bench.search as bench

    seen: list[np.ndarray] = []
    real = bench._time_single

    def spy(index, queries, k, *args, **kwargs):
        ms, ids = real(index, queries, k, *args, **kwargs)
        seen.append(np.array(ids))
        return ms, ids

    monkeypatch.setattr(bench, "_time_single", spy)
    return seen


def brute_force_topk(queries: np.ndarray, db: np.ndarray, k: int) -> np.ndarray:
    """Exact top-k ids by inner product in float64 numpy (no FAISS): the ground truth for recall checks."""
    scores = np.asarray(queries, np.float64) @ np.asarray(db, np.float64).T
    return np.argsort(-scores, axis=1, kind="stable")[:, :k]


def assert_topk_well_separated(queries: np.ndarray, db: np.ndarray, k: int) -> None:
    """Precondition for comparing the top-k id *sets* of a float32 search with `brute_force_topk`'s exactly.

    A float32 inner product of two (stored float32) vectors of norm <= 1 in d dimensions is off by at most
    d·u (u = eps/2, any summation order, with or without FMA; Higham's γ_d bound), and a renormalisation of the
    rows adds a few u. So when every query's k-th and (k+1)-th exact scores are more than (d + 4)·eps apart,
    every float32 search (FAISS flat or IVF with every list visited, BLAS or SIMD, any CPU) returns the same
    k ids, and equal sets / recall 1.0 hold by construction. Fails (naming the gap) when the data has a near-tie.
    """
    scores = np.sort(np.asarray(queries, np.float64) @ np.asarray(db, np.float64).T, axis=1)[:, ::-1]
    gap = float((scores[:, k - 1] - scores[:, k]).min())
    bound = (db.shape[1] + 4) * float(np.finfo(np.float32).eps)
    assert gap > bound, (
        f"top-{k} boundary gap {gap:.3g} <= float32 rounding bound {bound:.3g}: pick other data"
    )


def recall_vs(ids: np.ndarray, truth: np.ndarray) -> float:
    """Mean fraction of each query's true top-k found among its returned ids."""
    k = truth.shape[1]
    return float(np.mean([len(set(a.tolist()) & set(t.tolist())) / k for a, t in zip(ids, truth)]))


def constant_dataset(src, dst):
    """The tiny set with every region of every training image the same vector and every caption the same words
    (with caption augmentation off): whatever the model, its embeddings of a batch are one point, all
    similarities equal, and nothing can be learned."""
    shutil.copytree(src, dst)
    ims = np.load(dst / "train_ims.npy")
    np.save(dst / "train_ims.npy", np.broadcast_to(ims[:1, :1], ims.shape).copy())
    n = len((dst / "train_caps.txt").read_text().splitlines())
    (dst / "train_caps.txt").write_text("a red dog on the grass\n" * n)
    return dst
