"""`vse import` + `vsekit.load` against the released code: every fixture's outputs, number for number.

Each item of `reference_fixture_dir()` holds a checkpoint in the released format, the inputs, and what the
released code computed from them (README there). We import the checkpoint with the CLI, load the run with
`vsekit.load`, run the same inputs and compare embeddings, similarities, the recipe's loss and its gradients
at atol = rtol = 1e-5: both sides are the same float32 ops (BiGRU/BERT/ViT encoders, cosine or AEOM scores, a
loss over the batch), summed in other orders and on other CPU kernels, which moves O(1) values by a few eps per
layer (measured <= 0.11 of the tolerance on native, default and avx2 kernels); a wrong weight mapping moves
them by O(0.1). Nothing about sizes is hard-coded: BERT/ViT configs come from the item's meta.json (the only
place the released code's hub configs exist), everything else from the checkpoint itself, so the held-out
fixture set runs unchanged.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vsekit
from conftest import reference_fixture_dir
from vsekit.cli import main
from vsekit.losses import create_loss
from vsekit.pooling.adpool import ADPool

TOL = {"atol": 1e-5, "rtol": 1e-5}
ITEMS = {  # fixture folder -> (vse import KIND, checkpoint file)
    "vse_infty_bigru": ("vse_infty", "model_best.pth"),
    "vse_infty_bert": ("vse_infty", "model_best.pth"),
    "vse_2ad": ("vse_2ad", "checkpoint.pth"),
    "avse": ("avse", "model_best.pth"),
}


def import_args(item: str, folder: Path, tmp: Path) -> list[str]:
    """`vse import` arguments for a fixture item: vocabulary for BiGRUs, meta.json's configs for BERT/ViT."""
    kind, ckpt = ITEMS[item]
    args = ["import", kind, str(folder / ckpt)]
    vocabs = sorted((folder / "vocab").glob("*.json")) if (folder / "vocab").is_dir() else []
    if vocabs:
        args += ["--vocab", str(vocabs[0])]
    meta = json.loads((folder / "meta.json").read_text())
    for key, flag in (("bert_config", "--text-config"), ("vit_config", "--vision-config")):
        if key in meta:
            path = tmp / f"{key}.json"
            path.write_text(json.dumps(meta[key]))
            args += [flag, str(path)]
    if "block_dim" in meta:
        args += ["--block-dim", str(int(np.ravel(meta["block_dim"])[0]))]
    return args


@pytest.fixture(scope="module", params=list(ITEMS))
def imported(request, tmp_path_factory):
    item = request.param
    folder = reference_fixture_dir(item)
    tmp = tmp_path_factory.mktemp(item)
    out = tmp / "run"
    assert main(import_args(item, folder, tmp) + ["--out", str(out)]) == 0
    inputs = dict(np.load(folder / "inputs.npz"))
    outputs = dict(np.load(folder / "outputs.npz"))
    return item, vsekit.load(out), inputs, outputs, out


def encode(model, item: str, inputs: dict, images: torch.Tensor | None = None):
    x = torch.from_numpy(inputs["images"]) if images is None else images
    if item == "avse":  # the views the released model drew, recorded with the fixture
        img = model.encode_image(x, view_indices=torch.from_numpy(inputs["view_sampled_indices"]))
    else:
        img = model.encode_image(x, inputs["image_lengths"])
    return img, model.encode_text(inputs["captions"], inputs["caption_lengths"])


def close(actual: torch.Tensor, expected: np.ndarray, what: str) -> None:
    torch.testing.assert_close(
        actual.detach().float(),
        torch.from_numpy(np.asarray(expected)).float(),
        **TOL,
        msg=lambda m: f"{what}: {m}",
    )


def test_embeddings_and_similarities(imported):
    item, model, inputs, outputs, _ = imported
    with torch.no_grad():
        img, txt = encode(model, item, inputs)
        close(img, outputs["img_emb"], "img_emb")
        close(txt, outputs["cap_emb"], "cap_emb")
        close(model.similarity(img, txt), outputs["sims"], "sims")


def test_caption_strings_embed_as_the_ids(imported):
    """BiGRU runs tokenise strings with the imported SCAN vocabulary (one fixture caption has an unknown word)."""
    item, model, inputs, outputs, _ = imported
    if "caption_text" not in inputs:
        pytest.skip(f"{item}: no caption strings in the fixture")
    ids, lengths = model.tokenize([str(c) for c in inputs["caption_text"]])
    np.testing.assert_array_equal(lengths.numpy(), inputs["caption_lengths"])
    np.testing.assert_array_equal(ids.numpy(), inputs["captions"][:, : ids.shape[1]])
    with torch.no_grad():
        close(
            model.encode_text([str(c) for c in inputs["caption_text"]]),
            outputs["cap_emb"],
            "cap_emb from text",
        )


