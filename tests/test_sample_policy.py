"""Sample policies (`train.sample_policy`, vsekit.training.sample_policy): a policy registered here, in a few
lines, trains through `vse train`, resumes bit-exactly from an interruption in epoch 2, and computes the same
plan under torchrun as in one process; `uniform` (no plan) keeps the draw of every pair."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from vsekit import registry
from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.data.batch import Batch
from vsekit.distributed import DistContext
from vsekit.training.data_path import EpochBatches
from vsekit.training.sample_policy import EpochPlan, PairScores, PolicyRunner
from vsekit.training.trainer import Trainer
from vsekit.utils.runtime import derived_seed

POLICY = "drop_hardest_half"
SETS = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "train.batch_size=32",
    "train.log_every=0",
    "train.epochs=2",
    f"train.sample_policy.name={POLICY}",
]


class DropHardestHalf:
    """From epoch 2 on: train on the half of the pairs with the lowest current loss (1 - the pair's score)."""

    def __init__(self) -> None:
        self.plans = 0

    def wants_scores(self, epoch: int) -> bool:
        return epoch >= 1

    def plan(self, epoch: int, n_pairs: int, scores: PairScores | None) -> EpochPlan | None:
        if scores is None:
            return None
        self.plans += 1
        loss = 1.0 - scores.positive
        return EpochPlan(indices=np.sort(np.argsort(loss, kind="stable")[: n_pairs // 2]))

    def state_dict(self) -> dict:
        return {"plans": self.plans}

    def load_state_dict(self, state: dict) -> None:
        self.plans = int(state.get("plans", 0))


def register_policy() -> None:
    """Register the test's policy (also called by the torchrun workers' launcher)."""
    if POLICY not in registry.names("sample_policy"):
        registry.register(
            "sample_policy", POLICY, build=lambda cfg: DropHardestHalf(), help="drop the hardest half"
        )


@pytest.fixture
def policy():
    register_policy()
    yield
    registry.unregister("sample_policy", POLICY)


def _state(run: Path) -> dict:
    return json.loads((run / "last_state.json").read_text(encoding="utf-8"))


def _records(run: Path, kind: str) -> list[dict]:
    lines = (run / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _plan_sha(run: Path) -> str:
    """The saved plan's digest, recomputed here with hashlib from the checkpoint's own arrays."""
    t = load_file(run / "last_optim.safetensors")
    idx = t["__sample_policy__.indices"].numpy().astype(np.int64)
    h = hashlib.sha256(f"indices:{idx.dtype.str}:{idx.shape};".encode())
    h.update(idx.tobytes())
    return h.hexdigest()


def test_uniform_plan_none_is_todays_permutation():
    """`uniform` (plan None) draws torch.randperm of every pair from (seed, epoch), the draw of a run without a plan;
    a plan of pairs is the only input of the draw: its batches hold exactly the planned pairs."""
    s = EpochBatches(100, 10, seed=7)
    s.epoch = 3
    g = torch.Generator().manual_seed(derived_seed(7, 3, 0xDA7A))
    perm = torch.randperm(100, generator=g).tolist()
    assert s.batches() == [perm[i : i + 10] for i in range(0, 100, 10)]
    s.plan = np.arange(100, dtype=np.int64)
    assert s.batches() == [perm[i : i + 10] for i in range(0, 100, 10)]  # the identity plan: the same draw
    s.plan = np.arange(0, 100, 2, dtype=np.int64)
    got = sum(s.batches(), [])
    assert sorted(got) == list(range(0, 100, 2)) and len(s) == 5


def test_uniform_is_the_default_and_names_no_plan():
    r = load_recipe("vse_infty", [])
    assert r.train.sample_policy.name == "uniform"
    assert registry.get("sample_policy", "uniform").build(r.train.sample_policy) is None


class HalfWeightOdd:
    """Every pair, odd captions at weight 0.5 (no scores needed)."""

    def wants_scores(self, epoch: int) -> bool:
        return False

    def plan(self, epoch: int, n_pairs: int, scores: PairScores | None) -> EpochPlan:
        return EpochPlan(weights=np.where(np.arange(n_pairs) % 2 == 1, 0.5, 1.0).astype(np.float32))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        return None


def test_plan_weights_fill_batch_weights_and_keep_the_draw():
    """A plan of weights only: `Batch.weights` is the plan's weight of each batch caption (0.5 for odd ids, by
    hand), and the sampler keeps the draw of every pair."""
    registry.register("sample_policy", "half_odd", build=lambda cfg: HalfWeightOdd(), help="odd pairs at 0.5")
    try:
        r = load_recipe("vsepp", ["train.sample_policy.name=half_odd"])
        split = SimpleNamespace(cap2img=np.repeat(np.arange(4), 5))
        runner = PolicyRunner(r, None, split, None, torch.device("cpu"), DistContext())
        sampler = EpochBatches(20, 5, seed=1)
        uniform = sampler.batches()
        runner.epoch_start(sampler, 0)
        assert sampler.plan is None and sampler.batches() == uniform
        caps = torch.tensor([3, 4, 7, 10])
        batch = Batch(
            images=torch.zeros(4, 2, 3),
            image_lengths=torch.full((4,), 2),
            tokens=torch.ones(4, 3, dtype=torch.long),
            token_lengths=torch.full((4,), 3),
            image_index=caps // 5,
            caption_index=caps,
        )
        assert runner.weigh(batch).weights.tolist() == [0.5, 1.0, 0.5, 1.0]
    finally:
        registry.unregister("sample_policy", "half_odd")


@pytest.mark.slow
def test_policy_trains_through_vse_train_and_resumes_bit_exact(tiny_data, tmp_path, policy, capsys):
    """A registered policy trains through `vse train`: epoch 2 trains on half the pairs; a run interrupted in
    epoch 2 resumes (`vse train --resume`) to bit-identical weights and dev metrics."""
    args = ["--data", str(tiny_data), "--recipe", "vsepp", "--no-progress", "--device", "cpu"]
    for s in SETS:
        args += ["--set", s]
    assert main(["train", "--out", str(tmp_path / "a"), *args]) == 0, capsys.readouterr().err
    epochs = _records(tmp_path / "a", "epoch")
    n_pairs = 48 * 5
    assert [e["samples"] for e in epochs] == [n_pairs, n_pairs // 2]
    saved = _state(tmp_path / "a")["sample_policy"]
    assert saved["epoch"] == 1 and saved["state"] == {"plans": 1}
    assert saved["digest"] == _plan_sha(tmp_path / "a")
    assert (
        len(load_file(tmp_path / "a" / "last_optim.safetensors")["__sample_policy__.indices"]) == n_pairs // 2
    )

    r = load_recipe("vsepp", SETS + ["train.device=cpu"])
    steps_epoch1 = -(-n_pairs // 32)
    quiet = {"progress": False, "log": lambda *_: None}
    Trainer(r, tiny_data, tmp_path / "b", **quiet).fit(max_steps=steps_epoch1 + 2)  # 2 steps into epoch 2
    assert _state(tmp_path / "b")["train_state"]["step_in_epoch"] == 2
    assert main(["train", "--resume", str(tmp_path / "b"), "--no-progress"]) == 0, capsys.readouterr().err
    a, b = load_file(tmp_path / "a" / "last.safetensors"), load_file(tmp_path / "b" / "last.safetensors")
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] == b[k]).all(), k
    assert [v["rsum"] for v in _records(tmp_path / "a", "val")] == [
        v["rsum"] for v in _records(tmp_path / "b", "val")
    ]
    assert _state(tmp_path / "b")["sample_policy"]["digest"] == saved["digest"]


@pytest.mark.slow
def test_tampered_plan_is_refused_on_resume(tiny_data, tmp_path, policy, capsys):
    """The plan read back on resume must match its saved digest: else one line, exit 2, nothing changed."""
    r = load_recipe("vsepp", SETS + ["train.device=cpu"])
    Trainer(r, tiny_data, tmp_path / "b", progress=False, log=lambda *_: None).fit(max_steps=8 + 1)
    run = tmp_path / "b"
    manifest = json.loads((run / "last.manifest.json").read_text(encoding="utf-8"))
    entry = manifest["files"]["_state.json"]  # the committed set pins each file's sha256: re-pin the edit
    state_path = run / entry["path"]
    state = json.loads(state_path.read_text(encoding="utf-8"))
    state["sample_policy"]["digest"] = "0" * 64
    data = json.dumps(state).encode("utf-8")
    for path in {state_path, run / "last_state.json"}:  # the set's file and its `last_state.json` link
        path.unlink()
        path.write_bytes(data)
    entry.update(bytes=len(data), sha256=hashlib.sha256(data).hexdigest())
    (run / "last.manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    before = (tmp_path / "b" / "last.safetensors").read_bytes()
    assert main(["train", "--resume", str(tmp_path / "b"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert any("digest" in line for line in err), err
    assert (tmp_path / "b" / "last.safetensors").read_bytes() == before


LAUNCHER = """
import sys
sys.path.insert(0, {tests!r})
from test_sample_policy import register_policy
register_policy()
from vsekit.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_policy_under_torchrun_has_the_plan_of_one_process(tiny_data, tmp_path, policy):
    """`torchrun --nproc_per_node 2`: the scores are gathered across ranks, both ranks agree on the plan (the
    runner compares digests), and it is the plan one process computes (same digest, same samples)."""
    launcher = tmp_path / "launch.py"
    launcher.write_text(LAUNCHER.format(tests=str(Path(__file__).parent)), encoding="utf-8")
    sets = [*SETS, "loss.warmup_epochs=0"]
    args = ["--data", str(tiny_data), "--recipe", "vsepp", "--no-progress", "--device", "cpu"]
    for s in sets:
        args += ["--set", s]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(launcher)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "train", "--out", str(tmp_path / "ddp"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = load_recipe("vsepp", sets + ["train.device=cpu"])
    Trainer(r, tiny_data, tmp_path / "one", progress=False, log=lambda *_: None).fit()
    ddp, one = _state(tmp_path / "ddp")["sample_policy"], _state(tmp_path / "one")["sample_policy"]
    assert ddp["epoch"] == one["epoch"] == 1
    assert ddp["digest"] == _plan_sha(tmp_path / "ddp")
    assert ddp["digest"] == one["digest"]
    assert [e["samples"] for e in _records(tmp_path / "ddp", "epoch")] == [
        e["samples"] for e in _records(tmp_path / "one", "epoch")
    ]
