"""ESA against its released code (KevinLight831/ESA, ESA_BIGRU), number for number, on the parity fixtures
(../shared/fixtures/reference/esa, or VSE_REFERENCE_FIXTURES): the checkpoint imported with `vse import esa`,
read back with `vsekit.load`, then the evaluation embeddings and similarities, the SEL loss terms and their
gradients, and one training step through the trainer's own step (`TrainStep`) fed the random draws the release
recorded (region keep masks, augmented caption copies, word-dropout masks).

Tolerance: atol 1e-5 + rtol 1e-5 (the fixtures README's; float32 sums of at most a few hundred terms of unit
scale: ~1e-6 of rounding, measured here below 2e-6). Widths come from the arrays and the checkpoint.
"""

from __future__ import annotations

import argparse
import copy

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import vsekit
from conftest import reference_fixture_dir
from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe
from vsekit.data.batch import Batch
from vsekit.interop.esa import IMAGE_RULES, TEXT_RULES
from vsekit.losses import create_loss
from vsekit.models import esa as esa_module
from vsekit.models.esa import ESATextEncoder, draw_region_keep
from vsekit.models.norm import l2_normalize_views
from vsekit.training.step import TrainStep
from vsekit.training.trainer import Trainer

TOL = {"atol": 1e-5, "rtol": 1e-5}


def close(got: torch.Tensor, want: np.ndarray, what: str) -> None:
    np.testing.assert_allclose(got.detach().double().numpy(), want.astype(np.float64), err_msg=what, **TOL)


@pytest.fixture(scope="module")
def fx():
    root = reference_fixture_dir("esa")
    vocab = sorted((root / "vocab").glob("*.json"))
    return {
        "root": root,
        "in": np.load(root / "inputs.npz"),
        "out": np.load(root / "outputs.npz"),
        "vocab": vocab[0],
    }


@pytest.fixture(scope="module")
def run(fx, tmp_path_factory):
    out = tmp_path_factory.mktemp("esa") / "run"
    rc = main(
        ["import", "esa", str(fx["root"] / "model_best.pth"), "--out", str(out), "--vocab", str(fx["vocab"])]
    )
    assert rc == 0
    return out


def t(fx, key: str) -> torch.Tensor:
    return torch.from_numpy(fx["in"][key])


def test_import_evaluation_embeddings_and_similarity(fx, run):
    model = vsekit.load(run)
    o = fx["out"]
    assert model.recipe.model.image.pooling.esa_mask_padding is False  # the release's image aggregator
    with torch.no_grad():
        img = model.encode_image(t(fx, "images"), t(fx, "image_lengths"))
        cap = model.encode_text(t(fx, "captions"), t(fx, "caption_lengths"))
        from_strings = model.encode_text([str(s) for s in fx["in"]["caption_text"]])
        local = model.image_encoder.local_features(t(fx, "images"), t(fx, "image_lengths"))
        words = model.text_encoder.token_features(t(fx, "captions"), t(fx, "caption_lengths"))
        close(local, o["dbg_img_local"], "dbg_img_local")
        close(model.image_encoder.pool.linear1(local), o["dbg_img_external"], "dbg_img_external")
        n = o["dbg_cap_local"].shape[1]
        close(words[:, :n], o["dbg_cap_local"], "dbg_cap_local")
        lengths = fx["in"]["caption_lengths"]
        ext = model.text_encoder.pool.linear1(words[:, :n]).numpy()
        for b, k in enumerate(lengths):  # the release stores -10000 past each length
            np.testing.assert_allclose(ext[b, :k], o["dbg_cap_external"][b, :k], **TOL)
        close(img, o["img_emb"], "img_emb")
        close(cap, o["cap_emb"], "cap_emb")
        close(from_strings, o["cap_emb"], "cap_emb from the caption strings")
        close(model.similarity(img, cap), o["sims"], "sims")


