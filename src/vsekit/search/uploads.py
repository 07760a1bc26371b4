"""A picture uploaded to `vse serve` -> a small PIL image, never decoding more than a fixed memory budget.

A query picture is read by the model at its input size (224 px for the models here), so an upload is
decoded only as large as it must be: a JPEG at 1/2, 1/4 or 1/8 scale when it is larger than twice the input
side (libjpeg's DCT scaling: the full-size pixels never exist), any other format at its own size and then
reduced, strip by strip, to no less than twice the input side. Before any pixel is decoded, the header
says how many bytes decoding will take (per format and mode); more than UPLOAD_DECODE_BYTES is refused.
The format is told from the header bytes before any PIL plugin reads them, and must be one of
`vsekit.data.pictures.PICTURE_FORMATS` (the one list, shared with the builders and `vse index`); the
metadata is bounded by the same scan as every picture's. The content type is checked too: a cross-site
form post can only send text, form or multipart bodies without a CORS preflight, and a picture is none of
them.
"""

from __future__ import annotations

import io
import logging
import math
from pathlib import Path

from PIL import Image, UnidentifiedImageError

from vsekit.data.pictures import (
    MAX_IMAGE_PIXELS,
    PICTURE_FORMATS,
    PictureFormatError,
    PixelLimitError,
    check_pixels,
    open_bounded,
)
from vsekit.data.untrusted import MAX_PICTURE_BYTES, UntrustedFileError, read_bounded
from vsekit.errors import VseInputError

logger = logging.getLogger(__name__)

UPLOAD_DECODE_BYTES = 64 << 20  # what decoding one upload may allocate: a 4096x4096 RGBA PNG
UPLOAD_TYPES = ("image/", "application/octet-stream")  # and no Content-Type at all (a bare HTTP client)
REDUCE_GAP = 2  # keep at least twice the model's input side, as PIL's own `reducing_gap=2` does
STRIP_PIXELS = 1 << 20  # reduce this many pixels at a time: the converted copy stays small

MB = 1 << 20

_REDUCIBLE = (
    "L",
    "LA",
    "RGB",
    "RGBA",
    "RGBX",
    "CMYK",
    "YCbCr",
    "I",
    "F",
)  # modes Image.reduce averages right
_WEBP_COPIES = 4  # libwebp's canvas and previous canvas, the frame bytes PIL copies, PIL's own image


