"""Pictures from disk as the models see them: the one list of picture formats vsekit decodes
(`PICTURE_FORMATS`, told from the header bytes before PIL is involved: no other PIL plugin ever sees a file),
the bounds on a picture's metadata (APPn / COM segments of a JPEG, ancillary chunks of a PNG, extension blocks
of a GIF: scanned from the bytes before PIL parses them), the one pixel rule (`check_pixels`: width x height
from the header, at most MAX_IMAGE_PIXELS, before any pixel is decoded), the one bounded reader and decoder
(`open_image`, `decode_bounded`: refusals named like an unreadable picture), and the pixel transform of a
pixel run (alpha on white, then the backbone's resize and mean/std). Shared by training from pixels,
`vse data show`, the builders, `vse index`, the server's uploads, `vsekit.load(run).preprocess`, search and the
CLIP_benchmark adapter."""

from __future__ import annotations

import io
import logging
import re
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image

from vsekit.data.precomp import DataFormatError
from vsekit.data.untrusted import MAX_PICTURE_BYTES, UntrustedFileError, read_bounded

log = logging.getLogger(__name__)

MAX_IMAGE_PIXELS = 64_000_000  # refuse decompression bombs before decoding

# The picture formats vsekit decodes (PIL's format name -> the name messages use), everywhere: the builders,
# `vse index`, training from pixels, `vse data show` and the server's uploads. Every other PIL plugin (EPS runs
# Ghostscript; ICO, ICNS, PSD, XPM, PCX, SGI ... parse or decode inside `Image.open`) is never handed a file.
PICTURE_FORMATS: dict[str, str] = {
    "PNG": "PNG",
    "JPEG": "JPEG",
    "MPO": "JPEG",  # a JPEG with more frames (cameras' multi-picture files): PIL's JPEG reader returns it
    "WEBP": "WebP",
    "GIF": "GIF",
    "BMP": "BMP",
}
PICTURE_FORMAT_NAMES = ", ".join(dict.fromkeys(PICTURE_FORMATS.values()))  # "PNG, JPEG, WebP, GIF, BMP"
# the file name suffixes a folder walk takes as pictures: those of PICTURE_FORMATS (the bytes decide in the end)
PICTURE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp", ".gif", ".bmp")

# Metadata a picture may carry, checked from the bytes before PIL parses them (PIL keeps every segment in
# Python; thousands of them cost minutes and hundreds of MB): far above any camera's or editor's.
MAX_METADATA_SEGMENTS = 64  # JPEG APPn / COM segments, PNG ancillary chunks, GIF extension blocks
MAX_METADATA_BYTES = 16 << 20  # their bytes together
MAX_JPEG_SEGMENTS = 256  # every marker segment before a JPEG's first scan (a photo has about 10 to 30)
MAX_STRAY_BYTES = 1 << 16  # fill or stray bytes between a JPEG's segments (PIL skips them one at a time)
MAX_PNG_CHUNKS = 1 << 16  # chunks of a PNG, IDAT included (a 128 MiB picture in 2 KiB chunks)
MAX_GIF_SUBBLOCKS = 1 << 16  # data sub-blocks of a GIF's extensions before its first frame (16 MiB / 255)

_SIGNATURES = (  # (PIL format, test of the first 16 bytes): each format's own magic number
    ("PNG", lambda h: h[:8] == b"\x89PNG\r\n\x1a\n"),
    ("JPEG", lambda h: h[:3] == b"\xff\xd8\xff"),
    ("WEBP", lambda h: h[:4] == b"RIFF" and h[8:12] == b"WEBP"),
    ("GIF", lambda h: h[:6] in (b"GIF87a", b"GIF89a")),
    ("BMP", lambda h: h[:2] == b"BM"),
)
_OTHER_KINDS = (  # files PIL has no reader for, named by their magic numbers
    (lambda h: h[:5] == b"%PDF-", "a PDF document"),
    (lambda h: h[4:8] == b"ftyp", "an ISO media file (HEIF, AVIF or a video)"),
    (lambda h: h.lstrip()[:5] in (b"<?xml", b"<svg ", b"<svg>", b"<!DOC"), "an SVG, XML or HTML document"),
    (lambda h: h[:4] == b"PK\x03\x04", "a ZIP archive"),
    (lambda h: h[:2] == b"\x1f\x8b", "a gzip file"),
    (lambda h: h[:11] == b"Image type:", "an IM file"),  # PIL's IM reader has no test of its own
)
_HEAD_BYTES = 16  # what PIL's own format tests read


