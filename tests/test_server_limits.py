"""`vse serve` against clients that try to exhaust it: cross-origin and non-picture uploads, pictures that
would take hundreds of MB to decode, and connections that never finish their request head.

The first tests run the app in-process over a stub engine (a second each). The load tests start a real
`vse serve` on 127.0.0.1 over the shapes index in a child process under RLIMIT_AS, and read its peak
memory from /proc (VmHWM, reset between scenarios through clear_refs); they send a few dozen requests and
stop by themselves. The bounds asserted are the ones docs/search.md states.
"""

import io
import logging
import resource
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

pytest.importorskip("fastapi")
pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
import httpx  # noqa: E402
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from vsekit.search import uploads  # noqa: E402
from vsekit.search.connections import uvicorn_config  # noqa: E402
from vsekit.search.engine import SearchEngine  # noqa: E402
from vsekit.search.server import ServerLimits, create_app, foreign_origin  # noqa: E402

BASE = "http://127.0.0.1"
MB = 1 << 20
PER_UPLOAD_MB = 96  # docs/search.md: one upload, the largest accepted picture, over the idle server
EIGHT_UPLOADS_MB = 320  # docs/search.md: 8 concurrent uploads of it (2 decoded at a time)
SERVER_AS_LIMIT = 6 << 30  # RLIMIT_AS of the child server: a runaway decode fails there, not on the machine


def png_bytes(width: int, height: int, mode: str = "RGB", ramp: bool = True) -> bytes:
    """A valid PNG of a colour ramp (else white), compressed row by row (the test never holds the pixels)."""
    bands = {"RGB": 3, "RGBA": 4}[mode]

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\x00" + (
        bytes((x * 7) & 255 for x in range(width * bands)) if ramp else b"\xff" * (width * bands)
    )
    z = zlib.compressobj(6)
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 8, {3: 2, 4: 6}[bands], 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


class StubEngine(SearchEngine):
    """Takes picture queries without a model: records the size of every picture it was given."""

    def __init__(self) -> None:
        self.index = SimpleNamespace(n_pictures=0, pictures=[], picture_file=lambda i: None)
        self.text = SimpleNamespace(unknown_words=lambda q: [])
        self.seen: list[tuple[int, int]] = []

    def picture_query_problem(self):
        return None

    def search_text(self, query: str, k: int = 10):
        return []

    def search_image(self, image, k: int = 10, distinct: bool = True):
        self.seen.append(image.size)
        return []

    def info(self) -> dict:
        return {"pictures": 0}


@pytest.fixture
def engine():
    return StubEngine()


def _client(engine, **kw):
    return TestClient(
        create_app(engine, logger=logging.getLogger("vsekit.test.limits"), **kw),
        base_url=BASE,
        raise_server_exceptions=False,
    )


