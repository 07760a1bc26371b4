"""CHAN (ppanzx/CHAN, BiGRU configuration) against its released code, number for number.

The fixture folder `reference_fixture_dir("chan")` holds a checkpoint as the release's `train.py` writes it
(four state dicts, the vocabulary pickled in `opt.word2idx`), the inputs, and what the released code computed
(README there, section "chan"). We import it with `vse import chan`, load it with `vsekit.load`, and compare
embeddings, the VHA coding, every pooling head, the hinge loss and its gradients; then one step of the training
path (`TrainStep`) for the loss, the region-input gradient and every parameter's gradient.

Tolerance atol = rtol = 1e-5: the same float32 ops (linear, LayerNorm, attention, BiGRU, cosines, max, a
log-sum-exp over <= L words) summed in other orders, a few eps per op on O(1) values; the LSE scores are on a
~1/temperature = 10x scale and the gradients of the sum loss reach ~30 (meta.json output_stats), where 1e-5
relative still leaves > 10x headroom over float32 rounding; a wrong weight or mask moves them by O(0.1).
Widths, lengths and options come from the files, so the held-out set runs unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

import vsekit
from conftest import reference_fixture_dir
from vsekit.cli import main
from vsekit.errors import VseInputError
from vsekit.losses import create_loss
from vsekit.similarity.chan import pool_codes, vha_codes

TOL = {"atol": 1e-5, "rtol": 1e-5}
HEADS = {"LSEPooling": "lse", "MaxPooling": "max", "MeanPooling": "mean", "SumPooling": "sum"}
# released state-dict prefix -> vsekit parameter prefix (written here, independently of the importer's rules)
PARAMS = {
    "img_enc.fc.": "image_encoder.fc.",
    "img_enc.feedforward.ln.": "image_encoder.attend.ln.",
    "img_enc.feedforward.attn.": "image_encoder.attend.attn.",
    "txt_enc.embed.": "text_encoder.embed.",
    "txt_enc.rnn.": "text_encoder.gru.",
}


@pytest.fixture(scope="module")
def chan(tmp_path_factory):
    folder = reference_fixture_dir("chan")
    out = tmp_path_factory.mktemp("chan") / "run"
    assert main(["import", "chan", str(folder / "model_best.pth"), "--out", str(out)]) == 0
    inputs = dict(np.load(folder / "inputs.npz"))
    outputs = dict(np.load(folder / "outputs.npz"))
    meta = json.loads((folder / "meta.json").read_text())
    return vsekit.load(out), inputs, outputs, meta, out


def t(x) -> torch.Tensor:
    return torch.from_numpy(np.asarray(x))


def close(actual: torch.Tensor, expected, what: str) -> None:
    torch.testing.assert_close(
        actual.detach().float(), t(expected).float(), **TOL, msg=lambda m: f"{what}: {m}"
    )


def region_mask(inputs: dict, width: int) -> torch.Tensor:
    return torch.arange(width)[None] < t(inputs["image_lengths"])[:, None]


def released_img_emb(inputs: dict, outputs: dict) -> torch.Tensor:
    """The release's img_emb with its padded rows (non-zero there, masked by the lengths) as vsekit marks
    padding: zero rows."""
    emb = t(outputs["img_emb"]).clone()
    emb[~region_mask(inputs, emb.shape[1])] = 0
    return emb


def encode(model, inputs: dict, images: torch.Tensor | None = None):
    x = t(inputs["images"]) if images is None else images
    return model.encode_image(x, inputs["image_lengths"]), model.encode_text(
        inputs["captions"], inputs["caption_lengths"]
    )


def test_embeddings_match_the_release(chan):
    model, inputs, outputs, _, _ = chan
    with torch.no_grad():
        img, txt = encode(model, inputs)
        mask = region_mask(inputs, img.shape[1])
        close(img[mask], t(outputs["img_emb"])[mask], "img_emb (real regions)")
        assert not img[~mask].any()  # padding is marked by zero rows
        close(txt, outputs["cap_emb"], "cap_emb")
        x = t(inputs["images"])
        close(model.image_encoder.fc(x), outputs["dbg_img_fc"], "fc")
        attended = model.image_encoder.embed_set(x, t(inputs["image_lengths"]))
        close(attended[mask], t(outputs["dbg_img_selfattn"])[mask], "self-attention (real regions)")


def test_caption_strings_embed_as_the_ids(chan):
    """The vocabulary the checkpoint pickles (opt.word2idx) tokenises the fixture's captions into its ids."""
    model, inputs, outputs, _, _ = chan
    texts = [str(c) for c in inputs["caption_text"]]
    ids, lengths = model.tokenize(texts)
    np.testing.assert_array_equal(lengths.numpy(), inputs["caption_lengths"])
    np.testing.assert_array_equal(ids.numpy(), inputs["captions"][:, : ids.shape[1]])
    with torch.no_grad():
        close(model.encode_text(texts), outputs["cap_emb"], "cap_emb from text")