class PixelLimitError(DataFormatError):
    """A picture whose header declares more than MAX_IMAGE_PIXELS pixels, refused before any pixel is decoded.
    `detail` is the reason without the file's name (for readers that report name and reason apart)."""

    def __init__(self, message: str, detail: str = "") -> None:
        super().__init__(message)
        self.detail = detail or message

    def __reduce__(self):  # picklable with its detail (DataLoader workers hand errors back)
        return type(self), (str(self), self.detail)


class PictureFormatError(DataFormatError):
    """A file that is not one of PICTURE_FORMATS (by its header bytes), never handed to a PIL plugin. `kind`
    names what it is ("an EPS file", "a PDF document") or is None when nothing recognises it; `detail` is the
    reason without the file's name."""

    def __init__(self, message: str, detail: str = "", kind: str | None = None) -> None:
        super().__init__(message)
        self.detail = detail or message
        self.kind = kind

    def __reduce__(self):
        return type(self), (str(self), self.detail, self.kind)


class MetadataLimitError(PixelLimitError):
    """A picture carrying more metadata segments or bytes than MAX_METADATA_SEGMENTS / MAX_METADATA_BYTES (or
    more structure than the MAX_JPEG_SEGMENTS / MAX_PNG_CHUNKS / MAX_GIF_SUBBLOCKS / MAX_STRAY_BYTES bounds),
    refused from a scan of its bytes before PIL parses it: a picture too costly to open, like one of too many
    pixels."""


def _article(kind: str) -> str:
    return "an" if kind[:1] in "AEFHILMNORSX" else "a"


def other_kind(head: bytes) -> str | None:
    """What a file that is not one of PICTURE_FORMATS is, from its first bytes ("an EPS file", "a PDF
    document"), or None. PIL's own format tests are asked (pure checks of the bytes: no plugin opens it)."""
    for test, kind in _OTHER_KINDS:
        if test(head):
            return kind
    Image.init()
    for fmt in Image.ID:
        accept = Image.OPEN[fmt][1]
        try:
            if fmt not in PICTURE_FORMATS and accept is not None and accept(head[:_HEAD_BYTES]):
                return f"{_article(fmt)} {fmt} file"
        except Exception:  # noqa: BLE001 - a test that cannot read these bytes does not recognise them
            continue
    return None


def sniff_format(fp: BinaryIO, name: str) -> str:
    """The PIL format (one of PICTURE_FORMATS) of the picture whose bytes start at `fp`'s position, told from
    its magic number, its metadata bounded by `check_metadata`; `fp` is left where it was. Anything else is a
    PictureFormatError naming `name` and what the file is, so no other PIL plugin ever reads it."""
    start = fp.tell()
    try:
        head = fp.read(64)
        fmt = next((f for f, test in _SIGNATURES if test(head)), None)
        if fmt is None:
            kind = other_kind(head)
            if kind is None:
                detail = f"cannot read image (not a picture in a format vsekit reads: {PICTURE_FORMAT_NAMES})"
            else:
                detail = f"{kind}, not a picture format vsekit reads ({PICTURE_FORMAT_NAMES})"
            raise PictureFormatError(f"{name}: {detail}", detail, kind)
        fp.seek(start)
        check_metadata(fp, fmt, name)
        return fmt
    finally:
        fp.seek(start)


def _refuse(name: str, detail: str) -> MetadataLimitError:
    return MetadataLimitError(f"{name}: {detail}; not decoded", f"{detail}; not decoded")


