"""The one list of picture formats vsekit decodes, told from the header bytes before any PIL plugin reads a
file, and the bounds on a picture's metadata, scanned from its bytes before PIL parses them (defects
S-D2, R-D11, R-D12, S-D27, P-D13).

Every format PIL can write is saved as `x.png` and fed to `vse data folder` and `vse index FOLDER`: only PNG,
JPEG (and MPO), WebP, GIF and BMP become pictures, the others are reported by name and kind. The hostile files
are built small here (3,000 empty APP segments, not 120 MB; an ICO holding a 6000 x 6000 PNG of 630 KB); the
memory test runs in a child process whose address space is capped a little above what its imports took, so
a decode that PIL's ICO plugin would make inside `Image.open` fails there instead of passing.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import textwrap
import time
import warnings
import zlib
from pathlib import Path

import PIL.Image
import pytest
from PIL import Image

from vsekit.cli import main
from vsekit.data.pictures import decode_bounded, open_image
from vsekit.data.precomp import DataFormatError
from vsekit.search import uploads

ALLOWED = {"PNG", "JPEG", "MPO", "WEBP", "GIF", "BMP"}  # what the server allowed before: PIL format names
NAMES = "(PNG, JPEG, WebP, GIF, BMP)"
KINDS = {  # how some of the refused formats are named (what a person would call them)
    "EPS": "an EPS file",
    "ICO": "an ICO file",
    "ICNS": "an ICNS file",
    "TIFF": "a TIFF file",
    "PCX": "a PCX file",
    "SGI": "an SGI file",
    "PPM": "a PPM file",
    "PDF": "a PDF document",
    "JPEG2000": "a JPEG2000 file",
    "QOI": "a QOI file",
}
TIMEOUT_S = 90


def saved(fmt: str, colour: int) -> bytes | None:
    """A 16 x 16 picture in PIL's format `fmt` (mode RGB, else L, else 1), or None when PIL cannot write it."""
    for mode in ("RGB", "L", "1"):
        out = io.BytesIO()
        picture = Image.new(mode, (16, 16), colour if mode != "RGB" else (colour, 255 - colour, 90))
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # Pillow's IM writer
                picture.save(out, format=fmt)
        except Exception:  # noqa: BLE001 - no writer for this mode (or none installed): try the next
            continue
        return out.getvalue()
    return None


@pytest.fixture(scope="module")
def every_format(tmp_path_factory) -> tuple[Path, set[str]]:
    """(folder, formats written): FMT/x.png in PIL's format FMT and FMT/x.txt its caption, for every format
    PIL can write a small picture in."""
    root = tmp_path_factory.mktemp("formats") / "pics"
    Image.init()
    written = set()
    for i, fmt in enumerate(sorted(Image.SAVE)):
        data = saved(fmt, 20 + 7 * i)
        if data is None:
            continue
        (root / fmt).mkdir(parents=True)
        (root / fmt / "x.png").write_bytes(data)
        (root / fmt / "x.txt").write_text(f"a picture saved as {fmt.lower()}\n")
        written.add(fmt)
    assert {"EPS", "ICO", "TIFF", "PNG", "JPEG", "GIF", "BMP"} <= written
    return root, written


def check_refusals(lines: list[str], refused: set[str]) -> None:
    """Each refused format's x.png is named on one of `lines`, with its kind where KINDS knows it."""
    for fmt in refused:
        said = [ln for ln in lines if f"{fmt}/x.png" in ln]
        assert said, f"{fmt}/x.png is not reported"
        assert "format vsekit reads" in said[0], said[0]
        if fmt in KINDS:
            assert f"{KINDS[fmt]}, not a picture format vsekit reads {NAMES}" in said[0], said[0]


