"""Grid backbones: packaged EfficientNet-Lite0, torchvision and timm CNNs from local weights only."""

from __future__ import annotations

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
    cfg = load_recipe("vse_infty_grid_e2e", [
        "model.image.backbone=python:tiny_cnns:timm_like", f"model.image.backbone_weights={path}",
        "model.image.backbone_trainable_blocks=1",
    ]).model.image  # fmt: skip
    enc = BackboneImageEncoder(16, cfg)
    assert enc.cnn_dim == 20
    assert not any(p.requires_grad for p in enc.cnn.parameters())
    enc.set_backbone_trainable(True)
    trainable = {n for n, p in enc.cnn.named_parameters() if p.requires_grad}
    assert trainable and all(n.startswith("net.stages.") for n in trainable)  # the last stage, never the head
    out = enc.eval()(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 16) and torch.allclose(out.norm(dim=-1), torch.ones(2), atol=1e-5)
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
