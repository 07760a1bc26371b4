"""Every reader of a picture that came from elsewhere opens it through the one bounded reader and decoder
(`vsekit.data.pictures`): a FIFO is refused without being waited on, and a picture whose header declares more
than MAX_IMAGE_PIXELS pixels is refused from that header, before any pixel is decoded (`check_pixels`, the one
copy of the pixel rule).

The pictures here are hand-written PNG heads: a signature, an IHDR chunk declaring the size and an IDAT chunk
of a few zero bytes, so a file "of" 9000 x 9000 pixels is under 200 bytes and holds no pixel at all; a reader
that decoded it would fail on truncated data instead of refusing its size. A FIFO that nobody writes to blocks
a plain `open` forever, so those runs are in a subprocess under a timeout and an address-space cap.
"""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import textwrap
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vsekit.cli import main
from vsekit.data.pictures import (
    MAX_IMAGE_PIXELS,
    PixelLimitError,
    check_pixels,
    decode_bounded,
    open_bounded,
    open_image,
)
from vsekit.data.precomp import DataFormatError
from vsekit.data.raw_images import load_pixels
from vsekit.datasets.show import show_dataset
from vsekit.features.extractor import PictureExtractor

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
TIMEOUT_S = 90  # a bounded run takes seconds (mostly imports); a FIFO opened plainly blocks forever


def png_head(width: int, height: int, idat: int = 64) -> bytes:
    """The start of an 8-bit greyscale PNG declaring width x height: signature, IHDR and an IDAT chunk of
    `idat` zero bytes (enough for PIL to open it and read its size; no picture's worth of pixel data)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", bytes(idat))


def montage_set(root: Path, picture: str) -> Path:
    """A dataset folder whose test split lists one picture, `picture`, with one caption."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "test_images.txt").write_text(f"{picture}\n")
    (root / "test_caps.txt").write_text("a picture\n")
    (root / "test_cap2img.txt").write_text("0\n")
    return root