def _count_metadata(name: str, what: str, count: int, nbytes: int) -> None:
    if count > MAX_METADATA_SEGMENTS:
        raise _refuse(
            name, f"more than {MAX_METADATA_SEGMENTS} metadata {what}, the most a picture may carry"
        )
    if nbytes > MAX_METADATA_BYTES:
        raise _refuse(
            name, f"metadata {what} of more than {MAX_METADATA_BYTES >> 20} MiB, the most a picture may carry"
        )


def _scan_jpeg(fp: BinaryIO, name: str) -> None:
    """JPEG marker segments from SOI to the first scan (SOS), skipped by their lengths: APPn / COM bounded
    in count and bytes, all segments by MAX_JPEG_SEGMENTS, bytes between them by MAX_STRAY_BYTES. A
    structure cut short is left to the decoder, which names it."""
    fp.read(2)
    segments = meta = meta_bytes = stray = 0
    while True:
        b = fp.read(1)
        while b and b != b"\xff":  # stray bytes before a marker
            stray += 1
            if stray > MAX_STRAY_BYTES:
                raise _refuse(name, f"more than {MAX_STRAY_BYTES} stray bytes between its JPEG segments")
            b = fp.read(1)
        m = fp.read(1)
        while m == b"\xff":  # fill bytes
            stray += 1
            if stray > MAX_STRAY_BYTES:
                raise _refuse(name, f"more than {MAX_STRAY_BYTES} stray bytes between its JPEG segments")
            m = fp.read(1)
        if not b or not m or m[0] in (0xD9, 0xDA):  # the end, end of image, start of scan
            return
        segments += 1
        if segments > MAX_JPEG_SEGMENTS:
            raise _refuse(name, f"more than {MAX_JPEG_SEGMENTS} JPEG segments before its picture data")
        if m[0] in (0x00, 0x01) or 0xD0 <= m[0] <= 0xD8:  # no length follows
            continue
        raw = fp.read(2)
        if len(raw) < 2 or int.from_bytes(raw, "big") < 2:
            return
        length = int.from_bytes(raw, "big") - 2
        if 0xE0 <= m[0] <= 0xEF or m[0] == 0xFE:  # APP0..APP15, COM
            meta += 1
            meta_bytes += length
            _count_metadata(name, "segments (JPEG APPn / COM)", meta, meta_bytes)
        fp.seek(length, io.SEEK_CUR)


_PNG_IMAGE_CHUNKS = (b"IHDR", b"PLTE", b"IDAT", b"IEND", b"acTL", b"fcTL", b"fdAT")


def _scan_png(fp: BinaryIO, name: str) -> None:
    """PNG chunks from the signature to IEND (PIL reads ancillary chunks after the image data too), skipped by
    their lengths: ancillary chunks (text, profiles, Exif; not the animation's) bounded in count and bytes,
    all chunks by MAX_PNG_CHUNKS."""
    start = fp.tell()
    end = fp.seek(0, io.SEEK_END)
    fp.seek(start + 8)
    chunks = meta = meta_bytes = 0
    while True:
        head = fp.read(8)
        if len(head) < 8 or head[4:8] == b"IEND":
            return
        length = int.from_bytes(head[:4], "big")
        if fp.tell() + length + 4 > end:  # cut short or not a chunk: the decoder names the problem
            return
        chunks += 1
        if chunks > MAX_PNG_CHUNKS:
            raise _refuse(name, f"more than {MAX_PNG_CHUNKS} PNG chunks")
        if head[4:8] not in _PNG_IMAGE_CHUNKS:
            meta += 1
            meta_bytes += length
            _count_metadata(name, "chunks (PNG ancillary)", meta, meta_bytes)
        fp.seek(length + 4, io.SEEK_CUR)


