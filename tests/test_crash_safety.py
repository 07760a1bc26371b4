"""Crash safety: a run killed at any moment resumes to the result of an uninterrupted run; a corrupt
checkpoint or index file is refused with a clear error and the other files stay good."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vsekit.runs as ckpt_mod
from vsekit.config import load_recipe
from vsekit.runs import CheckpointError, load_run, read_checkpoint_set
from vsekit.training.trainer import Trainer
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

TINY = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "train.batch_size=16",
    "train.log_every=1",
    "train.checkpoint_every=4",
    "optim.lr_decay_epochs=[1]",
]
SET = (".safetensors", "_optim.safetensors", "_state.json")
QUIET = {"progress": False, "log": lambda *_: None}


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)  # tiny models: a second thread only adds spin-waiting on a shared CPU


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("tiny"), n_train=48, n_dev=12, n_test=12, regions=4, dim=8
    )


def _vse(*args: str) -> list[str]:
    return [sys.executable, "-c", "import sys; from vsekit.cli import main; sys.exit(main())", *args]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


def _val_records(run: Path) -> list[dict]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "train_time_s"} for r in recs if r["kind"] == "val"]


def _train_records(run: Path) -> list[tuple]:
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in recs if r["kind"] == "train"]


def _same_weights(a: Path, b: Path) -> None:
    # Bit-identity by construction: both runs are the same sequence of ops on tensors of the same shapes, with
    # the same thread count (one), seeds and restored optimizer/RNG state, in processes that pick the same CPU
    # kernels (same machine, same ATEN_CPU_CAPABILITY): CPU kernels are deterministic for a fixed shape and
    # thread count, so no rounding can differ. (Runs with other batch shapes or thread counts would not be.)
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


@pytest.mark.slow
def test_sigkill_mid_epoch_then_resume_matches_uninterrupted_run(tiny_data, tmp_path):
    common = ["--recipe", "vsepp", "--data", str(tiny_data), "--epochs", "2", "--no-progress"]
    common += [x for s in TINY for x in ("--set", s)]
    ref = subprocess.run(
        _vse("train", "--out", str(tmp_path / "ref"), *common), env=_env(), capture_output=True, text=True
    )
    assert ref.returncode == 0, ref.stderr
    run = tmp_path / "killed"
    proc = subprocess.Popen(
        _vse("train", "--out", str(run), *common),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    manifest = run / "last.manifest.json"
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:  # wait for a checkpoint inside epoch 1 (0-based)
        try:
            m = json.loads(manifest.read_text())
            if m["epoch"] == 1 and m["step_in_epoch"] >= 8:
                break
        except (OSError, ValueError, KeyError):
            pass
        time.sleep(0.01)
    assert proc.poll() is None, "training finished before it could be killed"
    proc.send_signal(signal.SIGKILL)  # no handler, no cleanup: whatever was being written stays half-written
    proc.wait()
    killed_at = json.loads(manifest.read_text())
    assert killed_at["epoch"] == 1 and 0 < killed_at["step_in_epoch"]
    res = subprocess.run(
        _vse("train", "--resume", str(run), "--no-progress"), env=_env(), capture_output=True, text=True
    )
    assert res.returncode == 0, res.stderr
    assert "resumed" in res.stdout + res.stderr
    _same_weights(tmp_path / "ref" / "last.safetensors", run / "last.safetensors")
    _same_weights(tmp_path / "ref" / "best.safetensors", run / "best.safetensors")
    assert _val_records(run) == _val_records(tmp_path / "ref")  # identical dev metrics, no duplicated lines
    assert _train_records(run) == _train_records(
        tmp_path / "ref"
    )  # lines after the checkpoint were replayed once
    assert json.loads((run / "best.json").read_text()) == json.loads(
        (tmp_path / "ref" / "best.json").read_text()
    )
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == sorted(
        p.name for p in (tmp_path / "ref" / "ckpt").iterdir()
    )


class _Killed(BaseException):
    """Stands in for SIGKILL inside the process: nothing after it runs, no cleanup of the write."""


def _killing_writes(monkeypatch, kill_at: int, events: list[str]) -> None:
    """Make the n-th write/link of a checkpoint set die; a file write dies after half of its temp file."""
    real_write, real_json, real_publish = (
        ckpt_mod.atomic_write_bytes,
        ckpt_mod.atomic_write_json,
        ckpt_mod._publish,
    )

    def step(kind: str) -> None:
        events.append(kind)
        if len(events) == kill_at:
            raise _Killed(kind)

    def write(path, data):
        if len(events) + 1 == kill_at:  # a half-written temp file, as a kill during write() leaves it
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            (Path(path).parent / f".{Path(path).name}.dead.tmp").write_bytes(data[: len(data) // 2])
        step(f"write {Path(path).name}")
        real_write(path, data)

    def write_json(path, obj):
        step(f"manifest {Path(path).name}")
        real_json(path, obj)

    def publish(run_dir, versioned, name):
        step(f"link {name}")
        real_publish(run_dir, versioned, name)

    monkeypatch.setattr(ckpt_mod, "atomic_write_bytes", write)
    monkeypatch.setattr(ckpt_mod, "atomic_write_json", write_json)
    monkeypatch.setattr(ckpt_mod, "_publish", publish)


def test_kill_at_every_point_of_a_set_write_leaves_old_or_new_set_complete(tmp_path, monkeypatch):
    base = tmp_path / "base"
    old = {".a": b"old weights" * 50, ".b": b"old state" * 50}
    new = {".a": b"new weights" * 70, ".b": b"new state" * 70}
    ckpt_mod.write_checkpoint_set(base, "last", old, {"step": 1})
    n_points = 5  # two file writes, the manifest (commit point), two links
    for kill_at in range(1, n_points + 2):
        run = tmp_path / f"k{kill_at}"
        shutil.copytree(base, run)
        events: list[str] = []
        _killing_writes(monkeypatch, kill_at, events)
        if kill_at <= n_points:
            with pytest.raises(_Killed):
                ckpt_mod.write_checkpoint_set(run, "last", new, {"step": 2})
        else:
            ckpt_mod.write_checkpoint_set(run, "last", new, {"step": 2})
        monkeypatch.undo()
        assert len(events) == min(kill_at, n_points) and events[2:3] in ([], ["manifest last.manifest.json"])
        files = read_checkpoint_set(run, "last", (".a", ".b"))
        expect = old if kill_at <= 3 else new
        assert {s: p.read_bytes() for s, p in files.items()} == expect, kill_at
        assert (run / "last.a").read_bytes() == expect[".a"] and (run / "last.b").read_bytes() == expect[".b"]
    ckpt_mod.write_checkpoint_set(run, "last", old, {"step": 3})  # the next save clears dead temp files
    assert sorted(p.name for p in (run / "ckpt").iterdir()) == ["last-000002.a", "last-000002.b"]


def test_trainer_killed_while_saving_resumes_to_the_same_weights(tiny_data, tmp_path, monkeypatch):
    r = load_recipe("vsepp", TINY + ["train.epochs=1", "train.checkpoint_every=0", "train.log_every=0"])
    Trainer(r, tiny_data, tmp_path / "ref", **QUIET).fit()
    base = tmp_path / "base"
    Trainer(r, tiny_data, base, **QUIET).fit(max_steps=3)
    for kill_at, committed_step in ((3, 3), (5, 5)):  # while writing the state file / after the manifest
        run = tmp_path / f"k{kill_at}"
        shutil.copytree(base, run)
        t = Trainer(r, tiny_data, run, resume=True, **QUIET)
        events: list[str] = []
        _killing_writes(monkeypatch, kill_at, events)
        with pytest.raises(_Killed):
            t.fit(max_steps=2)  # the save at step 5 dies
        monkeypatch.undo()
        resumed = Trainer(r, tiny_data, run, resume=True, **QUIET)
        assert resumed.state.global_step == committed_step, events
        resumed.fit()
        _same_weights(tmp_path / "ref" / "last.safetensors", run / "last.safetensors")
        _same_weights(tmp_path / "ref" / "best.safetensors", run / "best.safetensors")


def test_corrupt_checkpoint_is_refused_and_best_copy_survives(tiny_data, tmp_path):
    r = load_recipe("vsepp", TINY + ["train.epochs=1"])
    run = tmp_path / "run"
    Trainer(r, tiny_data, run, **QUIET).fit()
    best_before = (run / "best.safetensors").read_bytes()
    committed = read_checkpoint_set(run, "last", SET)[".safetensors"]
    raw = bytearray(committed.read_bytes())
    raw[-5] ^= (
        0xFF  # one flipped bit inside a tensor: still parses as safetensors, so only the sha256 can tell
    )
    committed.write_bytes(bytes(raw))
    with pytest.raises(
        CheckpointError, match=r"last-\d+\.safetensors: size or sha256 differs from last\.manifest\.json"
    ):
        Trainer(r, tiny_data, run, resume=True, **QUIET)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_run(run, "last")
    model, _ = load_run(run, "best")  # the best-on-dev copy is intact and loads
    assert (run / "best.safetensors").read_bytes() == best_before
    (run / "last.manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="last.manifest.json: not a readable checkpoint manifest"):
        Trainer(r, tiny_data, run, resume=True, **QUIET)
    (run / "best.manifest.json").write_text(json.dumps({"format": "vsekit-checkpoint/99", "files": {}}))
    with pytest.raises(
        CheckpointError, match="format 'vsekit-checkpoint/99'; this vsekit reads vsekit-checkpoint/1"
    ):
        load_run(run, "best")


def test_kill_before_first_checkpoint_restarts_cleanly(tiny_data, tmp_path):
    r = load_recipe("vsepp", TINY + ["train.epochs=1", "train.checkpoint_every=0"])
    Trainer(r, tiny_data, tmp_path / "ref", **QUIET).fit()
    run = tmp_path / "run"
    t = Trainer(r, tiny_data, run, **QUIET)
    t.fit(max_steps=2)
    for name in ("last.manifest.json", "last.safetensors", "last_optim.safetensors", "last_state.json"):
        (run / name).unlink()  # as if killed before the first checkpoint was committed
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 3, "lo')  # a torn line
    Trainer(r, tiny_data, run, resume=True, **QUIET).fit()
    _same_weights(tmp_path / "ref" / "last.safetensors", run / "last.safetensors")
    assert _train_records(run) == _train_records(tmp_path / "ref")


@pytest.mark.slow
def test_corrupt_index_file_is_refused_and_good_copy_still_opens(tmp_path_factory, request):
    pytest.importorskip("faiss")
    from vsekit.search.index import IndexFormatError, SearchIndex, build_index

    data, run = request.getfixturevalue("shapes_model")  # after the faiss check: no training when it skips
    good = tmp_path_factory.mktemp("crash_idx") / "idx"
    build_index(run, f"{data}:test", good, progress=False, log=lambda *_: None)
    before = {p.relative_to(good): p.read_bytes() for p in good.rglob("*") if p.is_file()}
    meta = json.loads((good / "index.json").read_text())
    assert meta
    faiss_files = [p for p in good.rglob("*") if p.is_file() and p.suffix in (".faiss", ".index")]
    npy_files = [p for p in good.rglob("*.npy")]
    assert faiss_files and npy_files
    for victim, expect in (
        (faiss_files[0], "not a readable FAISS index"),
        (npy_files[0], "not a readable .npy array"),
    ):
        bad = good.parent / f"bad_{victim.name}"
        shutil.copytree(good, bad)
        target = bad / victim.relative_to(good)
        target.write_bytes(target.read_bytes()[: target.stat().st_size // 3])
        with pytest.raises(IndexFormatError, match=expect) as e:
            SearchIndex(bad)
        assert target.name in str(e.value)
    after = {p.relative_to(good): p.read_bytes() for p in good.rglob("*") if p.is_file()}
    assert after == before
    assert SearchIndex(good).n_pictures > 0
