"""The bag-of-words floor (`bow` recipe) and training on a share of the training images.

Float comparisons: a float32 mean of <= 4 word vectors, normalised, against the float64 formula: a few eps
per entry, rtol 1e-5 / atol 1e-6 (>= 8 eps) on O(0.5) entries.
"""

import json

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe
from vsekit.data.precomp import load_precomp_split
from vsekit.models.text import BagOfWordsTextEncoder
from vsekit.training.trainer import Trainer


def test_bow_caption_is_the_mean_of_its_word_vectors():
    cfg = load_recipe("bow").model.text
    enc = BagOfWordsTextEncoder(vocab_size=9, embed_dim=4, cfg=cfg)
    w = enc.embed.weight.detach().numpy().astype(np.float64)
    tokens = torch.tensor([[3, 5, 5, 8], [2, 7, 0, 0]])
    lengths = torch.tensor([4, 2])
    out = enc(tokens, lengths).detach().numpy()  # the model L2-normalises it (test_model_output_norm)
    for row, ids in zip(out, ([3, 5, 5, 8], [2, 7])):
        np.testing.assert_allclose(row, w[ids].mean(0), rtol=1e-5, atol=1e-6)
    # word order plays no part; padding length plays no part
    shuffled = enc(torch.tensor([[8, 5, 3, 5, 0, 0]]), torch.tensor([4])).detach().numpy()
    np.testing.assert_allclose(shuffled[0], out[0], rtol=1e-5, atol=1e-6)


def test_sample_images_is_nested_seeded_and_keeps_each_images_captions(synthetic_dir):
    split = load_precomp_split(synthetic_dir, "train", 5)
    quarter, half = split.sample_images(0.25, seed=3), split.sample_images(0.5, seed=3)
    assert quarter.n_images == round(split.n_images * 0.25) and half.n_images == round(split.n_images * 0.5)
    assert set(quarter.image_ids) < set(half.image_ids)  # nested: more data adds, never swaps
    assert quarter.image_ids != split.sample_images(0.25, seed=4).image_ids
    assert split.sample_images(1.0, seed=3) is split
    original = {}
    for cap, img in zip(split.captions, split.cap2img):
        original.setdefault(split.image_ids[img], []).append(cap)
    got = {}
    for cap, img in zip(half.captions, half.cap2img):
        got.setdefault(half.image_ids[img], []).append(cap)
    assert set(got) == set(half.image_ids)
    for image_id, caps in got.items():
        assert caps == original[image_id]
        row = half.image_rows[half.image_ids.index(image_id)]
        assert row == split.image_rows[split.image_ids.index(image_id)]


@pytest.mark.parametrize("bad", ["0", "1.5", "-0.2"])
def test_train_fraction_outside_0_1_is_refused(bad):
    with pytest.raises(ConfigError, match="data.train_fraction"):
        load_recipe("bow", [f"data.train_fraction={bad}"])


def test_bow_recipe_trains_far_above_chance_on_a_share_of_the_data(synthetic_dir, tmp_path):
    logs = []
    r = load_recipe(
        "bow", ["train.epochs=6", "train.batch_size=64", "data.train_fraction=0.5", "train.log_every=0"]
    )
    Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=logs.append).fit()
    assert any("training on 120 of 240 training images" in line for line in logs)
    assert main(["eval", str(tmp_path / "run"), "--split", "test", "--json", str(tmp_path / "m.json")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    chance = 100 / 50
    assert m["t2i_r1"] > 5 * chance and m["i2t_r1"] > 5 * chance


def test_coco_scale_recipe_on_a_small_split_names_the_best_measured_recipe(synthetic_dir, tmp_path):
    from vsekit.training.trainer import small_data_advice

    assert small_data_advice(load_recipe("vse_infty"), 113_287) is None
    assert small_data_advice(load_recipe("bow"), 500) is None
    advice = small_data_advice(load_recipe("vsepp"), 2_506)
    assert "2,506" in advice and "--recipe bow" in advice and "docs/floor.md" in advice
    # the preset: both recipes named, and the ensemble command that scores them together
    assert "--recipe small_data" in advice and "vse eval RUN_BOW RUN_SMALL_DATA" in advice
    for name in ("bow", "small_data"):
        load_recipe(name)  # both recipes the advice names exist
    logs = []
    r = load_recipe(
        "vsepp", ["train.epochs=1", "model.embed_dim=32", "model.text.word_dim=16", "train.log_every=0"]
    )
    Trainer(r, synthetic_dir, tmp_path / "run", progress=False, log=logs.append)
    assert any(line.startswith("note: recipe 'vsepp'") and "--recipe bow" in line for line in logs)


def test_word_bag_adds_the_mean_of_the_tokens_learned_vectors(tmp_path):
    pytest.importorskip("transformers")
    from vsekit.models.text import TransformerTextEncoder, default_transformer_path

    try:
        path = default_transformer_path()
    except RuntimeError:
        pytest.skip("the packaged MiniLM is not installed")
    cfg = load_recipe("small_data").model.text
    assert cfg.word_bag and cfg.freeze
    enc = TransformerTextEncoder(8, cfg, model_path=path).eval()
    with torch.no_grad():  # silence the body's branch: what is left is the bag of word pieces alone
        enc.proj.weight.zero_()
        enc.proj.bias.zero_()
    tokens = torch.tensor([[101, 2158, 2003, 102, 0], [101, 3899, 102, 0, 0]])
    lengths = torch.tensor([4, 3])
    out = enc(tokens, lengths).detach().numpy()
    bag = enc.word_bag.weight.detach().numpy().astype(np.float64)
    for row, ids in zip(out, ([101, 2158, 2003, 102], [101, 3899, 102])):
        np.testing.assert_allclose(row, bag[ids].mean(0), rtol=1e-5, atol=1e-6)
    # the bag's vectors train; the frozen body does not
    trainable = {n for n, p in enc.named_parameters() if p.requires_grad}
    assert "word_bag.weight" in trainable and not any(n.startswith("body.") for n in trainable)
