# Float comparisons: profiles are float64 statistics of float32 softmax weights: 1/49 rounded once (rel 1e-6
# holds with 8 eps to spare) and <= 12 weights summing to 1 within (12 + 1) eps.
import json

import pytest
import torch

from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.pooling.gpo import GPO
from vsekit.pooling.inspect import PoolingProfile, gpo_profiles
from vsekit.training.trainer import Trainer


class Two(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image_encoder = torch.nn.Module()
        self.image_encoder.pool = GPO()
        self.text_encoder = torch.nn.Module()
        self.text_encoder.pool = GPO()


def test_zero_scorer_is_average_pooling_and_a_peaked_one_is_not():
    torch.manual_seed(0)
    m = Two()
    torch.nn.init.zeros_(m.image_encoder.pool.linear.weight)  # every position scores 0 -> softmax is uniform
    m.text_encoder.pool.linear.weight.data.normal_(0, 5.0)
    m.train()
    image, text = gpo_profiles(m, {"image": 49, "text": 12})
    assert (image.encoder, image.length, text.encoder, text.length) == (
        "image_encoder",
        49,
        "text_encoder",
        12,
    )
    assert image.effective_positions == pytest.approx(49.0)
    assert image.distance_from_average == pytest.approx(0.0, abs=1e-6)
    assert sum(text.weights) == pytest.approx(1.0, abs=13 * float(torch.finfo(torch.float32).eps))
    assert text.effective_positions < 11.0 and text.distance_from_average > 0.05
    assert m.training and m.text_encoder.pool.training  # inspection leaves the train/eval mode as it was


def test_profile_numbers_for_max_pooling_and_missing_sizes():
    one_hot = PoolingProfile("x", 4, [1.0, 0.0, 0.0, 0.0])
    assert one_hot.effective_positions == pytest.approx(1.0)
    assert one_hot.distance_from_average == pytest.approx(0.75)
    with pytest.raises(ValueError, match="no set size given for the GPO in 'text_encoder.pool'"):
        gpo_profiles(Two(), {"image": 36})


@pytest.mark.slow
def test_vse_pooling_cli_on_a_trained_run(synthetic_dir, tmp_path, capsys):
    small = [
        "model.embed_dim=32",
        "model.text.word_dim=16",
        "train.batch_size=32",
        "train.log_every=0",
        "train.epochs=1",
    ]
    Trainer(
        load_recipe("vse_infty", small), synthetic_dir, tmp_path / "gpo", progress=False, log=lambda *_: None
    ).fit()
    Trainer(
        load_recipe("vsepp", small), synthetic_dir, tmp_path / "avg", progress=False, log=lambda *_: None
    ).fit()
    rc = main(
        [
            "pooling",
            str(tmp_path / "gpo"),
            str(tmp_path / "avg"),
            "--image-len",
            "10",
            "--png",
            str(tmp_path / "w.png"),
            "--json",
            str(tmp_path / "w.json"),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "no GPO pooling (recipe pools with avg / avg)" in out
    assert "| gpo | image_encoder | 10 |" in out and "| gpo | text_encoder | 12 |" in out
    rows = json.loads((tmp_path / "w.json").read_text())
    assert [len(r["weights"]) for r in rows] == [10, 12]
    assert (tmp_path / "w.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["pooling", str(tmp_path / "nothing")]) == 2