class UploadRefused(VseInputError):
    """An upload that is not decoded; `status` is the HTTP status that says why (400, 413 or 415)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def content_type_problem(content_type: str | None) -> str | None:
    """Why a request body with this Content-Type is not taken as a picture, or None (image/*, octet-stream,
    or none at all)."""
    if content_type is None:
        return None
    kind = content_type.split(";", 1)[0].strip().lower()
    if kind.startswith(UPLOAD_TYPES[0]) or kind == UPLOAD_TYPES[1]:
        return None
    return (
        f"the body is sent as {kind[:60] or 'an empty Content-Type'!r}; send the picture's own bytes with "
        "Content-Type image/png, image/jpeg, image/webp, image/gif or image/bmp "
        "(curl: --data-binary @q.png -H 'Content-Type: image/png')"
    )


def pixel_bytes(im: Image.Image) -> int:
    """Bytes PIL and the format's decoder allocate for `im`'s pixels (opened, after any draft), read from its
    header: PIL keeps 1 byte per pixel for "1", "L" and "P", 2 for 16-bit grey, 4 for every other mode (RGB
    included); the WebP decoder holds frame copies of its own; BMP's RLE decoder (Python) builds two copies
    of a palette picture before PIL's, so a BMP counts 4 bytes a pixel whatever its mode."""
    pixels = im.width * im.height
    if im.format == "WEBP":
        return pixels * 4 * _WEBP_COPIES
    if im.mode in ("1", "L", "P") and im.format != "BMP":
        return pixels
    return pixels * (2 if im.mode.startswith("I;16") else 4)


def jpeg_coefficient_bytes(im: Image.Image) -> int:
    """The coefficient buffers libjpeg holds for a progressive JPEG (call before `draft`): 2 bytes per sample
    of every component at full size, chroma subsampling read from the header (`im.layer`), whatever the
    output scale."""
    layers = getattr(im, "layer", None) or [(None, 1, 1, 0)] * len(im.getbands())
    hmax = max(lay[1] for lay in layers) or 1
    vmax = max(lay[2] for lay in layers) or 1
    blocks = sum(
        math.ceil(im.width * lay[1] / hmax / 8) * math.ceil(im.height * lay[2] / vmax / 8) for lay in layers
    )
    return blocks * 64 * 2


def reduce_factor(size: tuple[int, int], min_side: int) -> int:
    """The largest integer factor that keeps both sides at least `min_side` (1 when none does)."""
    return max(1, min(size[0] // max(1, min_side), size[1] // max(1, min_side)))


def reduce_by_strips(im: Image.Image, factor: int) -> Image.Image:
    """`im.reduce(factor)` (box average of factor x factor blocks) computed a strip of rows at a time, so the
    converted copies that `reduce` and palette modes need stay small. Palette pictures become RGB(A), 16-bit
    grey becomes 32-bit "I" (modes `reduce` cannot average)."""
    if im.mode in _REDUCIBLE:
        mode = im.mode
    elif im.mode in ("P", "PA"):
        mode = "RGBA" if im.mode == "PA" or "transparency" in im.info else "RGB"
    elif im.mode.startswith("I;16"):
        mode = "I"
    else:
        mode = "RGBA" if "A" in im.getbands() else ("L" if len(im.getbands()) == 1 else "RGB")
    if factor <= 1:
        return im if im.mode == mode else im.convert(mode)
    w, h = im.size
    out = Image.new(mode, (math.ceil(w / factor), math.ceil(h / factor)))
    rows = max(1, STRIP_PIXELS // (w * factor)) * factor
    for y in range(0, h, rows):
        part = im.crop((0, y, w, min(h, y + rows)))
        if part.mode != mode:
            part = part.convert(mode)
        out.paste(part.reduce(factor), (0, y // factor))
    return out


def decode_reduced(
    source: bytes | str | Path,
    input_px: int = 224,
    max_bytes: int = UPLOAD_DECODE_BYTES,
) -> Image.Image:
    """A picture (an upload's bytes, or the file of an indexed picture, read with the MAX_PICTURE_BYTES cap) as
    a PIL image no smaller than `REDUCE_GAP * input_px` per side where it was larger; `UploadRefused` before
    any pixel is decoded when it is unreadable (400), not one of PICTURE_FORMATS by its header bytes (415;
    no other PIL plugin sees it) or too large to decode within `max_bytes`, by its pixels or its metadata
    (413)."""
    min_side = REDUCE_GAP * input_px
    if not isinstance(source, (bytes, bytearray)):
        try:
            source = read_bounded(
                Path(source), MAX_PICTURE_BYTES, follow_symlinks=True, expected="a picture file"
            )
        except UntrustedFileError as e:
            raise UploadRefused(400, e.detail) from None
    kinds = ", ".join(sorted(set(PICTURE_FORMATS.values())))
    try:
        with open_bounded(io.BytesIO(source), "the upload") as im:
            if im.format not in PICTURE_FORMATS:  # the reader of a sniffed format returned another
                raise UploadRefused(415, f"the picture is {im.format}; uploads may be {kinds}")
            try:
                w, h = check_pixels(im, "the upload")
            except PixelLimitError as e:
                raise UploadRefused(413, f"the picture has {e.detail}") from None
            need = 0
            if im.format in ("JPEG", "MPO"):
                if im.info.get("progressive"):
                    need = jpeg_coefficient_bytes(im)  # kept at full size whatever the scale
                im.draft("RGB", (min_side, min_side))  # decode at 1/2, 1/4 or 1/8 scale when that is enough
            need += pixel_bytes(im)
            if need > max_bytes:
                raise UploadRefused(
                    413,
                    f"the picture has {w}x{h} pixels: decoding it would take {math.ceil(need / MB)} MB, "
                    f"more than the {max_bytes // MB} MB an upload may take (a 4096x4096 PNG fits; "
                    "a larger JPEG is decoded at a smaller scale); scale it down",
                )
            im.load()
            logger.debug("upload %dx%d %s decoded at %dx%d", w, h, im.format, *im.size)
            return reduce_by_strips(im, reduce_factor(im.size, min_side))
    except UploadRefused:
        raise
    except PictureFormatError as e:
        if e.kind is None:
            raise UploadRefused(400, f"the body is not a readable picture ({kinds})") from None
        raise UploadRefused(
            415, f"the picture is {e.kind.removesuffix(' file')}; uploads may be {kinds}"
        ) from None
    except PixelLimitError as e:  # its metadata is beyond the bounds every picture is read within
        raise UploadRefused(413, f"the picture has {e.detail}") from None
    except Image.DecompressionBombError:  # beyond PIL's own limit: refused before decoding, no warning
        raise UploadRefused(413, f"the picture has more than {MAX_IMAGE_PIXELS} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError):
        raise UploadRefused(400, f"the body is not a readable picture ({kinds})") from None
