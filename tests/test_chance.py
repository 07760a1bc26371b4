"""The chance level of rsum (vsekit.metrics.chance_rsum) and the chance alarm (train.chance_validations).

The level is checked by hand on maps small enough to enumerate, and against the protocol itself: the mean and
spread of `retrieval_metrics` over many random score matrices (Monte Carlo, tolerances from its standard
error)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from conftest import constant_dataset
from vsekit.config import load_recipe
from vsekit.metrics import cap2img_for_k, chance_rsum, retrieval_metrics
from vsekit.training.chance import MAX_RSUM, SIGMAS, ChanceAlarm
from vsekit.training.trainer import Trainer


def test_chance_rsum_by_hand():
    # 2 images, one caption each: R@1 is a coin flip in both directions, R@5 = R@10 = 100
    mean, std = chance_rsum(np.array([0, 1]))
    assert mean == pytest.approx(500.0)
    # per direction: R@1 = 100 x mean of 2 coin flips, std 100 x sqrt(0.25 / 2); the bound adds the two
    assert std == pytest.approx(2 * 100 * math.sqrt(0.125))
    # 3 images, captions [0, 0, 1, 2]: t2i R@1 = 1/3; i2t R@1: image 0 has 2 of the 4 columns (1 - 2/4),
    # images 1, 2 one each (1 - 3/4); every R@5 and R@10 is 100 (K >= 4 columns, K >= 3 images)
    mean, _ = chance_rsum(np.array([0, 0, 1, 2]))
    assert mean == pytest.approx(100 / 3 + 200 + 100 * (0.5 + 0.25 + 0.25) / 3 + 200)


def test_chance_rsum_is_what_random_scores_get():
    rng = np.random.default_rng(0)
    cap2img = np.repeat(np.arange(30), rng.integers(1, 6, 30))  # 1-5 captions per image
    mean, std = chance_rsum(cap2img)
    n = 3000
    rsums = np.array(
        [retrieval_metrics(rng.standard_normal((30, len(cap2img))), cap2img)["rsum"] for _ in range(n)]
    )
    sd = rsums.std(ddof=1)
    assert abs(rsums.mean() - mean) < 4 * sd / math.sqrt(n)
    # the bound assumes the two directions perfectly correlated: at least the true std (whose sample estimate
    # has a relative standard error of about 1 / sqrt(2n) = 1.3 %), at most sqrt(2) times it
    assert sd <= std * 1.05 and std <= math.sqrt(2) * sd * 1.05


def test_chance_rsum_refuses_a_map_that_does_not_fit():
    with pytest.raises(ValueError, match="does not fit"):
        chance_rsum(np.array([0, 3]), n_images=2)


def test_alarm_fires_once_after_the_streak():
    alarm = ChanceAlarm(cap2img_for_k(100, 500, 5), 100, patience=2)
    low, high = alarm.limit - 1, alarm.limit + 1
    assert alarm.enabled and alarm.limit == pytest.approx(alarm.mean + SIGMAS * alarm.std)
    assert alarm.update(1, low) is None and alarm.update(2, high) is None  # the streak breaks
    assert alarm.update(3, low) is None
    message = alarm.update(4, low)
    assert "no better than chance at epoch 4" in message and "loss.margin" in message
    assert alarm.update(5, low) is None  # once


def test_alarm_is_off_where_chance_cannot_be_told_apart():
    # 2 images, one caption each: 500 +- 70.7 (by hand above), so chance + 3 std passes the highest rsum
    alarm = ChanceAlarm(np.array([0, 1]), 2, patience=1)
    assert alarm.limit >= MAX_RSUM and not alarm.enabled and alarm.update(1, 0.0) is None


SMALL = ["model.embed_dim=16", "model.text.word_dim=8", "model.image.mlp_hidden=16", "train.batch_size=16"]


@pytest.mark.parametrize("patience", [2, 0])
def test_a_run_that_learns_nothing_is_named(tiny_data, tmp_path, patience):
    data = constant_dataset(tiny_data, tmp_path / "data")
    r = load_recipe(
        "vsepp",
        [*SMALL, "train.epochs=3", "data.text_augment_prob=0", f"train.chance_validations={patience}"],
    )
    messages = []
    Trainer(r, data, tmp_path / "run", progress=False, log=messages.append).fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warned = [m for m in messages if "no better than chance" in m]
    alarms = [rec for rec in records if rec["kind"] == "chance"]
    if patience == 0:
        assert warned == [] and alarms == []
        return
    vals = [rec["rsum"] for rec in records if rec["kind"] == "val"]
    mean, std = chance_rsum(cap2img_for_k(12, 60, 5))
    assert all(v < mean + SIGMAS * std for v in vals[:2])  # the precondition: the first two are at chance
    assert len(warned) == 1 and "at epoch 2" in warned[0]
    assert len(alarms) == 1 and alarms[0]["epoch"] == 2
    assert alarms[0]["chance_rsum"] == pytest.approx(mean) and alarms[0]["rsum"] == pytest.approx(vals[1])
