"""The collapse alarm (train.collapse_steps, train.stop_on_collapse; vsekit.training.collapse)."""

import json
import math

import pytest
import torch

from conftest import constant_dataset
from vsekit.cli import main
from vsekit.config import LossConfig, load_recipe
from vsekit.losses import create_loss
from vsekit.training import collapse as C
from vsekit.training.collapse import (
    CollapseMonitor,
    TrainingCollapsed,
    collapse_value,
    embedding_spread,
    negatives_per_row,
)
from vsekit.training.trainer import Trainer

SMALL = ["model.embed_dim=64", "model.text.word_dim=32", "train.batch_size=32"]


# ------------------------------------------------------------------------------------- collapse values
def test_collapse_values_by_hand():
    # batch of 4: captions 0 and 1 belong to the same image, 2 and 3 to others; margin 0.2, tau 0.05
    ids = torch.tensor([7, 7, 8, 9])
    n = negatives_per_row(ids, 4)
    assert n.tolist() == [2.0, 2.0, 3.0, 3.0]
    assert negatives_per_row(ids, 4, mask_same_image=False).tolist() == [3.0] * 4
    cfg = LossConfig(name="triplet", margin=0.2)
    # hardest: each of the 4 queries pays the margin once per direction: 2 * 4 * 0.2
    assert float(collapse_value(cfg, n, hardest=True)) == pytest.approx(1.6, abs=1e-12)
    # all negatives: 0.2 per negative pair and direction: 2 * 0.2 * (2 + 2 + 3 + 3)
    assert float(collapse_value(cfg, n, hardest=False)) == pytest.approx(4.0, abs=1e-12)
    # InfoNCE: log(1 + n_i) per query, mean over queries, two directions: log 3 + log 4
    assert float(collapse_value(LossConfig(name="infonce"), n)) == pytest.approx(2.484906649788, abs=1e-9)
    # ADOPT paper variant, K = 2: 2 * log(1 + 2)
    paper = LossConfig(name="adopt", adopt_variant="paper")
    assert float(collapse_value(paper, n, k=2.0)) == pytest.approx(2.197224577336, abs=1e-9)
    # ADOPT reference variant, K = 2, margin 0.2 on the negatives' logits / tau 0.05: log(1 + 2 e^4)
    ref = LossConfig(name="adopt", adopt_variant="reference", margin=0.2, temperature=0.05)
    assert float(collapse_value(ref, n, k=2.0)) == pytest.approx(4.702264, abs=1e-6)
    assert collapse_value(LossConfig(name="ladder"), n) is None  # depends on relevance: spread only
    # the rule of thumb, distinct images: 2 B m for B = 128, m = 0.2
    assert float(collapse_value(cfg, negatives_per_row(torch.arange(128), 128))) == pytest.approx(
        51.2, abs=1e-9
    )


@pytest.mark.parametrize("name", ["triplet", "triplet-all", "infonce", "adopt-paper", "adopt-reference"])
def test_collapse_values_are_what_the_losses_give_on_a_constant_matrix(name):
    """The loss modules themselves, on a batch whose similarities are all equal (any value), give the value."""
    ids = torch.tensor([0, 0, 1, 2, 3, 3, 3, 4])
    cfg = {
        "triplet": LossConfig(name="triplet"),
        "triplet-all": LossConfig(name="triplet", max_violation=False),
        "infonce": LossConfig(name="infonce"),
        "adopt-paper": LossConfig(name="adopt", adopt_variant="paper"),
        "adopt-reference": LossConfig(name="adopt", adopt_variant="reference"),
    }[name]
    loss_fn = create_loss(cfg)
    for s in (0.3, 0.9):
        sims = torch.full((8, 8), s, dtype=torch.float64)
        loss, diag = loss_fn(sims, image_ids=ids, warmup=False)
        value = collapse_value(cfg, negatives_per_row(ids, 8), hardest=True, k=diag.get("K_i2t"))
        # the triplet loss runs in float64 here, ADOPT/InfoNCE cast to float32: a few float32 roundings (~1e-7)
        assert float(value) == pytest.approx(float(loss), rel=1e-6)