def recipe_loss(model, sims: torch.Tensor, img: torch.Tensor, max_violation: bool):
    cfg = model.recipe.loss
    cfg.max_violation = max_violation
    loss_fn = create_loss(cfg, image_views=model.recipe.model.image.views)
    return loss_fn(sims, None, warmup=False, image_emb=img)


@pytest.mark.parametrize("suffix", ["vsepp", "sum", "adopt"])
def test_recipe_loss_and_gradients(imported, suffix):
    """The imported recipe's own loss on the model's own similarity: value and embedding gradients."""
    item, model, inputs, outputs, _ = imported
    if f"loss_{suffix}" not in outputs and f"loss_total_{suffix}" not in outputs:
        pytest.skip(f"{item} has no {suffix} loss")
    with torch.no_grad():
        img, txt = encode(model, item, inputs)
    img.requires_grad_(True)
    txt.requires_grad_(True)
    loss, diag = recipe_loss(model, model.similarity(img, txt), img, max_violation=suffix == "vsepp")
    loss.backward()
    close(loss, outputs.get(f"loss_{suffix}", outputs.get(f"loss_total_{suffix}")), f"loss_{suffix}")
    close(img.grad, outputs[f"grad_img_emb_{suffix}"], "grad img_emb")
    close(txt.grad, outputs[f"grad_cap_emb_{suffix}"], "grad cap_emb")
    if suffix == "adopt":
        assert diag["K_i2t"] == int(outputs["K_i2t"]) and diag["K_t2i"] == int(outputs["K_t2i"])


def test_gradient_reaches_the_region_features(imported):
    """VSE++ loss back through the eval-mode model to the padded region input (zero on the padding)."""
    item, model, inputs, outputs, _ = imported
    if "grad_images_vsepp" not in outputs:
        pytest.skip(f"{item}: no input gradient in the fixture")
    x = torch.from_numpy(inputs["images"]).requires_grad_(True)
    img, txt = encode(model, item, inputs, images=x)
    loss, _ = recipe_loss(model, model.similarity(img, txt), img, max_violation=True)
    loss.backward()
    close(x.grad, outputs["grad_images_vsepp"], "grad images")


@pytest.mark.parametrize("extra", [(3, 4), (0, 7)])
def test_fixed_widths_give_the_releases_numbers(imported, extra):
    """The training data path pads region sets to the set's largest and captions to a bucket width, wider than
    the released code's per-batch padding: on the fixtures' own inputs padded wider (zeros, as the data path
    pads) the embeddings, the recipe's loss and its gradients (embeddings; region input where recorded) are
    still the release's."""
    item, model, inputs, outputs, _ = imported
    if "image_lengths" not in inputs:
        pytest.skip(f"{item}: not a region-set fixture")
    if any(isinstance(m, ADPool) and not m.mask_padding for m in model.modules()):
        # the import reproduces the release's ADPOOL, whose softmax runs over padded ranks too (so its numbers
        # depend on the padding); training recipes mask it (adpool_mask_padding: true), and masked ADPOOL's
        # independence of the padding width is tested in tests/test_fixed_shape.py (vse_2ad)
        pytest.skip(f"{item}: the released ADPOOL depends on the padding width by design")
    suffix = "adopt" if "loss_adopt" in outputs else "vsepp"
    more_regions, more_tokens = extra
    images = torch.from_numpy(inputs["images"])
    wide = torch.cat([images, images.new_zeros(images.shape[0], more_regions, *images.shape[2:])], 1)
    wide.requires_grad_(True)
    tokens = np.asarray(inputs["captions"])
    wide_tokens = np.concatenate([tokens, np.zeros((tokens.shape[0], more_tokens), tokens.dtype)], 1)
    img = model.encode_image(wide, inputs["image_lengths"])
    # eval mode: encode_text holds no graph (R-D17), so the caption embeddings are the leaves of this loss
    txt = model.encode_text(wide_tokens, inputs["caption_lengths"]).requires_grad_(True)
    close(img, outputs["img_emb"], "img_emb (wider)")
    close(txt, outputs["cap_emb"], "cap_emb (wider)")
    img.retain_grad(), txt.retain_grad()
    loss, _ = recipe_loss(model, model.similarity(img, txt), img, max_violation=suffix == "vsepp")
    loss.backward()
    close(loss, outputs[f"loss_{suffix}"], f"loss_{suffix} (wider)")
    close(img.grad, outputs[f"grad_img_emb_{suffix}"], "grad img_emb (wider)")
    close(txt.grad, outputs[f"grad_cap_emb_{suffix}"], "grad cap_emb (wider)")
    if "grad_images_vsepp" in outputs:
        close(wide.grad[:, : images.shape[1]], outputs["grad_images_vsepp"], "grad images (wider)")
    assert not wide.grad[:, images.shape[1] :].any()  # the padding never reaches the loss


