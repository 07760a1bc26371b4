"""Grid backbones: packaged EfficientNet-Lite0, torchvision and timm CNNs from local weights only.

Float comparisons: a backbone rebuilt from the saved weights runs the same ops on the same input (identical up
to atol 1e-6, which only hides nothing); pixel transforms are elementwise float32 ops on values <= 2.7 (<= 2 eps
each: atol 1e-6, 1e-5 after dividing by ImageNet's std); unit norms within 1e-5.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vsekit.config import load_recipe
from vsekit.features.backbones import build_backbone, load_state_dict_file
from vsekit.models.image import BackboneImageEncoder


def test_lite0_grid_and_stages():
    bb = build_backbone("efficientnet_lite0")
    grid = bb(torch.zeros(2, 3, 224, 224))
    assert grid.shape == (2, 1280, 7, 7) and bb.out_dim == 1280
    assert len(bb.stages) == 17  # 16 MBConv blocks + the head conv/BN
    keys = list(bb.state_dict())
    assert len(keys) == len(set(keys)) and all(k.startswith("net.") for k in keys)  # no duplicated tensors


def _saved(tmp_path, net, name="w.safetensors"):
    from safetensors.torch import save_file

    path = tmp_path / name
    save_file({k: v.contiguous() for k, v in net.state_dict().items()}, str(path))
    return path


# Two tiny CNNs written the way torchvision (children up to avgpool/fc) and timm (forward_features) write
# theirs; the `torchvision:` and `timm:` names reach the same code through `torchvision.models.<arch>` and
# `timm.create_model` (their PyPI wheels are CUDA builds that do not load beside the CPU torch used here).
CNN_MODULE = """
import torch
from torch import nn

def block(c_in, c_out):
    return nn.Sequential(nn.Conv2d(c_in, c_out, 3, 2, 1), nn.BatchNorm2d(c_out), nn.ReLU())

class ResNetLike(nn.Module):
    def __init__(self, weights=None):
        super().__init__()
        self.conv1, self.layer1, self.layer2 = block(3, 8), block(8, 16), block(16, 24)
        self.avgpool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(24, 10)
    def forward(self, x):
        return self.fc(self.avgpool(self.layer2(self.layer1(self.conv1(x)))).flatten(1))