def test_spread_by_hand():
    same = torch.ones(6, 5) * torch.tensor([1.0, 2.0, 0.0, 0.0, 3.0])
    assert float(embedding_spread(same)) == pytest.approx(0.0, abs=1e-6)  # one point (float32 normalisation)
    # 4 orthonormal rows: centroid (1/4, ..., 1/4), |centroid|^2 = 1/4, spread 3/4; scaling a row changes nothing
    eye = torch.eye(4) * torch.tensor([[1.0], [2.0], [0.5], [3.0]])
    assert float(embedding_spread(eye)) == pytest.approx(0.75, abs=1e-6)
    assert float(embedding_spread(eye, same[:, :4])) == pytest.approx(0.0, abs=1e-6)  # the smaller side


def test_monitor_counts_consecutive_steps_and_reports_once():
    mon = CollapseMonitor(LossConfig(name="triplet", margin=0.2), steps=3)
    ids = torch.arange(4)  # collapse value 2 * 4 * 0.2 = 1.6
    healthy, flat = torch.tensor(1.0), torch.tensor(1.605)  # 1.605 is within 1 % of 1.6, 1.0 is not
    step = 0
    for loss in (flat, flat, healthy, flat, flat):  # never 3 in a row
        step += 1
        mon.update({"loss": loss, "spread": torch.tensor(0.5)}, ids, 4, hardest=True, step=step)
    assert mon.poll() is None
    mon.update({"loss": flat, "spread": torch.tensor(0.5)}, ids, 4, hardest=True, step=step + 1)
    report = mon.poll()
    assert report is not None and report.step == step + 1 and report.by_loss and not report.by_spread
    assert report.collapse_value == pytest.approx(1.6, rel=1e-6) and "lower learning rate" in report.message()
    assert mon.poll() is None  # once
    # the spread criterion: below a tenth of the highest spread seen
    mon = CollapseMonitor(LossConfig(name="ladder"), steps=2)
    for i, spread in enumerate((0.3, 0.5, 0.049, 0.04)):
        mon.update(
            {"loss": torch.tensor(9.0), "spread": torch.tensor(spread)}, ids, 4, hardest=True, step=i + 1
        )
    report = mon.poll()
    assert report.step == 4 and report.by_spread and not report.by_loss and math.isnan(report.collapse_value)


# ------------------------------------------------------------------------------------------ real runs
def run_records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_fires_once_on_a_run_collapsed_by_a_huge_learning_rate(synthetic_dir, tmp_path):
    """Hardest negatives from the first step at lr 1: the embeddings fall to a point (dev rsum near chance)."""
    r = load_recipe(
        "vsepp",
        [
            *SMALL,
            "optim.lr=1.0",
            "loss.warmup_epochs=0",
            "train.epochs=2",
            "train.log_every=2",
            "train.collapse_steps=20",
        ],
    )
    messages = []
    Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=messages.append).fit()
    warned = [m for m in messages if "collapsed" in m]
    assert (
        len(warned) == 1 and "lower learning rate" in warned[0] and "warm-up with all negatives" in warned[0]
    )
    alarms = [rec for rec in run_records(tmp_path / "run") if rec["kind"] == "collapse"]
    assert len(alarms) == 1 and alarms[0]["by_spread"] and alarms[0]["step"] < 60
    top = max(rec["spread"] for rec in run_records(tmp_path / "run") if rec["kind"] == "train")
    assert alarms[0]["spread"] < 0.1 * top


def test_fires_on_constant_embeddings_at_the_collapse_value(tiny_data, tmp_path):
    data = constant_dataset(tiny_data, tmp_path / "data")
    r = load_recipe(
        "vsepp",
        [
            "model.embed_dim=16",
            "model.text.word_dim=8",
            "model.image.mlp_hidden=16",
            "train.batch_size=16",
            "train.epochs=1",
            "train.log_every=1",
            "loss.warmup_epochs=0",
            "data.text_augment_prob=0",
            "train.collapse_steps=5",
        ],
    )
    messages = []
    Trainer(r, data, tmp_path / "run", progress=False, log=messages.append).fit()
    alarms = [rec for rec in run_records(tmp_path / "run") if rec["kind"] == "collapse"]
    # read at every step (log_every=1): it fires at step 5 exactly, by both criteria
    assert len(alarms) == 1 and alarms[0]["step"] == 5 and alarms[0]["by_loss"] and alarms[0]["by_spread"]
    # 16 captions of 16 different images: 2 * 16 * 0.2 (float32 loss)
    assert alarms[0]["collapse_value"] == pytest.approx(6.4, rel=1e-6)
    assert alarms[0]["loss"] == pytest.approx(6.4, rel=1e-5)
    assert sum("collapsed at step 5" in m for m in messages) == 1


