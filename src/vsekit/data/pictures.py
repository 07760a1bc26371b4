"""Pictures from disk as the models see them: the one pixel rule (`check_pixels`: width x height from the
header, at most MAX_IMAGE_PIXELS, before any pixel is decoded), the one bounded reader and decoder
(`open_image`, `decode_bounded`: refusals named like an unreadable picture), and the pixel transform of a
pixel run (alpha on white, then the backbone's resize and mean/std). Shared by training from pixels,
`vse data show`, the builders, `vsekit.load(run).preprocess`, search and the CLIP_benchmark adapter."""

from __future__ import annotations

import io
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vsekit.data.precomp import DataFormatError
from vsekit.data.untrusted import MAX_PICTURE_BYTES, UntrustedFileError, read_bounded

MAX_IMAGE_PIXELS = 64_000_000  # refuse decompression bombs before decoding


class PixelLimitError(DataFormatError):
    """A picture whose header declares more than MAX_IMAGE_PIXELS pixels, refused before any pixel is decoded.
    `detail` is the reason without the file's name (for readers that report name and reason apart)."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message

    def __reduce__(self):  # picklable with its detail (DataLoader workers hand errors back)
        return type(self), (str(self), self.detail)


_OPEN_LOCK = threading.Lock()  # warnings.catch_warnings swaps process-wide state: one opener at a time


def open_bounded(fp) -> Image.Image:
    """`Image.open` (the header only: cheap) with PIL's DecompressionBombWarning — a picture larger than PIL's
    own limit (about 89M pixels), which PIL would print to stderr and then decode — raised as
    `Image.DecompressionBombError` instead, so callers refuse it like any picture over MAX_IMAGE_PIXELS."""
    with _OPEN_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            return Image.open(fp)
        except Image.DecompressionBombWarning as e:
            raise Image.DecompressionBombError(str(e)) from None


def open_image(path: str | Path) -> Image.Image:
    """Decode a picture file fully (so errors surface here, naming the file): read by `untrusted.read_bounded`
    (a regular file, at most MAX_PICTURE_BYTES; a FIFO or device is refused, never waited on), then decoded
    by `decode_bounded`. Any refusal is a DataFormatError, so the picture is skipped and reported like an
    unreadable one. A symbolic link at `path` is followed: the caller names a path it trusts (one the user
    typed, or one `untrusted.resolve_inside` checked)."""
    path = Path(path)
    try:
        data = read_bounded(path, MAX_PICTURE_BYTES, follow_symlinks=True, expected="a picture file")
    except UntrustedFileError as e:
        raise DataFormatError(f"{path}: {e.detail}") from None
    except OSError as e:
        raise DataFormatError(f"{path}: cannot read image ({e.strerror or e})") from e
    return decode_bounded(io.BytesIO(data), str(path))


@contextmanager
def _header_of(fp, name: str) -> Iterator[Image.Image]:
    """`open_bounded(fp)` (the header only), with every PIL error raised here or in the caller's block turned
    into a DataFormatError naming `name`; a picture beyond PIL's own limit is a PixelLimitError."""
    try:
        with open_bounded(fp) as im:
            yield im
    except DataFormatError:
        raise
    except Image.DecompressionBombError as e:
        detail = f"larger than the {MAX_IMAGE_PIXELS} pixel limit ({e}); not decoded"
        raise PixelLimitError(f"{name}: {detail}", detail) from None
    except (
        Image.UnidentifiedImageError
    ):  # PIL's own message names the file object (`<_io.BytesIO object at …>`)
        raise DataFormatError(f"{name}: cannot read image (not a picture in a format PIL reads)") from None
    except (OSError, ValueError, SyntaxError, EOFError) as e:
        raise DataFormatError(f"{name}: cannot read image ({str(e).replace(repr(fp), name)})") from e


def check_pixels(fp_or_image, name: str) -> tuple[int, int]:
    """(width, height) of a picture, known from its header alone, when width x height is at most
    MAX_IMAGE_PIXELS; else a PixelLimitError naming `name`. The one place of the pixel rule: nothing is
    decoded here, so a bomb costs only its header. Takes a picture `open_bounded` opened (not yet loaded) or
    a binary file object (opened here; a header PIL cannot read is a DataFormatError naming `name`)."""
    if not isinstance(fp_or_image, Image.Image):
        with _header_of(fp_or_image, name) as im:
            return check_pixels(im, name)
    width, height = fp_or_image.size
    if width * height > MAX_IMAGE_PIXELS:
        detail = f"{width}x{height} pixels is larger than the {MAX_IMAGE_PIXELS} limit; not decoded"
        raise PixelLimitError(f"{name}: {detail}", detail)
    return width, height


def decode_bounded(fp, name: str) -> Image.Image:
    """A picture from a binary file object (a file's or a tar member's bytes, already read with a byte cap) or
    a trusted path: the header is read first and checked by `check_pixels` before any pixel is decoded;
    every error is a DataFormatError naming `name` (never PIL's file-object repr)."""
    with _header_of(fp, name) as im:
        check_pixels(im, name)
        im.load()
        return im.copy()


_RESAMPLE = {
    "nearest": Image.Resampling.NEAREST,
    "nearest-exact": Image.Resampling.NEAREST,
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "box": Image.Resampling.BOX,
    "hamming": Image.Resampling.HAMMING,
    "lanczos": Image.Resampling.LANCZOS,
}


def on_white(img: Image.Image) -> Image.Image:
    """The picture as RGB, transparent parts composited on white (how every pixel path sees alpha)."""
    if img.mode in ("RGBA", "LA", "P"):
        img = img.convert("RGBA")
        bg = Image.new("RGBA", img.size, (255, 255, 255, 255))
        img = Image.alpha_composite(bg, img)
    return img.convert("RGB")


def to_pixels(im: Image.Image, size: int, transform=None) -> torch.Tensor:
    """An RGB picture -> [3, size, size] float tensor: resized with the backbone's `PixelTransform` filter,
    then normalised with its mean/std (ImageNet's with bilinear resizing when None)."""
    if transform is None:
        from vsekit.features.backbones import IMAGENET_TRANSFORM

        transform = IMAGENET_TRANSFORM
    im = im.resize((size, size), _RESAMPLE[transform.interpolation])
    mean, std = np.asarray(transform.mean, np.float32), np.asarray(transform.std, np.float32)
    arr = (np.asarray(im, dtype=np.float32) / 255.0 - mean) / std
    return torch.from_numpy(arr.transpose(2, 0, 1).copy())


def backbone_pixels(img: Image.Image, size: int, transform=None) -> torch.Tensor:
    """The evaluation-time input of a pixel backbone (as `vsekit.data.raw_images.load_pixels` without
    augmentation): alpha on white, then the backbone's `PixelTransform` (ImageNet's when None)."""
    return to_pixels(on_white(img), size, transform)