def test_s_d2_vse_data_folder_takes_only_the_allowed_formats(every_format, tmp_path, capsys):
    """S-D2: a picture of every format PIL writes, each named x.png: `vse data folder` builds the five
    formats vsekit reads and reports every other one by name and kind (EPS never reaches Ghostscript)."""
    root, written = every_format
    out = tmp_path / "set"
    argv = ["data", "folder", str(root), "--out", str(out), "--pixels", "--no-progress", "--dev", "0"]
    assert main([*argv, "--test", "0"]) == 0
    built = {line.split("/")[0] for line in (out / "train_images.txt").read_text().splitlines()}
    assert built == ALLOWED & written
    problems = (out / "problems.txt").read_text().splitlines()
    check_refusals(problems, written - ALLOWED)
    assert "EPS/x.png" in capsys.readouterr().err


def test_s_d2_vse_index_folder_takes_only_the_allowed_formats(every_format, shapes_model, tmp_path):
    """S-D2: the same folder through `vse index FOLDER`: the allowed formats are indexed, the others left
    out with a warning naming each and what it is."""
    from vsekit.search.index import SearchIndex, build_index

    root, written = every_format
    _, run = shapes_model
    msgs: list[str] = []
    build_index(run, str(root), tmp_path / "idx", progress=False, log=msgs.append)
    idx = SearchIndex(tmp_path / "idx")
    assert {p["path"].split("/")[0] for p in idx.pictures} == ALLOWED & written
    skipped = json.loads((tmp_path / "idx" / "index.json").read_text())["segments"][0]["skipped"]
    check_refusals(skipped, written - ALLOWED)  # each one, with its kind
    assert any("EPS/x.png: an EPS file" in m for m in msgs if m.startswith("warning: skipped"))


def test_s_d2_a_refused_format_never_reaches_pil(every_format, monkeypatch):
    """S-D2: the format is told from the header bytes: for a file that is not one of the five, `Image.open`
    (and so every PIL plugin) is never called, for files, tar members' bytes and uploads alike."""
    root, written = every_format
    seen = []
    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: seen.append(a) or pytest.fail("PIL opened it"))
    for fmt in sorted(written - ALLOWED):
        path = root / fmt / "x.png"
        with pytest.raises(DataFormatError, match=r"x\.png: .*format vsekit reads"):
            open_image(path)
        with pytest.raises(DataFormatError, match=r"^member\.png: "):
            decode_bounded(io.BytesIO(path.read_bytes()), "member.png")
        with pytest.raises(uploads.UploadRefused) as e:
            uploads.decode_reduced(path.read_bytes())
        assert e.value.status in (400, 415)
    assert seen == []


def test_s_d2_upload_allow_list_is_the_shared_one():
    """S-D2: the server keeps no list of its own: a TIFF upload is refused (415) naming what it is."""
    assert not hasattr(uploads, "UPLOAD_FORMATS")
    tiff = saved("TIFF", 40)
    with pytest.raises(uploads.UploadRefused, match="the picture is a TIFF; uploads may be") as e:
        uploads.decode_reduced(tiff)
    assert e.value.status == 415


# ------------------------------------------------------------------------------ hostile files, small


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_file(width: int, height: int, extra: bytes = b"", mode: str = "RGB", level: int = 6) -> bytes:
    """A PNG of zero pixels written by hand: IHDR, `extra` chunks, IDAT, IEND."""
    bands = {"RGB": 3, "RGBA": 4}[mode]
    row = b"\x00" + bytes(width * bands)
    z = zlib.compressobj(level)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[bands], 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + png_chunk(b"IHDR", ihdr)
        + extra
        + png_chunk(b"IDAT", idat)
        + png_chunk(b"IEND", b"")
    )


def jpeg_with_segments(n: int, marker: int = 0xE1, payload: bytes = b"Exif\x00\x00") -> bytes:
    """A 16 x 16 JPEG with `n` more APPn segments after its SOI (PIL writes one, the JFIF APP0)."""
    out = io.BytesIO()
    Image.new("RGB", (16, 16), (200, 30, 30)).save(out, format="JPEG")
    base = out.getvalue()
    with Image.open(io.BytesIO(base)) as im:
        assert [m for m, _ in im.applist] == ["APP0"]  # PIL's own count of the segments it writes
    segment = bytes((0xFF, marker)) + struct.pack(">H", len(payload) + 2) + payload
    return base[:2] + segment * n + base[2:]