def test_similarity_coding_and_every_pooling_head(chan):
    model, inputs, outputs, meta, _ = chan
    img = released_img_emb(inputs, outputs)
    txt = t(outputs["cap_emb"])
    close(model.similarity(img, txt), outputs["sims"], "sims")
    codes, words = vha_codes(img, txt)
    # the release writes -1 for the padded words' codes
    close(codes.masked_fill(~words.unsqueeze(0), -1.0), outputs["dbg_coding"], "VHA coding")
    temperature = float(meta["opt"]["belta"])
    assert model.recipe.model.similarity.lse_temperature == temperature
    heads = [k for k in outputs if k.startswith("sims_pool_")]
    assert heads
    for key in heads:
        close(pool_codes(codes, words, HEADS[key.removeprefix("sims_pool_")], temperature), outputs[key], key)


def test_similarity_of_numpy_sets_and_bad_shapes(chan):
    model, inputs, outputs, _, _ = chan
    img = released_img_emb(inputs, outputs).numpy()
    close(model.similarity(img, outputs["cap_emb"]), outputs["sims"], "sims from numpy")
    with pytest.raises(VseInputError, match="sets"):
        model.similarity(img.mean(1), outputs["cap_emb"])


def hinge(model, sims: torch.Tensor, max_violation: bool):
    cfg = model.recipe.loss
    cfg.max_violation = max_violation
    return create_loss(cfg)(sims, None, warmup=False)[0]


@pytest.mark.parametrize("suffix", ["vsepp", "sum"])
def test_loss_and_embedding_gradients(chan, suffix):
    model, inputs, outputs, meta, _ = chan
    assert model.recipe.loss.margin == float(meta["opt"]["margin"])
    img = released_img_emb(inputs, outputs).requires_grad_(True)
    txt = t(outputs["cap_emb"]).clone().requires_grad_(True)
    loss = hinge(model, model.similarity(img, txt), max_violation=suffix == "vsepp")
    loss.backward()
    close(loss, outputs[f"loss_{suffix}"], f"loss_{suffix}")
    close(img.grad, outputs[f"grad_img_emb_{suffix}"], "grad img_emb")
    close(txt.grad, outputs[f"grad_cap_emb_{suffix}"], "grad cap_emb")