def test_stop_on_collapse_stops_cleanly_with_a_nonzero_exit(tiny_data, tmp_path, capsys):
    data = constant_dataset(tiny_data, tmp_path / "data")
    run = tmp_path / "run"
    code = main(
        [
            "train",
            "--recipe",
            "vsepp",
            "--data",
            str(data),
            "--out",
            str(run),
            "--no-progress",
            "--batch-size",
            "16",
            "--epochs",
            "3",
            "--set",
            "model.embed_dim=16",
            "--set",
            "model.text.word_dim=8",
            "--set",
            "loss.warmup_epochs=0",
            "--set",
            "train.log_every=4",
            "--set",
            "train.collapse_steps=6",
            "--set",
            "train.stop_on_collapse=true",
            "--set",
            "data.text_augment_prob=0",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2
    assert "collapsed at step 6" in err and "stop_on_collapse" in err and str(run) in err
    state = json.loads((run / "last_state.json").read_text())["train_state"]
    assert state["global_step"] == 8  # the first read after step 6 (log_every=4): stopped there, state saved
    assert state["epoch"] == 0  # before the end of the first epoch (15 steps)
    # the saved run resumes
    code = main(["train", "--resume", str(run), "--no-progress"])
    assert (
        code == 2
    )  # and, still collapsed, stops again after 6 more steps: the counters restart with the process
    assert "stop_on_collapse" in capsys.readouterr().err


def test_trainer_api_raises_training_collapsed(tiny_data, tmp_path):
    data = constant_dataset(tiny_data, tmp_path / "data")
    r = load_recipe(
        "vsepp",
        [
            "model.embed_dim=16",
            "model.text.word_dim=8",
            "train.batch_size=16",
            "train.epochs=1",
            "train.log_every=0",
            "loss.warmup_epochs=0",
            "train.collapse_steps=3",
            "data.text_augment_prob=0",
            "train.stop_on_collapse=true",
        ],
    )
    with pytest.raises(TrainingCollapsed, match="collapsed at step 3"):
        Trainer(r, data, tmp_path / "run", progress=False, log=lambda *_: None).fit()
    # log_every=0: read at the end of the epoch, where the state is saved (15 steps)
    assert json.loads((tmp_path / "run" / "last_state.json").read_text())["train_state"]["global_step"] == 15


# ---------------------------------------------------------------------------------- silent when healthy
@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["vsepp", "vse_infty"])
def test_silent_on_demo_like_runs(synthetic_dir, tmp_path, recipe, monkeypatch):
    """The demo's recipes (warm-up epoch, then hardest negatives) learn this set (dev rsum far above chance)
    without the alarm, even at 10 steps (of 76) instead of the default 200; the longest run of steps that
    met either criterion is 2 (measured), so 10 is not a near miss."""
    runs = []
    real_update = C.CollapseMonitor.update

    def spy(self, *args, **kwargs):
        real_update(self, *args, **kwargs)
        runs.append(int(self._run))

    monkeypatch.setattr(C.CollapseMonitor, "update", spy)
    r = load_recipe(recipe, [*SMALL, "train.epochs=2", "train.log_every=0", "train.collapse_steps=10"])
    messages = []
    result = Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=messages.append).fit()
    assert not [m for m in messages if "collapse" in m]
    assert not [rec for rec in run_records(tmp_path / "run") if rec["kind"] == "collapse"]
    assert len(runs) == 76 and max(runs) <= 5
    assert result["best_rsum"] > 300  # it learned (chance: ~62)


@pytest.mark.slow
def test_silent_on_the_shapes_demo_run(shapes_model, tmp_path, monkeypatch):
    """The shapes recipe the search tests train (conftest.train_shapes_model), with the alarm at 10 steps."""
    from vsekit_lab.datasets.shapes import SHAPES_RECIPE_OVERRIDES

    data, _ = shapes_model
    runs = []
    real_update = C.CollapseMonitor.update

    def spy(self, *args, **kwargs):
        real_update(self, *args, **kwargs)
        runs.append(int(self._run))

    monkeypatch.setattr(C.CollapseMonitor, "update", spy)
    r = load_recipe("vsepp", [*SHAPES_RECIPE_OVERRIDES, "train.epochs=15", "train.collapse_steps=10"])
    messages = []
    Trainer(r, data, tmp_path / "run", progress=False, log=messages.append).fit()
    assert not [m for m in messages if "collapse" in m]
    assert len(runs) >= 60 and max(runs) <= 3