def test_r_d11_thousands_of_exif_segments_are_refused_before_pil(monkeypatch):
    """R-D11: 3,000 APP1 "Exif" segments (the probe's 2,000 of 60 KB took 74.5 s and +574 MB in PIL) are
    refused from a scan of the markers, before PIL parses one; 63 more segments (64 with the JFIF one), far
    above a camera's, still decode."""
    hostile, fine, one_more = jpeg_with_segments(3000), jpeg_with_segments(63), jpeg_with_segments(64)
    assert decode_bounded(io.BytesIO(fine), "fine.jpg").size == (16, 16)
    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: pytest.fail("PIL parsed it"))
    t0 = time.perf_counter()
    with pytest.raises(DataFormatError, match=r"^exif\.jpg: more than 64 metadata segments .*; not decoded$"):
        decode_bounded(io.BytesIO(hostile), "exif.jpg")
    with pytest.raises(DataFormatError, match=r"^one-more\.jpg: more than 64 metadata"):
        decode_bounded(io.BytesIO(one_more), "one-more.jpg")
    assert time.perf_counter() - t0 < 1.0


def test_r_d11_a_photo_with_exif_and_a_colour_profile_still_decodes():
    """R-D11: the bounds are far above a real photo: Exif, a 1 MB ICC profile (split over 16 APP2 segments)
    and a comment decode as before."""
    exif = Image.Exif()
    exif[0x010F] = "camera maker"
    out = io.BytesIO()
    Image.new("RGB", (64, 48), (10, 200, 30)).save(
        out, format="JPEG", exif=exif, icc_profile=bytes(1 << 20), comment=b"a comment"
    )
    im = decode_bounded(io.BytesIO(out.getvalue()), "photo.jpg")
    assert im.size == (64, 48) and len(im.info["icc_profile"]) == 1 << 20


def test_r_d11_png_and_gif_metadata_are_bounded_too(monkeypatch):
    """R-D11 (PNG, GIF): 3,000 tEXt chunks or 3,000 GIF comment extensions are refused from their chunk or
    block structure; 64 tEXt chunks decode; a 17 MiB text chunk (over the 16 MiB of metadata) is refused."""
    text = png_chunk(b"tEXt", b"Comment\x00hello")
    assert decode_bounded(io.BytesIO(png_file(8, 8, text * 64)), "ok.png").size == (8, 8)
    out = io.BytesIO()
    Image.new("P", (8, 8)).save(out, format="GIF")
    gif = out.getvalue()
    table = 3 << ((gif[10] & 7) + 1) if gif[10] & 0x80 else 0  # GIF89a: header 6 + screen 7 + colour table
    comment = b"\x21\xfe\x05hello\x00"
    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: pytest.fail("PIL parsed it"))
    with pytest.raises(DataFormatError, match=r"^t\.png: more than 64 metadata chunks"):
        decode_bounded(io.BytesIO(png_file(8, 8, text * 3000)), "t.png")
    with pytest.raises(DataFormatError, match=r"^big\.png: metadata chunks .* of more than 16 MiB"):
        decode_bounded(io.BytesIO(png_file(8, 8, png_chunk(b"zTXt", bytes(17 << 20)))), "big.png")
    with pytest.raises(DataFormatError, match=r"^c\.gif: more than 64 metadata blocks"):
        decode_bounded(io.BytesIO(gif[: 13 + table] + comment * 3000 + gif[13 + table :]), "c.gif")


def test_r_d12_an_upload_of_empty_app_segments_is_refused_before_decoding(monkeypatch):
    """R-D12: an upload of 3,000 empty APP3 segments (the probe's 2,000,000 in 8 MB cost +271 MB, four
    times the 64 MB decode budget) is answered 413 from the marker scan; PIL never sees it."""
    hostile = jpeg_with_segments(3000, marker=0xE3, payload=b"")
    assert len(hostile) < 20_000
    monkeypatch.setattr(PIL.Image, "open", lambda *a, **k: pytest.fail("PIL parsed it"))
    with pytest.raises(uploads.UploadRefused, match="more than 64 metadata segments") as e:
        uploads.decode_reduced(hostile)
    assert e.value.status == 413


