"""Trainer callbacks (vsekit.training.callbacks): a user callback sees each hook, in order, with the values the
run's own records give; and the trainer's size limits (Trainer under 500 lines, no function of
training/ over 80)."""

import ast
import json
from pathlib import Path

import pytest

import vsekit.training as training_pkg
from vsekit.config import load_recipe
from vsekit.training.callbacks import Callback
from vsekit.training.trainer import Trainer

SMALL = ["model.embed_dim=32", "model.text.word_dim=16", "train.batch_size=32", "train.log_every=0"]
QUIET = {"progress": False, "log": lambda *_: None}
TRAINING = Path(training_pkg.__file__).parent


class Recorder(Callback):
    """Writes down every hook with the values it is handed (and what the run folder holds at that point)."""

    def __init__(self) -> None:
        self.events: list[tuple] = []
        self.records: list[dict] = []

    def on_fit_start(self, trainer):
        self.events.append(("fit_start",))

    def on_epoch_start(self, trainer, epoch):
        self.events.append(("epoch_start", epoch, trainer.state.step_in_epoch))

    def on_step_end(self, trainer, s):
        self.events.append(("step_end", s.epoch, s.step, s.global_step, trainer.state.global_step))

    def on_record(self, trainer, record):
        self.records.append(dict(record))

    def on_validation_end(self, trainer, epoch, metrics, improved):
        best = (trainer.run_dir / "best.json").is_file()
        self.events.append(("validation_end", epoch, metrics["rsum"], improved, trainer.state.epoch, best))

    def on_fit_end(self, trainer, failed):
        self.events.append(("fit_end", failed))


def _lines(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_c1_user_callback_sees_each_hook_in_order(tiny_data, tmp_path):
    """C1: `Trainer(callbacks=[...])`: fit_start, then per epoch epoch_start, one step_end per step (epoch, step
    in epoch and global step counted as the epoch/val records count them), validation_end after the built-in
    checkpointing (best.json written), fit_end last; on_record sees exactly the metrics.jsonl lines."""
    rec = Recorder()
    r = load_recipe("vsepp", SMALL + ["train.epochs=2"])
    Trainer(r, tiny_data, tmp_path / "run", callbacks=[rec], **QUIET).fit()
    lines = _lines(tmp_path / "run")
    assert rec.records == lines
    epochs = [x for x in lines if x["kind"] == "epoch"]
    vals = [x for x in lines if x["kind"] == "val"]
    n_pairs = 48 * 5  # tiny_data: 48 training images, 5 captions each
    steps = -(-n_pairs // 32)  # batches of 32, the last one short
    assert [e["samples"] for e in epochs] == [n_pairs, n_pairs]
    assert [e["step"] for e in epochs] == [steps, 2 * steps]
    expected: list[tuple] = [("fit_start",)]
    best = -1.0
    for epoch in range(2):
        expected.append(("epoch_start", epoch, 0))
        for i in range(steps):
            g = epoch * steps + i + 1
            expected.append(("step_end", epoch, i, g, g))
        rsum = vals[epoch]["rsum"]
        expected.append(("validation_end", epoch, rsum, rsum > best, epoch + 1, True))
        best = max(best, rsum)
    expected.append(("fit_end", False))
    assert rec.events == expected


def test_c2_resumed_run_starts_its_epoch_after_the_saved_step(tiny_data, tmp_path):
    """C2: a run stopped after 3 steps and resumed: the resumed fit's epoch_start names epoch 0 with 3 steps
    done, and its first step_end is step 3 of the epoch, global step 4."""
    r = load_recipe("vsepp", SMALL + ["train.epochs=1"])
    first = Recorder()
    Trainer(r, tiny_data, tmp_path / "run", callbacks=[first], **QUIET).fit(max_steps=3)
    assert first.events[-2:] == [("step_end", 0, 2, 3, 3), ("fit_end", False)]
    again = Recorder()
    Trainer(r, tiny_data, tmp_path / "run", resume=True, callbacks=[again], **QUIET).fit()
    assert again.events[:3] == [("fit_start",), ("epoch_start", 0, 3), ("step_end", 0, 3, 4, 4)]


def test_c3_fit_end_says_failed_when_a_hook_raises(tiny_data, tmp_path):
    """C3: an exception inside training still reaches on_fit_end, with failed=True (how W&B closes a run)."""

    class Boom(Recorder):
        def on_step_end(self, trainer, s):
            super().on_step_end(trainer, s)
            if s.global_step == 2:
                raise RuntimeError("boom")

    rec = Boom()
    r = load_recipe("vsepp", SMALL + ["train.epochs=1"])
    t = Trainer(r, tiny_data, tmp_path / "run", callbacks=[rec], **QUIET)
    with pytest.raises(RuntimeError, match="boom"):
        t.fit()
    assert rec.events[-1] == ("fit_end", True)
    assert [e[3] for e in rec.events if e[0] == "step_end"] == [1, 2]


def _functions(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield node.name, node.end_lineno - node.lineno + 1


def test_c4_trainer_module_under_500_lines():
    """C4: the trainer stays small: what is not the loop lives in callbacks, checkpointing, run_dir…"""
    n = len((TRAINING / "trainer.py").read_text(encoding="utf-8").splitlines())
    assert n < 500, n


# modules whose functions are over the limit on this tree (strict xfail: the mark must go once they are split)
OVER_LIMIT_ELSEWHERE: set[str] = set()


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            p.name,
            marks=pytest.mark.xfail(strict=True, reason="GradCache.__call__ not split yet")
            if p.name in OVER_LIMIT_ELSEWHERE
            else (),
        )
        for p in sorted(TRAINING.glob("*.py"))
    ],
)
def test_c5_no_function_in_training_over_80_lines(name):
    """C5: every function and method of vsekit/training/ is at most 80 lines (def line to last line)."""
    long = [(f, n) for f, n in _functions(TRAINING / name) if n > 80]
    assert not long, long


def test_c5_the_size_check_sees_a_long_function(tmp_path):
    """C5: the AST measure itself counts a 90-line function as 90 lines (so the check above can fail)."""
    src = tmp_path / "m.py"
    src.write_text("def f():\n" + "    x = 1\n" * 88 + "    return x\n")
    assert list(_functions(src)) == [("f", 90)]