def run_child(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Python `code` in a child process: its vsekit imports first, then an address space capped 1 GiB above
    what they took (RLIMIT_AS), then the rest, killed after TIMEOUT_S (the test fails, never hangs)."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("needs /proc to size the memory cap")
    imports, body = textwrap.dedent(code).split("# ---\n")
    cap = textwrap.dedent("""
        import resource
        size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), size + (1 << 30)))
    """)
    try:
        return subprocess.run(
            [sys.executable, "-c", imports + cap + body],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(
            f"still running after {TIMEOUT_S} s: the picture was opened as a plain file (a FIFO blocks)"
        )


# ------------------------------------------------------------------------- the rule: check_pixels


def test_check_pixels_reads_only_the_header():
    """Sizes come from the header alone: a head holding no pixel data is measured, not decoded (decoding it
    would fail on truncated data), for a file object and for a picture `open_bounded` opened."""
    assert check_pixels(io.BytesIO(png_head(100, 50)), "small.png") == (100, 50)
    with open_bounded(io.BytesIO(png_head(8000, 8000))) as im:  # 64,000,000: exactly the limit
        assert check_pixels(im, "edge.png") == (8000, 8000)
    with pytest.raises(DataFormatError, match=r"^small\.png: cannot read image"):  # what decoding them does
        decode_bounded(io.BytesIO(png_head(100, 50)), "small.png")


def test_check_pixels_refuses_an_oversize_png_from_its_header_naming_the_file():
    huge = png_head(60000, 60000)  # 3.6e9 pixels declared by a file of under 200 bytes
    assert len(huge) < 200
    with pytest.raises(PixelLimitError, match=r"^huge\.png: larger than the 64000000 pixel limit") as e:
        check_pixels(io.BytesIO(huge), "huge.png")
    assert e.value.detail.startswith("larger than the 64000000 pixel limit")
    # between vsekit's limit and PIL's own warning threshold (~89M): vsekit's rule, not PIL's, refuses it
    assert 64_000_000 == MAX_IMAGE_PIXELS < 9000 * 8000 < Image.MAX_IMAGE_PIXELS
    with pytest.raises(
        PixelLimitError, match=r"^wide\.png: 9000x8000 pixels is larger than the 64000000 limit"
    ):
        check_pixels(io.BytesIO(png_head(9000, 8000)), "wide.png")
    with pytest.raises(
        PixelLimitError, match=r"^wide\.png: 9000x8000 pixels"
    ):  # the decoder asks the same rule
        decode_bounded(io.BytesIO(png_head(9000, 8000)), "wide.png")
    with pytest.raises(DataFormatError, match=r"^notes\.png: cannot read image") as e:
        check_pixels(io.BytesIO(b"no picture here"), "notes.png")
    assert not isinstance(e.value, PixelLimitError)  # unreadable is not "too large"


# ------------------------------------------------------------ training from pixels (data/raw_images)


def test_training_loader_refuses_a_9000_by_9000_header_before_decoding(tmp_path):
    big = tmp_path / "big.png"
    big.write_bytes(png_head(9000, 9000))
    for rng in (np.random.default_rng(0), None):  # training (crop / flip) and evaluation
        with pytest.raises(
            PixelLimitError, match=r"big\.png: 9000x9000 pixels is larger than the 64000000 limit"
        ):
            load_pixels(big, 32, rng)


def test_training_loader_still_reads_a_picture_as_before(tmp_path):
    """Alpha on white, then the ImageNet transform: a half-transparent red pixel becomes (255, 127.5, 127.5)."""
    Image.new("RGBA", (4, 4), (255, 0, 0, 128)).save(tmp_path / "p.png")
    got = load_pixels(tmp_path / "p.png", 2, None).numpy()
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    a = 128 / 255
    rgb = np.round(np.array([255, 255 * (1 - a), 255 * (1 - a)])) / 255  # PIL's alpha_composite rounds
    np.testing.assert_allclose(got[:, 0, 0], (rgb - mean) / std, atol=2e-2)


@needs_fifo
def test_training_loader_refuses_a_fifo_without_waiting(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    r = run_child(
        f"""
        import numpy as np
        from vsekit.data.precomp import DataFormatError
        from vsekit.data.raw_images import load_pixels
        # ---
        try:
            load_pixels({str(tmp_path / "pipe.png")!r}, 32, np.random.default_rng(0))
        except DataFormatError as e:
            print(e)
    """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip() == f"{tmp_path / 'pipe.png'}: is a FIFO (named pipe), expected a picture file"


# ----------------------------------------------------------------------- montages (vse data show)


def test_montage_refuses_a_9000_by_9000_header_in_one_line(tmp_path, capsys):
    data = montage_set(tmp_path / "set", "big.png")
    (data / "big.png").write_bytes(png_head(9000, 9000))
    out = tmp_path / "sheet.png"
    assert main(["data", "show", str(data), "--split", "test", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "big.png: 9000x9000 pixels is larger than the 64000000 limit" in err[0], err
    assert not out.exists()


def test_montage_still_shows_a_picture(tmp_path):
    data = montage_set(tmp_path / "set", "red.png")
    Image.new("RGB", (30, 30), (250, 0, 0)).save(data / "red.png")
    out = show_dataset(data, tmp_path / "sheet.png", split="test", n=1, cell=32)
    with Image.open(out) as im:
        assert im.convert("RGB").getpixel((8 + 15, 8 + 15)) == (
            250,
            0,
            0,
        )  # the cell starts at the pad (8 px)


@needs_fifo
def test_montage_refuses_a_fifo_without_waiting(tmp_path):
    data = montage_set(tmp_path / "set", "pipe.png")
    os.mkfifo(data / "pipe.png")
    r = run_child(
        f"""
        import sys
        from vsekit.cli import main
        # ---
        sys.exit(main(["data", "show", {str(data)!r}, "--split", "test", "--out", {str(tmp_path / "sheet.png")!r}]))
    """,
        tmp_path,
    )
    assert r.returncode == 2, r.stderr[-2000:]
    assert "pipe.png: is a FIFO (named pipe), expected a picture file" in r.stderr
    assert not (tmp_path / "sheet.png").exists()


# ------------------------------------------------ builders' feature extraction and sprites (vsekit_lab)


class MeanColour(PictureExtractor):
    """A PictureExtractor without a network: one region, the picture's mean RGB (enough to see what was read)."""

    device = torch.device("cpu")

    def prepare(self, picture: Image.Image) -> torch.Tensor:
        return torch.from_numpy(np.asarray(picture.convert("RGB"), dtype=np.float32).mean((0, 1)))

    def run(self, batch: torch.Tensor) -> np.ndarray:
        return batch.numpy()[:, None, :].astype(np.float16)

    def describe(self) -> dict:
        return {"name": "mean_colour", "regions": 1, "dim": 3}


def test_feature_extraction_of_files_goes_through_the_bounded_reader(tmp_path):
    Image.new("RGB", (6, 6), (10, 20, 30)).save(tmp_path / "ok.png")
    (tmp_path / "big.png").write_bytes(png_head(9000, 9000))
    extractor = MeanColour()
    got = extractor.extract_paths([tmp_path / "ok.png"], progress=False, open_picture=open_image)
    assert got.tolist() == [[[10.0, 20.0, 30.0]]]
    with pytest.raises(PixelLimitError, match=r"big\.png: 9000x9000 pixels"):
        extractor.extract_paths(
            [tmp_path / "ok.png", tmp_path / "big.png"], progress=False, open_picture=open_image
        )


def test_a_sprite_is_read_by_the_bounded_reader(tmp_path):
    from vsekit_lab.datasets.wesnoth.frames import render_frame

    (tmp_path / "big.png").write_bytes(png_head(9000, 9000))
    with pytest.raises(PixelLimitError, match=r"big\.png: 9000x9000 pixels"):
        render_frame(tmp_path / "big.png")