def test_training_step_loss_and_every_parameter_gradient(chan):
    """One step of the training path (TrainStep: encode, score, update) on the fixture batch, after the
    warm-up epoch (hardest negatives): the loss, the gradient reaching the region input, and each parameter's
    gradient before clipping (clipping off, learning rate 0 so the weights stay)."""
    from vsekit.data.batch import Batch
    from vsekit.training.step import TrainStep

    model, inputs, outputs, _, _ = chan
    recipe = model.recipe
    recipe.optim.grad_clip = 0.0
    recipe.loss.max_violation = True
    loss_fn = create_loss(recipe.loss)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    step = TrainStep(recipe, model, loss_fn, optimizer, torch.device("cpu"))
    images = t(inputs["images"]).clone().requires_grad_(True)
    n = images.shape[0]
    batch = Batch(
        images,
        t(inputs["image_lengths"]),
        t(inputs["captions"]),
        t(inputs["caption_lengths"]),
        torch.arange(n),
        torch.arange(n),
    )
    try:
        report = step(batch, epoch=recipe.loss.warmup_epochs, step=0)
        close(report["loss"], outputs["loss_train_vsepp"], "loss_train_vsepp")
        close(images.grad, outputs["grad_images_vsepp"], "grad images")
        params = dict(model.named_parameters())
        checked = 0
        for key in (k for k in outputs if k.startswith("grad_param.")):
            released = key.removeprefix("grad_param.")
            prefix = next((p for p in PARAMS if released.startswith(p)), None)
            if prefix is None:  # txt_enc.fc: stored, never used by the forward (zero gradient)
                assert not np.any(outputs[key]), key
                continue
            grad = params[PARAMS[prefix] + released[len(prefix) :]].grad
            close(grad if grad is not None else torch.zeros(outputs[key].shape), outputs[key], key)
            checked += 1
        assert checked == len(params)  # every vsekit parameter has a released gradient to match
    finally:
        model.eval()


def test_masked_variant_is_independent_of_the_padding(chan):
    """The release's attention sees the padded rows, so wider padding changes its embeddings; the masked
    variant (selfattn_mask_padding: true) gives each image the same embedding whatever the padding."""
    model, inputs, _, _, _ = chan
    x = t(inputs["images"])
    wide = torch.cat([x, x.new_zeros(x.shape[0], 5, x.shape[2])], 1)
    lengths = t(inputs["image_lengths"])
    mask = region_mask(inputs, x.shape[1])
    enc = model.image_encoder
    with torch.no_grad():
        released_gap = (enc(x, lengths) - enc(wide, lengths)[:, : x.shape[1]])[mask].abs().max()
        enc.mask_padding = True
        try:
            masked_gap = (enc(x, lengths) - enc(wide, lengths)[:, : x.shape[1]])[mask].abs().max()
            alone = torch.stack(
                [enc(x[i : i + 1, : int(n)], lengths[i : i + 1])[0].sum() for i, n in enumerate(lengths)]
            )
            batched = torch.stack([enc(x, lengths)[i].sum() for i in range(len(lengths))])
        finally:
            enc.mask_padding = False
    assert released_gap > 1e-3
    assert masked_gap < 1e-6
    torch.testing.assert_close(alone, batched, atol=1e-5, rtol=1e-5)


def test_vse_eval_in_shards_equals_eval_sims_on_the_reference_matrix(chan, tmp_path, monkeypatch):
    """`vse eval` encodes in batches (sets padded to each batch's largest, then to the widest) and scores in
    shards bounded by [images x captions x regions x words]; with the release's padding (one batch, masked
    attention not needed) its metrics equal `vse eval-sims` on the released matrix, and the shard bound is
    honoured (forced down to single pairs here)."""
    from vsekit.similarity import pairs

    model, inputs, outputs, _, out = chan
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "test_ims.npy", inputs["images"].astype(np.float32))
    (data / "test_ims_lengths.txt").write_text("".join(f"{n}\n" for n in inputs["image_lengths"]))
    (data / "test_caps.txt").write_text("".join(f"{c}\n" for c in inputs["caption_text"]))
    (data / "test_cap2img.txt").write_text("".join(f"{i}\n" for i in range(len(inputs["caption_text"]))))
    shards = []
    real = pairs.shard_sizes

    def spy(image_emb, text_emb, image_shard, text_shard, max_values):
        sizes = real(image_emb, text_emb, image_shard, text_shard, max_values=1)
        shards.append((tuple(image_emb.shape), tuple(text_emb.shape), sizes))
        return sizes

    monkeypatch.setattr(pairs, "shard_sizes", spy)
    n = len(inputs["images"])
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
                str(n),
            ]
        )
        == 0
    )
    assert shards and shards[0][2] == (1, 1) and len(shards[0][0]) == 3
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