class TimmLike(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem, self.stages = block(3, 8), nn.Sequential(block(8, 12), block(12, 20))
        self.head = nn.Linear(20, 10)
    def forward_features(self, x):
        return self.stages(self.stem(x))
    def forward(self, x):
        return self.head(self.forward_features(x).mean((2, 3)))

def resnet_like(weights=None):
    return ResNetLike()

def timm_like():
    return TimmLike()
"""


@pytest.fixture
def cnn_module(tmp_path, monkeypatch):
    (tmp_path / "tiny_cnns.py").write_text(CNN_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    return importlib.import_module("tiny_cnns")


def test_torchvision_style_cnn_from_local_weights(tmp_path, cnn_module):
    torch.manual_seed(0)
    ref = cnn_module.resnet_like().eval()
    path = _saved(tmp_path, ref)
    bb = build_backbone("python:tiny_cnns:resnet_like", str(path))
    x = torch.randn(1, 3, 64, 64)
    trunk = torch.nn.Sequential(ref.conv1, ref.layer1, ref.layer2)
    assert bb.out_dim == 24 and bb(x).shape == (1, 24, 8, 8)
    assert torch.allclose(bb(x), trunk(x), atol=1e-6)  # the loaded weights are the saved ones
    assert [id(m) for m in bb.stages] == [id(bb.net.conv1), id(bb.net.layer1), id(bb.net.layer2)]
    pth = tmp_path / "w.pth"
    torch.save(ref.state_dict(), pth)
    assert torch.allclose(build_backbone("python:tiny_cnns:resnet_like", str(pth))(x), trunk(x), atol=1e-6)


def test_timm_style_cnn_staged_unfreeze_in_the_encoder(tmp_path, cnn_module):
    path = _saved(tmp_path, cnn_module.timm_like())
    cfg = load_recipe(
        "vse_infty_grid_e2e",
        [
            "model.image.backbone=python:tiny_cnns:timm_like",
            f"model.image.backbone_weights={path}",
            "model.image.backbone_trainable_blocks=1",
        ],
    ).model.image
    enc = BackboneImageEncoder(16, cfg)
    assert enc.cnn_dim == 20
    assert not any(p.requires_grad for p in enc.cnn.parameters())
    enc.set_backbone_trainable(True)
    trainable = {n for n, p in enc.cnn.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("net.stages.") for n in trainable)  # the last stage, never the head
    out = enc.eval()(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 16) and torch.isfinite(out).all()  # pooled; the model L2-normalises it
    keys = list(enc.state_dict())
    assert len(keys) == len(set(keys))


def test_clear_errors(tmp_path, cnn_module):
    with pytest.raises(ValueError, match="unknown backbone"):
        build_backbone("resnet50")
    with pytest.raises(FileNotFoundError, match="nope.safetensors"):
        load_state_dict_file(tmp_path / "nope.safetensors")
    bad = tmp_path / "bad.pth"
    bad.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="bad.pth: not a plain state dict"):
        load_state_dict_file(bad)
    with pytest.raises(ValueError, match="needs model.image.backbone_weights"):
        build_backbone("python:tiny_cnns:resnet_like")
    with pytest.raises(ValueError, match="has no 'nothing'"):
        build_backbone("python:tiny_cnns:nothing", "w")
    other = tmp_path / "other.safetensors"
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(1)}, str(other))
    with pytest.raises(ValueError, match="does not fit python:tiny_cnns:resnet_like"):
        build_backbone("python:tiny_cnns:resnet_like", str(other))


# ------------------------------------------------------------------ each backbone's own preprocessing
# timm and torchvision resolve a model's mean/std/interpolation from its config; the fakes below stand in for
# those two libraries (not installable beside this torch build) with a non-ImageNet config, so a backbone
# that ignored its config (ImageNet mean/std, bilinear) would fail. The real libraries are checked further
# down when they are installed.
INCEPTION = {"mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5), "interpolation": "bicubic"}


def _fake_timm(monkeypatch, cnn_module, cfg=INCEPTION):
    import sys
    import types

    timm, data = types.ModuleType("timm"), types.ModuleType("timm.data")

    def create_model(name, pretrained=False):
        assert pretrained is False and name == "tiny_timm"  # nothing is ever downloaded
        net = cnn_module.timm_like()
        net.pretrained_cfg = dict(cfg)
        return net

    def resolve_data_config(args=None, pretrained_cfg=None, model=None, **_):  # timm's signature
        c = model.pretrained_cfg
        return {"input_size": (3, 224, 224), "crop_pct": 0.875, "crop_mode": "center", **c}

    timm.create_model, timm.data, data.resolve_data_config = create_model, data, resolve_data_config
    monkeypatch.setitem(sys.modules, "timm", timm)
    monkeypatch.setitem(sys.modules, "timm.data", data)


def _fake_torchvision(monkeypatch, cnn_module):
    import enum
    import sys
    import types

    class InterpolationMode(enum.Enum):  # torchvision.transforms.InterpolationMode
        BICUBIC = "bicubic"

    class ResNetLikeWeights:
        DEFAULT = types.SimpleNamespace(
            transforms=lambda: types.SimpleNamespace(
                mean=[0.48145466, 0.4578275, 0.40821073],
                std=[0.26862954, 0.26130258, 0.27577711],
                interpolation=InterpolationMode.BICUBIC,
                crop_size=[224],
                resize_size=[232],
            )
        )

    def get_model_weights(name):
        if name == "resnet_like":
            return ResNetLikeWeights
        raise ValueError(f"Unknown model {name}")

    tv, models = types.ModuleType("torchvision"), types.ModuleType("torchvision.models")
    models.resnet_like = models.no_weights_enum = cnn_module.resnet_like
    models.get_model_weights = get_model_weights
    tv.models = models
    monkeypatch.setitem(sys.modules, "torchvision", tv)
    monkeypatch.setitem(sys.modules, "torchvision.models", models)


def _ramp_picture():
    from PIL import Image

    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (12, 10, 3), dtype=np.uint8))


def test_lite0_keeps_imagenet_bilinear():
    from vsekit.features.backbones import IMAGENET_TRANSFORM

    t = build_backbone("efficientnet_lite0").pixel_transform
    assert t == IMAGENET_TRANSFORM
    assert (t.mean, t.std, t.interpolation) == ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "bilinear")


def test_timm_backbone_takes_its_data_config(tmp_path, cnn_module, monkeypatch):
    _fake_timm(monkeypatch, cnn_module)
    path = _saved(tmp_path, cnn_module.timm_like())
    bb = build_backbone("timm:tiny_timm", str(path))
    t = bb.pixel_transform
    assert (t.mean, t.std, t.interpolation) == ((0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "bicubic")
    assert "timm tiny_timm" in t.source


def test_torchvision_backbone_takes_its_weights_transforms(tmp_path, cnn_module, monkeypatch):
    _fake_torchvision(monkeypatch, cnn_module)
    path = _saved(tmp_path, cnn_module.resnet_like())
    t = build_backbone("torchvision:resnet_like", str(path)).pixel_transform
    assert t.mean == (0.48145466, 0.4578275, 0.40821073) and t.std == (0.26862954, 0.26130258, 0.27577711)
    assert t.interpolation == "bicubic"  # the enum's value
    fallback = build_backbone("torchvision:no_weights_enum", str(path)).pixel_transform
    assert (fallback.mean, fallback.interpolation) == ((0.485, 0.456, 0.406), "bilinear")
    assert "no torchvision weights transforms for no_weights_enum" in fallback.source


def test_python_factory_with_a_pretrained_cfg(tmp_path, cnn_module, monkeypatch):
    net = cnn_module.timm_like()
    path = _saved(tmp_path, net)

    def with_cfg():
        m = cnn_module.timm_like()
        m.pretrained_cfg = {"mean": (0.1, 0.2, 0.3), "std": (0.4, 0.5, 0.6), "interpolation": "nearest"}
        return m

    monkeypatch.setattr(cnn_module, "timm_like_cfg", with_cfg, raising=False)
    t = build_backbone("python:tiny_cnns:timm_like_cfg", str(path)).pixel_transform
    assert (t.mean, t.std, t.interpolation) == ((0.1, 0.2, 0.3), (0.4, 0.5, 0.6), "nearest")
    assert (
        build_backbone("python:tiny_cnns:timm_like", str(path)).pixel_transform.source == "ImageNet default"
    )


def test_pixels_follow_the_backbone_transform_everywhere(tmp_path, cnn_module, monkeypatch):
    """Training, evaluation, `vse index` and `vsekit.load(...).preprocess` all prepare pictures with the
    backbone's own transform: mean/std and the resize filter."""
    import types

    from PIL import Image

    from vsekit.api import preprocess
    from vsekit.data.raw_images import PixelSource, RawSplit, load_pixels
    from vsekit.evaluation import image_source_for
    from vsekit.models.vse import DataSpec, VSEModel
    from vsekit.search.encode import ImageEmbedder, backbone_pixels
    from vsekit.training.trainer import Trainer

    _fake_timm(monkeypatch, cnn_module)
    path = _saved(tmp_path, cnn_module.timm_like())
    recipe = load_recipe(
        "vse_infty_grid_e2e",
        [
            "model.image.backbone=timm:tiny_timm",
            f"model.image.backbone_weights={path}",
            "model.image.image_size=32",
            "model.embed_dim=16",
        ],
    )
    model = VSEModel(recipe, DataSpec(img_dim=0, vocab_words=["<pad>", "<start>", "<end>", "<unk>", "a"]))
    transform = model.image_encoder.cnn.pixel_transform
    assert transform.interpolation == "bicubic"

    # the transform by hand: a flat colour normalises to ((v / 255) - 0.5) / 0.5, whatever the filter
    flat = Image.new("RGB", (7, 5), (255, 0, 51))
    got = backbone_pixels(flat, 32, transform)
    np.testing.assert_allclose(got[:, 0, 0].numpy(), [1.0, -1.0, -0.6], atol=1e-6)
    # the filter: PIL's bicubic resize, not the bilinear one
    pic = _ramp_picture()
    expect = (np.asarray(pic.resize((32, 32), Image.Resampling.BICUBIC), np.float32) / 255 - 0.5) / 0.5
    bilinear = (np.asarray(pic.resize((32, 32), Image.Resampling.BILINEAR), np.float32) / 255 - 0.5) / 0.5
    assert np.abs(expect - bilinear).max() > 0.05  # the two filters differ on this picture
    np.testing.assert_allclose(
        backbone_pixels(pic, 32, transform).numpy(), expect.transpose(2, 0, 1), atol=1e-6
    )

    pic.save(tmp_path / "p.png")
    split = RawSplit(tmp_path, "test", ["a"], np.array([0]), ["p.png"], ["0"])
    for source in (
        image_source_for(model, split),
        Trainer._image_source(types.SimpleNamespace(recipe=recipe, model=model), split, False),
    ):
        assert isinstance(source, PixelSource) and source.transform == transform
        np.testing.assert_allclose(source.load(0, None).numpy(), expect.transpose(2, 0, 1), atol=1e-6)
    np.testing.assert_allclose(
        ImageEmbedder(model, {}).load(tmp_path / "p.png").numpy(), expect.transpose(2, 0, 1), atol=1e-6
    )
    np.testing.assert_allclose(preprocess(model, pic).numpy(), expect.transpose(2, 0, 1), atol=1e-6)
    assert ImageEmbedder(model, {}).describe()["transform"]["interpolation"] == "bicubic"
    # without a transform (the default): ImageNet mean/std, bilinear, as before
    imagenet = (
        np.asarray(pic.resize((32, 32), Image.Resampling.BILINEAR), np.float32) / 255
        - np.array([0.485, 0.456, 0.406], np.float32)
    ) / np.array([0.229, 0.224, 0.225], np.float32)
    np.testing.assert_allclose(
        load_pixels(tmp_path / "p.png", 32, None).numpy(), imagenet.transpose(2, 0, 1), atol=1e-5
    )


def test_bad_transforms_are_refused():
    from vsekit.features.backbones import PixelTransform

    with pytest.raises(ValueError, match="interpolation 'random'"):
        PixelTransform(interpolation="random")
    with pytest.raises(ValueError, match="3 means and 3 positive stds"):
        PixelTransform(std=(0.2, 0.0, 0.2))


def test_real_timm_backbone_uses_its_data_config(tmp_path):
    timm = pytest.importorskip(
        "timm", reason="timm is not installed (pip install timm beside a matching torchvision)"
    )
    net = timm.create_model("resnet10t", pretrained=False)
    path = _saved(tmp_path, net)
    cfg = timm.data.resolve_data_config({}, model=net)
    t = build_backbone("timm:resnet10t", str(path)).pixel_transform
    assert t.mean == pytest.approx(tuple(cfg["mean"])) and t.std == pytest.approx(tuple(cfg["std"]))
    assert t.interpolation == cfg["interpolation"]


def test_real_torchvision_backbone_uses_its_weights_transforms(tmp_path):
    try:
        import torchvision.models as tvm
    except Exception as e:  # noqa: BLE001 - PyPI's torchvision fails to import beside a torch build it was not made for
        pytest.skip(f"torchvision does not import here ({type(e).__name__})")
    path = _saved(tmp_path, tvm.mobilenet_v3_small(weights=None))
    ref = tvm.get_model_weights("mobilenet_v3_small").DEFAULT.transforms()
    t = build_backbone("torchvision:mobilenet_v3_small", str(path)).pixel_transform
    assert t.mean == pytest.approx(tuple(ref.mean)) and t.std == pytest.approx(tuple(ref.std))
    assert t.interpolation == ref.interpolation.value