def test_sel_loss_terms_and_embedding_gradients(fx, run):
    o = fx["out"]
    recipe = vsekit.load(run).recipe
    loss_fn = create_loss(recipe.loss)
    samples = torch.arange(fx["in"]["images"].shape[0])
    for form, warmup in (("vsepp", False), ("sum", True)):
        img = torch.from_numpy(o["train_img_emb"]).double().requires_grad_()
        cap = torch.from_numpy(o["train_cap_emb"]).double().requires_grad_()
        sims = img @ cap.T
        close(sims, o["dbg_train_scores"], "dbg_train_scores")
        loss, diag = loss_fn(sims, image_ids=samples, caption_ids=samples, warmup=warmup)
        close(loss, o[f"loss_sel_{form}"], f"loss_sel_{form}")
        if form == "vsepp":
            assert diag["cost_s"] == pytest.approx(float(o["dbg_cost_s"]), rel=1e-5, abs=1e-5)
            assert diag["cost_im"] == pytest.approx(float(o["dbg_cost_im"]), rel=1e-5, abs=1e-5)
        loss.backward()
        close(img.grad, o[f"grad_train_img_emb_{form}"], f"grad_train_img_emb_{form}")
        close(cap.grad, o[f"grad_train_cap_emb_{form}"], f"grad_train_cap_emb_{form}")


def recorded_draws(monkeypatch, fx) -> dict:
    """The encoders' three draws replaced by the release's recorded ones (checking what they are asked for)."""
    keep, copies = t(fx, "train_region_keep"), t(fx, "train_captions")
    b, v, width = copies.shape
    asked: dict = {}

    def region_keep(lengths, n, drop, within, generator):
        asked["region"] = (n, drop, within)
        return keep

    def caption_copies(self, tokens, lengths, generator):
        asked["captions"] = tuple(tokens.shape)
        return copies.reshape(b * v, width), t(fx, "train_caption_lengths").reshape(-1)

    def word_keep(shape, drop, generator, device):
        asked["words"] = (tuple(shape), drop)
        return t(fx, "train_word_dropout_keep")

    monkeypatch.setattr(esa_module, "draw_region_keep", region_keep)
    monkeypatch.setattr(ESATextEncoder, "draw_caption_copies", caption_copies)
    monkeypatch.setattr(esa_module, "draw_word_keep", word_keep)
    return asked


def test_training_step_loss_and_parameter_gradients(fx, run, monkeypatch):
    """One step of the trainer's TrainStep (train mode: BatchNorm on the batch, the two views) on the recorded
    draws: its loss, and every parameter's gradient before clipping (clipping off, lr 0)."""
    model = vsekit.load(run)
    recipe = copy.deepcopy(model.recipe)
    recipe.optim.grad_clip = 0.0
    recipe.train.device = "cpu"
    asked = recorded_draws(monkeypatch, fx)
    b = fx["in"]["images"].shape[0]
    batch = Batch(
        images=t(fx, "images"),
        image_lengths=t(fx, "image_lengths"),
        tokens=t(fx, "captions"),
        token_lengths=t(fx, "caption_lengths"),
        image_index=torch.arange(b),
        caption_index=torch.arange(b),
    )
    step = TrainStep(
        recipe,
        model,
        create_loss(recipe.loss),
        torch.optim.SGD(model.parameters(), lr=0.0),
        torch.device("cpu"),
    )
    out = step(batch, epoch=recipe.loss.warmup_epochs, step=0)  # after the warm-up: the hardest negatives
    o = fx["out"]
    close(out["loss"], o["loss_sel_vsepp"], "loss_sel_vsepp through the training step")
    assert asked["region"][1:] == (0.2, False) and asked["captions"] == tuple(fx["in"]["captions"].shape)
    assert asked["words"][1] == pytest.approx(0.1)
    params = dict(model.named_parameters())
    checked = 0
    for key in o.files:
        if not key.startswith("grad_param."):
            continue
        _, enc, name = key.split(".", 2)
        src, dst = next(r for r in (IMAGE_RULES if enc == "img_enc" else TEXT_RULES) if name.startswith(r[0]))
        if dst is None:  # mlp.bns.1: stored, never applied (all-zero gradient in the fixture)
            assert not o[key].any(), key
            continue
        close(params[dst + name[len(src) :]].grad, o[key], key)
        checked += 1
    assert checked == len(params)