def test_shard_sizes_bound_the_late_interaction_work():
    """Hand-computed: sets of 36 regions x 20 words cost 720 values a pair; under 2**20 = 1,048,576 values the
    default 1000 x 5000 shards halve, the larger side first: 5000 -> 2500 -> 1250 -> 625 captions, 1000 -> 500
    images, 312, 250, 156, 125, 78, 62, 39, then 62 x 39 x 720 = 1,740,960 is still over: 31 images, and
    31 x 39 x 720 = 870,480 fits. Vectors (1 value a pair) keep the default shards."""
    from vsekit.similarity.pairs import pair_cost, shard_sizes

    img, txt = torch.zeros(3, 36, 8), torch.zeros(4, 20, 8)
    assert pair_cost(img, txt) == 720
    i, j = shard_sizes(img, txt, 1000, 5000, 2**20)
    assert (i, j) == (31, 39)
    assert shard_sizes(torch.zeros(3, 8), torch.zeros(4, 8), 1000, 5000, 2**25) == (1000, 5000)


def test_checkpoint_without_vocabulary_or_with_an_unsafe_pickle_is_refused(chan, tmp_path, capsys):
    import argparse
    import os

    folder = reference_fixture_dir("chan")
    with torch.serialization.safe_globals([argparse.Namespace]):
        ckpt = torch.load(folder / "model_best.pth", map_location="cpu", weights_only=True)
    ckpt["opt"].word2idx = None
    torch.save(ckpt, tmp_path / "novocab.pth")
    assert main(["import", "chan", str(tmp_path / "novocab.pth"), "--out", str(tmp_path / "r1")]) == 2
    assert "opt.word2idx" in capsys.readouterr().err
    vocab = sorted((folder / "vocab").glob("*.json"))
    if vocab:  # the SCAN vocabulary file gives the same run
        assert (
            main(
                [
                    "import",
                    "chan",
                    str(tmp_path / "novocab.pth"),
                    "--out",
                    str(tmp_path / "r2"),
                    "--vocab",
                    str(vocab[0]),
                ]
            )
            == 0
        )

    class Boom:
        def __reduce__(self):
            return (os.system, ("echo unsafe",))

    ckpt["opt"].word2idx = {"<pad>": Boom()}
    torch.save(ckpt, tmp_path / "unsafe.pth")
    assert main(["import", "chan", str(tmp_path / "unsafe.pth"), "--out", str(tmp_path / "r3")]) == 2
    err = capsys.readouterr().err
    assert "unsafe pickle" in err and "os.system" in err and not (tmp_path / "r3").exists()


def test_recipe_and_imported_run_settings(chan):
    model, _, _, meta, out = chan
    r = model.recipe
    assert (r.model.image.kind, r.model.similarity.name, r.model.image.selfattn_mask_padding) == (
        "selfattention",
        "chan",
        False,
    )
    assert r.model.similarity.word_pooling == HEADS[meta["opt"]["pooling_type"]]
    record = json.loads((Path(out) / "config.json").read_text())["imported_from"]
    assert sorted(record["unused_keys"]) == ["model[1].fc.bias", "model[1].fc.weight"]
    assert "word2idx" not in record["options"]


SMALL = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "train.batch_size=16",
    "train.log_every=0",
    "model.text.vocab_min_count=1",
    "model.text.tokenizer=regex",
]


