import json

import numpy as np
import pytest
from safetensors.torch import load_file

from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.runs import CheckpointError, load_run
from vsekit.training.trainer import Trainer, lr_at_epoch

SMALL = ["model.embed_dim=64", "model.text.word_dim=32", "train.batch_size=32", "train.log_every=0"]


def test_lr_schedule_decays_once():
    assert lr_at_epoch(5e-4, 14, [15], 0.1) == 5e-4
    assert lr_at_epoch(5e-4, 15, [15], 0.1) == pytest.approx(5e-5)
    assert lr_at_epoch(5e-4, 24, [15], 0.1) == pytest.approx(5e-5)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["vse_infty", "vsepp"])
def test_end_to_end_far_above_chance(synthetic_dir, tmp_path, recipe):
    r = load_recipe(recipe, SMALL + ["train.epochs=4"])
    result = Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None).fit()
    assert result["best_rsum"] > 0
    rc = main(["eval", str(tmp_path / "run"), "--split", "test", "--json", str(tmp_path / "m.json")])
    assert rc == 0
    m = json.loads((tmp_path / "m.json").read_text())
    chance = 100 / 50
    assert m["t2i_r1"] > 10 * chance and m["i2t_r1"] > 10 * chance


@pytest.mark.slow
def test_resume_is_bit_exact(synthetic_dir, tmp_path):
    r = load_recipe("vse_infty", SMALL + ["train.epochs=2"])
    quiet = {"progress": False, "log": lambda *_: None}
    Trainer(r, synthetic_dir, tmp_path / "a", **quiet).fit()
    t = Trainer(r, synthetic_dir, tmp_path / "b", **quiet)
    t.fit(max_steps=5)  # stops mid-epoch 0 with a checkpoint
    Trainer(r, synthetic_dir, tmp_path / "b", resume=True, **quiet).fit()
    a, b = load_file(tmp_path / "a" / "last.safetensors"), load_file(tmp_path / "b" / "last.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # bit-identical by construction: same process and threads, same batch shapes, restored state
        assert (a[k] == b[k]).all(), k
    ha = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if '"val"' in x]
    hb = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines() if '"val"' in x]
    assert [h["rsum"] for h in ha] == [h["rsum"] for h in hb]


@pytest.mark.slow
def test_run_dir_not_overwritten_and_strict_loading(synthetic_dir, tmp_path):
    r = load_recipe("vsepp", SMALL + ["train.epochs=1"])
    Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None).fit()
    with pytest.raises(CheckpointError, match="already holds a run"):
        Trainer(r, synthetic_dir, tmp_path / "run", progress=False)
    model, _ = load_run(tmp_path / "run")
    assert model.recipe.model.image.pooling.name == "avg"
    best = tmp_path / "run" / "best.safetensors"
    best.write_bytes(best.read_bytes()[:100])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_run(tmp_path / "run")


def test_cli_eval_sims_and_clear_errors(tmp_path, capsys):
    n = 20
    sims = np.random.default_rng(0).normal(size=(n, 5 * n)).astype(np.float32)
    sims[np.arange(n)[:, None], 5 * np.arange(n)[:, None] + np.arange(5)] += 50
    np.save(tmp_path / "s.npy", sims)
    assert main(["eval-sims", str(tmp_path / "s.npy"), "--json", str(tmp_path / "o.json")]) == 0
    m = json.loads((tmp_path / "o.json").read_text())
    assert m["rsum"] == 600.0 and set(m) >= {"i2t_r1", "t2i_meanr", "rsum"}
    np.save(tmp_path / "bad.npy", sims[:, :-1])
    assert main(["eval-sims", str(tmp_path / "bad.npy")]) == 2
    assert "do not fit" in capsys.readouterr().err
    assert main(["eval-sims", str(tmp_path / "missing.npy")]) == 2
    (tmp_path / "c2i.txt").write_text("0\nx\n")
    assert main(["eval-sims", str(tmp_path / "s.npy"), "--cap2img", str(tmp_path / "c2i.txt")]) == 2
    assert "c2i.txt:2" in capsys.readouterr().err


@pytest.mark.slow  # trains 2 short epochs per mode
@pytest.mark.parametrize("mode", ["loss", "lr", "none"])
def test_backbone_warmup_ramps_the_loss_or_the_lr(synthetic_dir, tmp_path, monkeypatch, mode):
    """The first unfrozen backbone epoch: `loss` scales the loss by (step + 1) / N at the lr of the epoch (the
    released VSE∞ code), `lr` ramps the lr the same way with the loss unscaled (the paper), `none` neither.
    The backbone phase is forced here so that a precomp set stands in for pictures."""
    seen: list[tuple[bool, float]] = []
    monkeypatch.setattr(Trainer, "_backbone_phase", lambda self, epoch: epoch == 0)
    original = Trainer.train_step

    def spy(self, batch, epoch, step, steps_in_epoch, loss_warmup, sizes=None):
        out = original(self, batch, epoch, step, steps_in_epoch, loss_warmup, sizes)
        seen.append((loss_warmup, self.optimizer.param_groups[0]["lr"], step, steps_in_epoch))
        return out

    monkeypatch.setattr(Trainer, "train_step", spy)
    r = load_recipe(
        "vsepp",
        SMALL
        + [
            "train.epochs=2",
            "data.train_fraction=0.2",
            "train.batch_size=64",
            f"model.image.backbone_warmup={mode}",
        ],
    )
    Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=lambda *_: None).fit()
    n = seen[0][3]
    first = seen[:n]
    assert len(seen) == 2 * n and n > 2 and [s[2] for s in first] == list(range(n))
    for flag, lr, step, _ in first:
        assert flag == (mode == "loss")
        assert lr == pytest.approx(5e-4 * (step + 1) / n if mode == "lr" else 5e-4)
    assert all(not flag and lr == pytest.approx(5e-4) for flag, lr, _, _ in seen[n:])  # epoch 2: plain
    with pytest.raises(ValueError, match="backbone_warmup"):
        load_recipe("vsepp", ["model.image.backbone_warmup=cosine"])