def _png(size=(32, 24)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(out, format="PNG")
    return out.getvalue()


def _upload(client, body: bytes, content_type: str | None = "image/png", origin: str | None = None):
    headers = {k: v for k, v in (("content-type", content_type), ("origin", origin)) if v is not None}
    return client.post("/search/image", content=body, headers=headers)


# ------------------------------------------------------------------------ who may send a request


def test_cross_origin_requests_are_refused(engine):
    with _client(engine) as c:
        for origin in ("http://evil.example", "null", "http://127.0.0.1.evil.example", "https://localhost"):
            r = _upload(c, _png(), origin=origin)
            assert r.status_code == 403 and "cross-origin request" in r.json()["detail"], (origin, r.text)
        r = c.post("/search", json={"q": "a cat"}, headers={"origin": "http://evil.example"})
        assert r.status_code == 403
        assert engine.seen == []  # nothing reached the model
        assert _upload(c, _png(), origin="http://127.0.0.1").status_code == 200  # the page itself
        assert _upload(c, _png()).status_code == 200  # curl, scripts: no Origin at all
        assert engine.seen == [(32, 24), (32, 24)]
    with _client(StubEngine(), cors_origins=["http://ok.example"]) as c:
        r = _upload(c, _png(), origin="http://ok.example")
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
    # behind a proxy the Host header names the public site; default ports are implied in both headers
    assert not foreign_origin("https://search.example", "search.example")
    assert not foreign_origin("http://localhost:8000", "LOCALHOST:8000")
    assert not foreign_origin("http://localhost", "localhost:80")
    assert foreign_origin("http://localhost:8001", "localhost:8000")
    assert foreign_origin("http://[::1", "localhost")  # unparsable: refused


NOT_PICTURES = [
    "text/plain",
    "application/x-www-form-urlencoded",
    "multipart/form-data; boundary=x",
    "application/json",
    "text/html; charset=utf-8",
]


@pytest.mark.parametrize("kind", NOT_PICTURES)
def test_non_image_content_types_are_refused(engine, kind):
    with _client(engine) as c:
        r = _upload(c, _png(), kind)
        assert r.status_code == 415 and "Content-Type image/png" in r.json()["detail"], r.text
        assert engine.seen == []
        # the page sends application/octet-stream for a file without a type; a bare HTTP client sends none
        for ok in ("image/png", "IMAGE/JPEG", "application/octet-stream", None):
            assert _upload(c, _png(), ok).status_code == 200, ok


def test_only_upload_formats_are_decoded(engine):
    tiff = io.BytesIO()
    Image.new("RGB", (8, 8)).save(tiff, format="TIFF")
    with _client(engine) as c:
        r = _upload(c, tiff.getvalue(), "image/tiff")
        assert r.status_code == 415 and "uploads may be BMP, GIF, JPEG, PNG, WebP" in r.json()["detail"]
        r = _upload(c, b"\x89PNG\r\n\x1a\n garbage")
        assert r.status_code == 400 and "not a readable picture" in r.json()["detail"]


# ----------------------------------------------------------------------- what an upload may cost


def test_decode_budget_is_read_from_the_header(engine):
    assert uploads.UPLOAD_DECODE_BYTES == 4096 * 4096 * 4  # a 4096x4096 RGBA PNG: PIL keeps 4 bytes a pixel
    with _client(engine) as c:
        r = _upload(c, png_bytes(4097, 4096, "RGBA"))  # one column more: 4097 * 4096 * 4 bytes = 64.02 MB
        assert r.status_code == 413 and "decoding it would take 65 MB" in r.json()["detail"], r.text
        r = _upload(c, png_bytes(7999, 7999))  # PIL's RGB takes 4 bytes a pixel too: 245 MB
        assert r.status_code == 413 and "7999x7999 pixels: decoding it would take 245 MB" in r.text
        assert engine.seen == []
    # a progressive JPEG keeps every coefficient (2 bytes) at full size: 4:2:0 640x480 = Y 80x60 blocks +
    # Cb, Cr 40x30 blocks each, 64 coefficients a block
    out = io.BytesIO()
    Image.new("RGB", (640, 480)).save(out, format="JPEG", progressive=True)
    with Image.open(io.BytesIO(out.getvalue())) as im:
        assert uploads.jpeg_coefficient_bytes(im) == (80 * 60 + 2 * 40 * 30) * 64 * 2
        assert uploads.pixel_bytes(im) == 640 * 480 * 4


def test_a_large_jpeg_is_decoded_at_a_smaller_scale(engine):
    out = io.BytesIO()
    Image.new("RGB", (4000, 3000), (10, 120, 200)).save(out, format="JPEG")
    # libjpeg scales by 1/8, 1/4, 1/2: the largest with both sides >= 2 * 224 is 1/4 (3000 // 448 = 6 -> 4)
    assert uploads.decode_reduced(out.getvalue(), input_px=224).size == (1000, 750)
    with _client(engine) as c:
        assert _upload(c, out.getvalue(), "image/jpeg").status_code == 200
    assert engine.seen == [(1000, 750)]
    # a PNG is decoded whole, then reduced by 1000 // 448 = 2
    assert uploads.decode_reduced(png_bytes(2000, 1000), input_px=224).size == (1000, 500)


def test_thumbnails_are_decoded_within_the_same_budget(engine, tmp_path):
    files = [tmp_path / "huge.png", tmp_path / "photo.jpg", tmp_path / "scan.bmp"]
    files[0].write_bytes(png_bytes(4097, 4096, "RGBA"))  # an indexed folder's contents are not trusted either
    Image.new("RGB", (4000, 3000), (10, 120, 200)).save(files[1])
    Image.new("RGB", (300, 200), (200, 10, 10)).save(files[2])  # a format the index takes
    engine.index = SimpleNamespace(
        n_pictures=3, pictures=[{"path": f.name} for f in files], picture_file=lambda i: files[i]
    )
    with _client(engine) as c:
        r = c.get("/thumb/0")
        assert r.status_code == 404 and "too large to thumbnail" in r.json()["detail"]
        for i, size in ((1, (256, 192)), (2, (256, 171))):
            r = c.get(f"/thumb/{i}")
            assert r.status_code == 200 and Image.open(io.BytesIO(r.content)).size == size


def test_reduce_by_strips_is_pils_reduce(monkeypatch):
    monkeypatch.setattr(uploads, "STRIP_PIXELS", 700)  # many strips, the last one short
    rng = np.random.default_rng(0)
    rgba = Image.fromarray(rng.integers(0, 256, (101, 67, 4), dtype=np.uint8), "RGBA")
    assert uploads.reduce_by_strips(rgba, 3).tobytes() == rgba.reduce(3).tobytes()
    pal = rgba.convert("RGB").quantize(16)
    pal.info["transparency"] = 0
    assert uploads.reduce_by_strips(pal, 4).tobytes() == pal.convert("RGBA").reduce(4).tobytes()
    grey16 = Image.fromarray(rng.integers(0, 65536, (50, 40), dtype=np.uint16))
    assert grey16.mode == "I;16"
    assert uploads.reduce_by_strips(grey16, 2).tobytes() == grey16.convert("I").reduce(2).tobytes()
    assert uploads.reduce_factor((1000, 750), 448) == 1 and uploads.reduce_factor((4096, 4096), 448) == 9


# ------------------------------------------------------------------------- connections


@pytest.fixture
def small_server(engine, request):
    """The app under uvicorn with `vse serve`'s connection settings: 4 slots, a head deadline of
    `request.param` seconds (0.5 unless parametrized)."""
    head_s = getattr(request, "param", 0.5)
    app = create_app(
        engine, limits=ServerLimits(head_timeout_s=head_s), logger=logging.getLogger("vsekit.test.limits")
    )
    server = uvicorn.Server(
        uvicorn_config(app, "127.0.0.1", 0, max_connections=4, head_timeout_s=head_s, log_level="warning")
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def _half_open(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # no blank line: the head never ends
    return s


def _closed_by_server(s: socket.socket, within_s: float) -> bool:
    s.settimeout(within_s)
    try:
        return s.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_a_request_head_has_a_deadline(small_server):
    s = _half_open(small_server)
    t0 = time.monotonic()
    assert _closed_by_server(s, 5.0) and time.monotonic() - t0 < 3.0
    s.close()
    with httpx.Client(base_url=f"http://127.0.0.1:{small_server}") as c:  # keep-alive: the deadline restarts
        assert c.get("/healthz").status_code == 200
        time.sleep(0.2)
        assert c.get("/healthz").status_code == 200


@pytest.mark.parametrize("small_server", [60.0], indirect=True)  # no deadline during the test: only eviction
def test_silent_connections_give_way_when_the_slots_are_full(small_server):
    silent = [_half_open(small_server) for _ in range(6)]
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{small_server}", timeout=5) as c:
            assert [c.get("/healthz").status_code for _ in range(3)] == [200] * 3  # 4 slots, 6 silent clients
        assert _closed_by_server(silent[0], 0.3)  # the one that waited longest made room
    finally:
        for s in silent:
            s.close()


# ---------------------------------------------------------------- a real `vse serve`, under load


def _proc_kb(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise AssertionError(f"{key} not in /proc/{pid}/status")


def _reset_peak(pid: int) -> int:
    """Start a new VmHWM period (the kernel's clear_refs "5"); the resident size now, in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _proc_kb(pid, "VmRSS") << 10


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (SERVER_AS_LIMIT, SERVER_AS_LIMIT))


@pytest.fixture(scope="module")
def vse_serve(shapes_model, tmp_path_factory):
    """`vse serve` of the shapes index on a free loopback port, its picture pipeline warmed up: (url, pid,
    resident bytes when idle)."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to read the server's peak memory")
    from vsekit.search.index import build_index

    data, run = shapes_model
    idx = tmp_path_factory.mktemp("limits") / "idx"
    build_index(run, f"{data}:test", idx, progress=False, log=lambda *_: None)
    cmd = [
        sys.executable,
        "-m",
        "vsekit.cli",
        "serve",
        str(idx),
        "--port",
        "0",
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, preexec_fn=_limit_memory
    )
    try:
        line, deadline = "", time.monotonic() + 120
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        assert "serving" in line, line
        url = "http://127.0.0.1:" + line.split("http://127.0.0.1:")[1].split()[0]
        picture, r = sorted((data / "images").glob("test_*.png"))[0].read_bytes(), None
        for _ in range(100):
            try:
                r = httpx.post(url + "/search/image?k=3", content=picture, timeout=60)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert r is not None and r.status_code == 200, (
            r
        )  # loads the feature extractor: part of the idle server
        yield url, proc.pid, _proc_kb(proc.pid, "VmRSS") << 10
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _post_picture(url: str, body: bytes) -> int:
    return httpx.post(
        url + "/search/image?k=3", content=body, headers={"content-type": "image/png"}, timeout=60
    ).status_code


@pytest.mark.slow
def test_a_7999px_png_costs_no_more_than_one_upload(vse_serve):
    url, pid, idle = vse_serve
    bomb = png_bytes(7999, 7999, ramp=False)  # about 200 KB; 750 MB when it was decoded whole
    assert len(bomb) < 300_000
    before = _reset_peak(pid)
    assert _post_picture(url, bomb) == 413
    refused = (_proc_kb(pid, "VmHWM") << 10) - before
    assert refused < PER_UPLOAD_MB * MB
    largest = png_bytes(4096, 4096, "RGBA")
    _reset_peak(pid)
    assert _post_picture(url, largest) == 200
    one = (_proc_kb(pid, "VmHWM") << 10) - idle
    print(
        f"idle {idle / MB:.0f} MB; 7999x7999 PNG +{refused / MB:.1f} MB; one 4096x4096 RGBA PNG +{one / MB:.1f} MB"
    )
    assert one < PER_UPLOAD_MB * MB


@pytest.mark.slow
def test_eight_concurrent_uploads_of_the_largest_picture_stay_bounded(vse_serve):
    url, pid, idle = vse_serve
    largest = png_bytes(4096, 4096, "RGBA")
    _reset_peak(pid)
    with ThreadPoolExecutor(8) as pool:
        codes = list(pool.map(lambda _: _post_picture(url, largest), range(8)))
    assert codes == [200] * 8
    peak = (_proc_kb(pid, "VmHWM") << 10) - idle
    print(f"8 concurrent 4096x4096 RGBA PNGs: +{peak / MB:.1f} MB over the idle server")
    assert peak < EIGHT_UPLOADS_MB * MB, f"{peak / MB:.0f} MB over the idle server"


@pytest.mark.slow
def test_a_hundred_half_open_connections_do_not_stop_healthz(vse_serve):
    url, _, _ = vse_serve
    port = int(url.rsplit(":", 1)[1])
    silent = [_half_open(port) for _ in range(100)]  # more than --max-connections (64)
    try:
        t0 = time.monotonic()
        r = httpx.get(url + "/healthz", timeout=5)
        assert r.status_code == 200 and time.monotonic() - t0 < 5
        print(f"healthz answered in {time.monotonic() - t0:.2f} s")
        assert httpx.get(url + "/search", params={"q": "a red circle"}, timeout=5).status_code == 200
    finally:
        for s in silent:
            s.close()