def test_run_records_what_the_release_never_reads(imported):
    item, _, _, _, out = imported
    config = json.loads((out / "config.json").read_text())
    record = config["imported_from"]
    assert record["kind"] == item
    assert record["unused_keys"] and all(".mlp.bns.1." in k for k in record["unused_keys"])
    assert config["recipe"]["model"]["l2_form"] == "add_eps"


def test_imported_runs_keep_the_releases_optimizer_and_scoring(imported):
    """Fine-tuning an imported run uses its release's AdamW weight decay (BiGRU codes: PyTorch's default 0.01;
    BERT/ViT codes: 1e-4); an imported AVSE run scores with the released block max-sum."""
    item, model, _, _, _ = imported
    expected = {"vse_infty_bigru": 0.01, "vse_infty_bert": 1e-4, "vse_2ad": 0.01, "avse": 1e-4}
    assert model.recipe.optim.weight_decay == expected[item]
    if item == "avse":
        assert model.recipe.model.similarity.readout == "maxsum" and model.sim.readout == "maxsum"


def test_vse_eval_equals_eval_sims_on_the_reference_matrix(imported, tmp_path, capsys):
    """`vse eval` on the imported run scores the fixture inputs exactly as `vse eval-sims` scores the
    released code's similarity matrix (one caption per image; regions of each set given by their lengths)."""
    item, model, inputs, outputs, out = imported
    if "caption_text" not in inputs or "image_lengths" not in inputs:
        pytest.skip(f"{item}: needs caption strings and precomputed features")
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "test_ims.npy", inputs["images"].astype(np.float32))
    (data / "test_ims_lengths.txt").write_text("".join(f"{n}\n" for n in inputs["image_lengths"]))
    (data / "test_caps.txt").write_text("".join(f"{c}\n" for c in inputs["caption_text"]))
    (data / "test_cap2img.txt").write_text("".join(f"{i}\n" for i in range(len(inputs["caption_text"]))))
    # evaluate in one batch padded as the fixture's (the 2AD release's token softmax sees the padding)
    assert (
        main(
            [
                "eval",
                str(out),
                "--data",
                str(data),
                "--split",
                "test",
                "--json",
                str(tmp_path / "a.json"),
                "--batch-size",
                str(len(inputs["images"])),
            ]
        )
        == 0
    )
    np.save(tmp_path / "ref.npy", outputs["sims"])
    assert (
        main(
            [
                "eval-sims",
                str(tmp_path / "ref.npy"),
                "--captions-per-image",
                "1",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    a = json.loads((tmp_path / "a.json").read_text())
    b = json.loads((tmp_path / "b.json").read_text())
    keys = [k for k in b if isinstance(b[k], (int, float))]
    assert keys and {k: a[k] for k in keys} == {k: b[k] for k in keys}


# ------------------------------------------------------------------------------ bad checkpoints


def released_ckpt(item: str) -> dict:
    kind, name = ITEMS[item]
    with torch.serialization.safe_globals([argparse.Namespace]):
        return torch.load(reference_fixture_dir(item) / name, map_location="cpu", weights_only=True)


def refused(capsys, args: list[str], out: Path) -> str:
    assert main(args + ["--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert not out.exists()
    return err


def bigru_args(ckpt_path: Path) -> list[str]:
    vocab = sorted((reference_fixture_dir("vse_infty_bigru") / "vocab").glob("*.json"))[0]
    return ["import", "vse_infty", str(ckpt_path), "--vocab", str(vocab)]


@pytest.mark.parametrize(
    "damage,message",
    [
        ("missing", "missing 1 key"),
        ("extra", "unexpected key"),
        ("shape", "mis-shaped"),
    ],
)
def test_misfit_keys_are_refused_naming_them(tmp_path, capsys, damage, message):
    ckpt = released_ckpt("vse_infty_bigru")
    txt = ckpt["model"][1]
    if damage == "missing":
        del txt["rnn.bias_hh_l0"]
    elif damage == "extra":
        txt["gpool.spare"] = torch.zeros(3)
    else:
        txt["gpool.linear.weight"] = torch.zeros(1, 5)
    path = tmp_path / "damaged.pth"
    torch.save(ckpt, path)
    err = refused(capsys, bigru_args(path), tmp_path / "out")
    assert message in err and str(path) in err
    assert {"missing": "rnn.bias_hh_l0", "extra": "gpool.spare", "shape": "pool.linear.weight"}[damage] in err


class NotAllowed:
    """Any class outside the allow-list: the importer must refuse it without constructing it."""

    constructed = False

    def __init__(self) -> None:
        NotAllowed.constructed = True

    def __reduce__(self):
        return (NotAllowed, ())


def test_bad_files_are_refused_in_one_line(tmp_path, capsys):
    good = reference_fixture_dir("vse_infty_bigru") / "model_best.pth"
    text = tmp_path / "notes.pth"
    text.write_text("not a checkpoint\n")
    assert "not a readable PyTorch checkpoint" in refused(capsys, bigru_args(text), tmp_path / "o1")
    truncated = tmp_path / "truncated.pth"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    assert "truncated" in refused(capsys, bigru_args(truncated), tmp_path / "o2")
    evil = tmp_path / "evil.pth"
    ckpt = released_ckpt("vse_infty_bigru")
    ckpt["extra"] = NotAllowed()
    torch.save(ckpt, evil)
    NotAllowed.constructed = False
    err = refused(capsys, bigru_args(evil), tmp_path / "o3")
    assert "refused" in err and "NotAllowed" in err and not NotAllowed.constructed
    wrong_kind = reference_fixture_dir("vse_2ad") / "checkpoint.pth"
    assert "vse_2ad" in refused(capsys, bigru_args(wrong_kind), tmp_path / "o4")
    assert "no such checkpoint" in refused(capsys, bigru_args(tmp_path / "absent.pth"), tmp_path / "o5")


def test_legacy_file_format_and_cuda_tags_import(tmp_path):
    """Old checkpoints use torch's pre-zip format; the fixtures' tensors are tagged cuda:0."""
    legacy = tmp_path / "legacy.pth"
    torch.save(released_ckpt("vse_infty_bigru"), legacy, _use_new_zipfile_serialization=False)
    assert main(bigru_args(legacy) + ["--out", str(tmp_path / "run")]) == 0
    assert (tmp_path / "run" / "best.safetensors").is_file()


def test_out_must_be_new_or_empty(tmp_path, capsys):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    good = reference_fixture_dir("vse_infty_bigru") / "model_best.pth"
    assert main(bigru_args(good) + ["--out", str(out)]) == 2
    assert "not an empty folder" in capsys.readouterr().err
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_wrong_vocabulary_is_refused(tmp_path, capsys):
    vocab = tmp_path / "vocab.json"
    vocab.write_text(
        json.dumps(
            {
                "idx2word": {"0": "<pad>", "1": "<start>", "2": "<end>", "3": "<unk>", "4": "a"},
                "word2idx": {},
                "idx": 5,
            }
        )
    )
    good = reference_fixture_dir("vse_infty_bigru") / "model_best.pth"
    err = refused(capsys, ["import", "vse_infty", str(good), "--vocab", str(vocab)], tmp_path / "o")
    assert "not this model's vocabulary" in err


def test_bert_heads_that_do_not_divide_the_width_ask_for_a_config(tmp_path, capsys):
    """Heads are the one BERT size the weights cannot tell; the default (12) must divide the width."""
    ckpt = reference_fixture_dir("vse_infty_bert") / "model_best.pth"
    meta = json.loads((reference_fixture_dir("vse_infty_bert") / "meta.json").read_text())
    if meta["bert_config"]["hidden_size"] % 12 == 0:
        pytest.skip("this fixture's BERT width is divisible by 12")
    err = refused(capsys, ["import", "vse_infty", str(ckpt)], tmp_path / "o")
    assert "--text-config" in err


def test_packaged_wordpiece_vocabulary_is_bert_base_uncased():
    """The MiniLM package's vocab.txt is bert-base-uncased's: size and well-known token ids of that vocabulary."""
    from vsekit.interop.text_models import uncased_wordpiece_vocab

    words = uncased_wordpiece_vocab().decode().splitlines()
    anchors = {
        0: "[PAD]",
        1: "[unused0]",
        100: "[UNK]",
        101: "[CLS]",
        102: "[SEP]",
        103: "[MASK]",
        1037: "a",
        1996: "the",
        2088: "world",
        7592: "hello",
    }
    assert len(words) == 30522 and {i: words[i] for i in anchors} == anchors


def test_model_api_rejects_bad_input_clearly(imported):
    item, model, inputs, _, _ = imported
    if item == "avse":
        with pytest.raises(ValueError, match=r"pixels \[batch, 3, height, width\]"):
            model.encode_image(np.zeros((2, 5, 7), np.float32))
        return
    width = inputs["images"].shape[-1]
    with pytest.raises(ValueError, match=f"features \\[batch, regions, {width}\\]"):
        model.encode_image(np.zeros((2, 5, width + 1), np.float32))
    with pytest.raises(ValueError, match="lengths must be"):
        model.encode_image(inputs["images"], np.full(len(inputs["images"]), inputs["images"].shape[1] + 1))
    with pytest.raises(ValueError, match="lengths must be"):
        model.encode_text(inputs["captions"], np.zeros(len(inputs["captions"]), np.int64))
    with pytest.raises(TypeError, match="torch.Tensor or numpy array"):
        model.encode_image([[1.0]])