def test_gradient_of_the_region_input(fx, run):
    model = vsekit.load(run).train()
    images = t(fx, "images").clone().requires_grad_()
    b, v, width = fx["in"]["train_captions"].shape
    img = model.image_encoder.embed_views(images, t(fx, "image_lengths"), t(fx, "train_region_keep"))
    cap = model.text_encoder.embed_views(
        t(fx, "train_captions").reshape(b * v, width),
        t(fx, "train_caption_lengths").reshape(-1),
        t(fx, "train_word_dropout_keep"),
    )
    # the encoders' pooled views; the model normalises each (VSEModel, in the run's l2_form)
    form = model.recipe.model.l2_form
    img, cap = l2_normalize_views(img, form), l2_normalize_views(cap, form)
    close(img, fx["out"]["train_img_emb"], "train_img_emb")
    close(cap, fx["out"]["train_cap_emb"], "train_cap_emb")
    loss, _ = create_loss(model.recipe.loss)(
        img @ cap.T, image_ids=torch.arange(b), caption_ids=torch.arange(b)
    )
    loss.backward()
    close(images.grad, fx["out"]["grad_train_images_vsepp"], "grad_train_images_vsepp")


def test_masked_variant_ignores_padding_and_released_one_does_not(fx, run):
    """The default (`esa_mask_padding: true`) embeds an image as the released code embeds it alone, unpadded; the
    released form changes with the batch's padding (the fixture's images are padded to different counts)."""
    released = vsekit.load(run)
    recipe = copy.deepcopy(released.recipe)
    recipe.model.image.pooling.esa_mask_padding = True
    masked = type(released)(recipe, released.spec)
    masked.load_state_dict(released.state_dict())
    masked.eval()
    images, lengths = t(fx, "images"), t(fx, "image_lengths")
    with torch.no_grad():
        got = masked.encode_image(images, lengths)
        padded_more = masked.encode_image(torch.cat([images, torch.zeros_like(images)], 1), lengths)
        alone = torch.cat(
            [
                released.encode_image(images[i : i + 1, : int(n)], lengths[i : i + 1])
                for i, n in enumerate(lengths)
            ]
        )
        rel = released.encode_image(images, lengths)
    torch.testing.assert_close(got, alone, **TOL)
    torch.testing.assert_close(padded_more, got, **TOL)
    short = lengths < images.shape[1]
    assert short.any()
    assert (rel[short] - alone[short]).abs().amax() > 1e-3  # the release's padding rows take softmax mass
    torch.testing.assert_close(rel[~short], alone[~short], **TOL)


def test_training_draws_come_from_the_generator():
    """The two views are drawn from the step's generator: the same seed gives the same views, another seed others;
    the masked form draws only inside each set and never leaves a view empty."""
    lengths = torch.tensor([1, 3, 7, 7])

    def draw(seed: int, within: bool) -> torch.Tensor:
        return draw_region_keep(lengths, 7, 0.2, within, torch.Generator().manual_seed(seed))

    assert torch.equal(draw(3, True), draw(3, True)) and not torch.equal(draw(3, True), draw(4, True))
    keep = draw(5, True)
    assert keep.shape == (4, 2, 7)
    assert not keep[torch.arange(7).expand(4, 2, 7) >= lengths.view(4, 1, 1)].any()
    assert keep.any(-1).all()
    many = draw_region_keep(torch.full((2000,), 36), 36, 0.2, False, torch.Generator().manual_seed(0))
    assert float(many.float().mean()) == pytest.approx(0.8, abs=0.01)


def test_recipe_lists_esa_and_refuses_what_it_cannot_train():
    r = load_recipe("esa")
    assert (r.model.image.pooling.name, r.model.text.pooling.name, r.loss.name) == ("esa", "esa", "sel")
    with pytest.raises(ConfigError, match="data.text_augment_prob=0"):
        load_recipe("esa", ["data.text_augment_prob=0.2"])
    with pytest.raises(ConfigError, match="loss.name=sel"):
        load_recipe("esa", ["loss.name=triplet"])
    with pytest.raises(ConfigError, match="grad_cache_chunk"):
        load_recipe("esa", ["train.grad_cache_chunk=4"])
    with pytest.raises(ConfigError, match="needs encoders that make them"):
        load_recipe("vse_infty", ["loss.name=sel"])
    # grid features give one image view while the BiGRU side gives two: refused at load, not at the first step
    with pytest.raises(ConfigError, match="model.image.pooling makes one"):
        load_recipe("esa", ["model.image.feature_type=grid"])