@pytest.mark.slow
def test_chan_recipe_trains_resumes_exactly_and_evaluates(tiny_data, tmp_path):
    """`vse train --recipe chan` on the tiny synthetic set; a run stopped mid-epoch and resumed ends bit for bit
    as the uninterrupted one; `vse eval` scores it (the late-interaction matrix, in shards)."""
    from safetensors.torch import load_file

    from vsekit.config import load_recipe
    from vsekit.training.trainer import Trainer

    r = load_recipe("chan", SMALL + ["train.epochs=2"])
    quiet = {"progress": False, "log": lambda *_: None}
    Trainer(r, tiny_data, tmp_path / "a", **quiet).fit()
    Trainer(r, tiny_data, tmp_path / "b", **quiet).fit(max_steps=2)
    Trainer(r, tiny_data, tmp_path / "b", resume=True, **quiet).fit()
    a, b = load_file(tmp_path / "a" / "last.safetensors"), load_file(tmp_path / "b" / "last.safetensors")
    assert a.keys() == b.keys() and any(k.startswith("image_encoder.attend.") for k in a)
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert (
        main(
            [
                "train",
                "--recipe",
                "chan",
                "--data",
                str(tiny_data),
                "--out",
                str(tmp_path / "c"),
                "--epochs",
                "1",
            ]
            + [x for s in SMALL for x in ("--set", s)]
        )
        == 0
    )
    assert main(["eval", str(tmp_path / "a"), "--split", "test", "--json", str(tmp_path / "m.json")]) == 0
    m = json.loads((tmp_path / "m.json").read_text())
    assert np.isfinite(m["rsum"]) and 0 <= m["rsum"] <= 600


def test_vse_index_of_an_imported_chan_run_refuses_an_embeddings_folder_in_one_line(chan, tmp_path, capsys):
    """An embeddings folder holds one vector per picture, not a set: `vse index --from-embeddings` with a CHAN
    run says so before reading the folder (its pictures or a split are indexed instead: test_chan_search.py)."""
    _, _, _, _, out = chan
    (tmp_path / "emb").mkdir()
    argv = ["index", str(out), "--from-embeddings", str(tmp_path / "emb"), "--out", str(tmp_path / "idx")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "chan" in err and "vse index RUN_DIR SOURCE" in err
    assert not (tmp_path / "idx").exists()


def test_evaluation_pads_sets_of_batches_of_different_widths(chan, tmp_path):
    """Encoding a split in batches gives sets as wide as each batch's largest; evaluation pads them with zero
    rows to one width. With the masked attention (embeddings independent of the padding) the matrix from batches
    of different widths equals the one from a single batch, up to float rounding."""
    from vsekit.data.precomp import load_precomp_split
    from vsekit.evaluation import split_similarities

    model, inputs, _, _, _ = chan
    data = tmp_path / "data"
    data.mkdir()
    np.save(data / "test_ims.npy", inputs["images"].astype(np.float32))
    (data / "test_ims_lengths.txt").write_text("".join(f"{n}\n" for n in inputs["image_lengths"]))
    (data / "test_caps.txt").write_text("".join(f"{c}\n" for c in inputs["caption_text"]))
    (data / "test_cap2img.txt").write_text("".join(f"{i}\n" for i in range(len(inputs["caption_text"]))))
    split = load_precomp_split(data, "test", 1)
    lengths = np.asarray(inputs["image_lengths"])
    n = len(lengths)
    size = next(
        (b for b in range(1, n) if len({int(lengths[i : i + b].max()) for i in range(0, n, b)}) > 1), None
    )
    if size is None:
        pytest.skip("every batch size gives batches of one width")
    model.image_encoder.mask_padding = True
    try:
        one = split_similarities(model, split, batch_size=n)
        several = split_similarities(model, split, batch_size=size)
    finally:
        model.image_encoder.mask_padding = False
    np.testing.assert_allclose(several, one, atol=1e-5, rtol=1e-5)


def test_training_a_set_similarity_under_torchrun_is_refused_at_once():
    """Global negatives all-gather each rank's embeddings; sets of rank-dependent widths cannot be gathered, so
    the step refuses before anything is read (one process trains, as the tests above)."""
    from vsekit.config import ConfigError, load_recipe
    from vsekit.distributed import DistContext
    from vsekit.training.step_setup import check_step_setup

    r = load_recipe("chan", SMALL)
    check_step_setup(r, torch.device("cpu"))  # one process: fine
    with pytest.raises(ConfigError, match="scores sets of vectors.*torchrun"):
        check_step_setup(r, torch.device("cpu"), DistContext(rank=0, world_size=2))