def _scan_gif(fp: BinaryIO, name: str) -> None:
    """GIF blocks from the header to the first frame (what `Image.open` reads): extension blocks other than
    graphic control bounded in count and bytes, their data sub-blocks by MAX_GIF_SUBBLOCKS."""
    head = fp.read(13)
    if len(head) < 13:
        return
    if head[10] & 0x80:  # a global colour table
        fp.seek(3 << ((head[10] & 7) + 1), io.SEEK_CUR)
    meta = meta_bytes = subblocks = 0
    while True:
        b = fp.read(1)
        if b != b"\x21":  # an image descriptor, the trailer, or the end
            return
        label = fp.read(1)
        if label != b"\xf9":
            meta += 1
        while True:
            size = fp.read(1)
            if not size or size == b"\x00":
                break
            subblocks += 1
            if subblocks > MAX_GIF_SUBBLOCKS:
                raise _refuse(
                    name, f"more than {MAX_GIF_SUBBLOCKS} GIF extension data blocks before its first frame"
                )
            if label != b"\xf9":
                meta_bytes += size[0]
            fp.seek(size[0], io.SEEK_CUR)
        _count_metadata(name, "blocks (GIF extensions)", meta, meta_bytes)
        if not size:
            return


_SCANNERS = {"JPEG": _scan_jpeg, "PNG": _scan_png, "GIF": _scan_gif}


def check_metadata(fp: BinaryIO, fmt: str, name: str) -> None:
    """Refuse (MetadataLimitError naming `name`) a picture of format `fmt` whose metadata or structure is
    beyond the bounds above, from a scan of its bytes at `fp`'s position (lengths read, contents skipped).
    WebP's chunks are parsed by libwebp in C and BMP carries none."""
    scan = _SCANNERS.get(fmt)
    if scan is not None:
        scan(fp, name)


_OPEN_LOCK = threading.Lock()  # warnings.catch_warnings swaps process-wide state: one opener at a time


def open_bounded(fp: BinaryIO | str | Path, name: str = "the picture") -> Image.Image:
    """`Image.open` (the header only: cheap) of a binary file object, by the one reader of its format:
    `sniff_format` tells the format from the magic number (anything not in PICTURE_FORMATS is a
    PictureFormatError) and bounds its metadata (MetadataLimitError), then PIL opens it with only that
    format's plugin. PIL's DecompressionBombWarning — a picture larger than PIL's own limit (about 89M
    pixels), which PIL would print to stderr and then decode — is raised as `Image.DecompressionBombError`
    instead, so callers refuse it like any picture over MAX_IMAGE_PIXELS. A path (one the caller trusts) is
    read first by `untrusted.read_bounded` (a regular file, at most MAX_PICTURE_BYTES)."""
    if isinstance(fp, (str, Path)):
        fp = io.BytesIO(
            read_bounded(Path(fp), MAX_PICTURE_BYTES, follow_symlinks=True, expected="a picture file")
        )
    fmt = sniff_format(fp, name)
    with _OPEN_LOCK, warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            return Image.open(fp, formats=[fmt])
        except Image.DecompressionBombWarning as e:
            raise Image.DecompressionBombError(str(e)) from None


_BOMB_PIXELS_RE = re.compile(r"\((\d+) pixels\)")


def bomb_detail(error: Exception) -> str:
    """The refusal of a picture PIL found beyond its own limit, quoting vsekit's limit only (PIL's message
    quotes its own, about 89M): the pixel count PIL read from the header, when its message has it."""
    m = _BOMB_PIXELS_RE.search(str(error))
    size = f" ({int(m.group(1))} pixels)" if m else ""
    return f"larger than the {MAX_IMAGE_PIXELS} pixel limit{size}; not decoded"


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
        with open_bounded(fp, name) as im:
            yield im
    except DataFormatError:
        raise
    except Image.DecompressionBombError as e:
        detail = bomb_detail(e)
        raise PixelLimitError(f"{name}: {detail}", detail) from None
    except (
        Image.UnidentifiedImageError
    ):  # PIL's own message names the file object (`<_io.BytesIO object at …>`)
        raise DataFormatError(
            f"{name}: cannot read image (not a readable {PICTURE_FORMAT_NAMES} picture)"
        ) from None
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