def test_import_refuses_other_checkpoints(fx, tmp_path, capsys):
    ckpt = torch.load(fx["root"] / "model_best.pth", map_location="cpu", weights_only=False)
    ckpt["opt"] = argparse.Namespace(**{**vars(ckpt["opt"]), "hardnum": 3})
    torch.save(ckpt, tmp_path / "hardnum3.pth")
    rc = main(
        [
            "import",
            "esa",
            str(tmp_path / "hardnum3.pth"),
            "--out",
            str(tmp_path / "r"),
            "--vocab",
            str(fx["vocab"]),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "hardnum=3" in err[0]
    ckpt["model"] = [{k: v for k, v in m.items() if not k.startswith("linear1.")} for m in ckpt["model"]]
    torch.save(ckpt, tmp_path / "no_linear1.pth")
    rc = main(
        [
            "import",
            "esa",
            str(tmp_path / "no_linear1.pth"),
            "--out",
            str(tmp_path / "r"),
            "--vocab",
            str(fx["vocab"]),
        ]
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "not an ESA checkpoint" in err[0]
    assert not (tmp_path / "r").exists()


TINY = [
    "model.embed_dim=16",
    "model.text.word_dim=8",
    "model.image.mlp_hidden=8",
    "model.text.vocab_min_count=1",
    "model.text.tokenizer=regex",
    "train.batch_size=8",
    "train.log_every=0",
    "train.epochs=2",
]


def test_train_resumes_exactly_and_evaluates(tiny_data, tmp_path):
    r = load_recipe("esa", TINY)
    quiet = {"progress": False, "log": lambda *_: None}
    Trainer(r, tiny_data, tmp_path / "a", **quiet).fit()
    Trainer(r, tiny_data, tmp_path / "b", **quiet).fit(max_steps=4)  # stops mid-epoch 0 with a checkpoint
    Trainer(r, tiny_data, tmp_path / "b", resume=True, **quiet).fit()
    a, b = load_file(tmp_path / "a" / "last.safetensors"), load_file(tmp_path / "b" / "last.safetensors")
    assert a.keys() == b.keys()
    for k in a:  # bit-identical: same process and threads, same batch shapes, restored state
        assert torch.equal(a[k], b[k]), k
    assert main(["eval", str(tmp_path / "a"), "--split", "test", "--device", "cpu"]) == 0


def test_the_step_s_views_come_from_its_seed_not_the_global_generator():
    """Two identical models trained one step at the same (seed, epoch, step) get the same loss and weights, however
    torch's global generator was seeded: both encoders draw their views from the step's own generator."""
    from vsekit.data.text import Vocabulary
    from vsekit.models.vse import DataSpec, VSEModel

    recipe = load_recipe("esa", TINY)
    recipe.train.device = "cpu"
    vocab = Vocabulary.build(["a red dog runs far", "two cats sit on a mat"])
    torch.manual_seed(0)
    first = VSEModel(recipe, DataSpec(img_dim=8, vocab_words=vocab.idx2word))
    second = copy.deepcopy(first)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(4, len(vocab.idx2word), (6, 7), generator=g)
    tokens[:, 0], tokens[:, -1] = 1, 2
    batch = Batch(
        images=torch.randn(6, 5, 8, generator=g),
        image_lengths=torch.tensor([5, 3, 4, 5, 2, 5]),
        tokens=tokens,
        token_lengths=torch.full((6,), 7),
        image_index=torch.arange(6),
        caption_index=torch.arange(6),
    )
    losses = []
    for global_seed, model in ((11, first), (12, second)):
        torch.manual_seed(global_seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        step = TrainStep(recipe, model, create_loss(recipe.loss), opt, torch.device("cpu"))
        losses.append(step(batch, epoch=1, step=3)["loss"])
    assert torch.equal(losses[0], losses[1])
    for (name, a), b in zip(first.state_dict().items(), second.state_dict().values()):
        assert torch.equal(a, b), name