def ico_holding(png: bytes) -> bytes:
    """An ICO whose one entry (declared 256 x 256, 32 bits) is the PNG `png` (ICO's PNG-in-ICO form)."""
    header = struct.pack("<HHH", 0, 1, 1)
    entry = struct.pack("<BBBBHHII", 0, 0, 0, 0, 1, 32, len(png), 6 + 16)
    return header + entry + png


def test_s_d27_an_ico_holding_a_huge_png_is_refused_before_any_decode(tmp_path):
    """S-D27: an ICO holding a 6000 x 6000 RGBA PNG (630 KB; PIL's ICO plugin decodes it whole, 144 MB,
    inside `Image.open`, before any check) is refused by name and kind, from its header bytes, as a file
    and as an upload, in a child whose address space is capped 96 MB above what its imports took (the
    decode would fail there); an allowed 2000 x 2000 PNG still decodes under the same cap."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("needs /proc to size the memory cap")
    ico = tmp_path / "icon.png"  # sent and named as a PNG
    ico.write_bytes(ico_holding(png_file(6000, 6000, mode="RGBA", level=1)))
    assert ico.stat().st_size < 1_000_000
    (tmp_path / "fine.png").write_bytes(png_file(2000, 2000))
    code = textwrap.dedent(f"""
        import resource
        from vsekit.data.pictures import open_image
        from vsekit.data.precomp import DataFormatError
        from vsekit.search.uploads import UploadRefused, decode_reduced
        size = next(int(ln.split()[1]) for ln in open("/proc/self/status") if ln.startswith("VmSize:")) * 1024
        resource.setrlimit(resource.RLIMIT_AS, (size + (96 << 20), size + (96 << 20)))
        try:
            open_image({str(ico)!r})
        except DataFormatError as e:
            print("file:", e)
        try:
            decode_reduced(open({str(ico)!r}, "rb").read())
        except UploadRefused as e:
            print("upload:", e.status, e)
        print("fine:", open_image({str(tmp_path / "fine.png")!r}).size)
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=TIMEOUT_S)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[0] == f"file: {ico}: an ICO file, not a picture format vsekit reads {NAMES}", lines
    assert lines[1] == "upload: 415 the picture is an ICO; uploads may be BMP, GIF, JPEG, PNG, WebP", lines
    assert lines[2] == "fine: (2000, 2000)", lines


def test_p_d13_the_pixel_limit_message_quotes_vsekits_limit_only(tmp_path):
    """P-D13: a PNG declaring 10000 x 10000 pixels (beyond PIL's own limit too) is refused quoting
    MAX_IMAGE_PIXELS (64,000,000) and the picture's pixel count, never PIL's limit (89,478,485)."""
    bomb = tmp_path / "bomb.png"
    ihdr = png_chunk(b"IHDR", struct.pack(">IIBBBBB", 10000, 10000, 8, 0, 0, 0, 0))
    bomb.write_bytes(b"\x89PNG\r\n\x1a\n" + ihdr + png_chunk(b"IDAT", bytes(64)))  # a head, no pixels
    with pytest.raises(DataFormatError) as e:
        open_image(bomb)
    message = str(e.value)
    assert "64000000" in message and "100000000 pixels" in message, message
    assert str(PIL.Image.MAX_IMAGE_PIXELS) not in message, message


def test_s_d2_the_allow_list_has_one_owner():
    """S-D2: uploads.py imports the list from vsekit.data.pictures and keeps none of its own."""
    source = Path(uploads.__file__).read_text(encoding="utf-8")
    assert "PICTURE_FORMATS" in source and '"MPO": "JPEG"' not in source
