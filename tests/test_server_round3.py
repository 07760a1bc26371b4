"""Round 3 of the attacks on `vse serve` and `vse index --from-embeddings` (a hostile probe's findings; each test
names its defect id): request smuggling, Sec-Fetch-Site, bodies trickled to hold the connection slots, an
embeddings folder naming `/` as its pictures' root, and foreign `.npy` files (a FIFO, objects, text, a
header claiming 200 GB, a link to /dev/zero).

The server tests run the app under uvicorn in a thread with `vse serve`'s connection settings and talk raw
HTTP over loopback sockets, with deadlines of about a second; the embeddings folders are written by hand
(numpy, pyarrow), so no model is trained.
"""

import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("faiss")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
import uvicorn  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from vsekit.cli import main  # noqa: E402
from vsekit.search.connections import uvicorn_config  # noqa: E402
from vsekit.search.engine import Hit, SearchEngine  # noqa: E402
from vsekit.search.server import ServerLimits, create_app, foreign_origin  # noqa: E402
from vsekit.utils.io import open_npy  # noqa: E402

LOG = logging.getLogger("vsekit.test.round3")


class StubEngine(SearchEngine):
    """An index of 2 pictures without files, answering every text query with picture 0."""

    def __init__(self) -> None:
        self.index = SimpleNamespace(
            n_pictures=2, pictures=[{"path": "a.png"}, {"path": "b.png"}], picture_file=lambda i: None
        )
        self.text = SimpleNamespace(unknown_words=lambda q: [])

    def search_text(self, query: str, k: int = 10):
        return [Hit(0, 1.0, "a.png", None, "a caption", 0)]

    def info(self) -> dict:
        return {"pictures": 2}


@pytest.fixture
def server(request):
    """(port, closed-connection log lines) of the stub app under uvicorn: 4 slots, and the ServerLimits of
    `request.param` (short body deadlines unless parametrized; `plain`: the default ones, passed by no
    argument, so a test of framing alone runs on code without body deadlines too)."""
    kw = getattr(request, "param", {})
    body = {} if kw.get("plain") else {"body_timeout_s": kw.get("body", 1.0), "body_min_rate": 1000.0}
    limits = ServerLimits(head_timeout_s=60.0, **body)
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())
    LOG.addHandler(handler)
    LOG.setLevel(logging.INFO)
    app = create_app(StubEngine(), limits=limits, logger=LOG)
    config = uvicorn_config(
        app,
        "127.0.0.1",
        0,
        max_connections=4,
        head_timeout_s=limits.head_timeout_s,
        log_level="warning",
        logger=LOG,
        **body,
    )
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    try:
        yield srv.servers[0].sockets[0].getsockname()[1], records
    finally:
        LOG.removeHandler(handler)
        srv.should_exit = True
        thread.join(timeout=10)


def _connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=5)


def _read_until_closed(s: socket.socket, within_s: float) -> tuple[bytes, bool]:
    """Everything the server sends within `within_s`, and whether it closed the connection by then."""
    s.settimeout(0.2)
    got, end = b"", time.monotonic() + within_s
    while time.monotonic() < end:
        try:
            block = s.recv(65536)
        except TimeoutError:
            continue
        except ConnectionResetError:
            return got, True
        if not block:
            return got, True
        got += block
    return got, False


def _get(port: int, path: str) -> int:
    with _connect(port) as s:
        s.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode())
        got, _ = _read_until_closed(s, 5)
    return int(got.split(b" ", 2)[1]) if got.startswith(b"HTTP/1.1 ") else 0


# ------------------------------------------------------------------------ S-D23: request smuggling

SMUGGLED = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
PLAIN = pytest.mark.parametrize("server", [{"plain": True}], indirect=True)


@pytest.mark.parametrize(
    "framing",
    [
        b"Content-Length: 5\r\nTransfer-Encoding: chunked\r\n",  # the probe's
        b"Transfer-Encoding: chunked\r\nContent-Length: 0\r\n",
        b"Transfer-Encoding: gzip, chunked\r\n",
        b"Transfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n",
        b"Content-Length: 5\r\nContent-Length: 6\r\n",
    ],
)
@PLAIN
def test_s_d23_a_request_framed_twice_is_answered_400_and_nothing_after_it(server, framing):
    """S-D23: both requests go in one write on one socket; the first is answered 400 and the connection
    closed, so the one smuggled behind it gets no answer at all."""
    port, _ = server
    with _connect(port) as s:
        s.sendall(b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\n" + framing + b"\r\n0\r\n\r\n" + SMUGGLED)
        got, closed = _read_until_closed(s, 5)
    assert closed, got
    assert got.startswith(b"HTTP/1.1 400 ") and got.count(b"HTTP/1.1 ") == 1, got
    if b"Content-Length: 5\r\nT" in framing:
        assert b"both Content-Length and Transfer-Encoding" in got
    assert _get(port, "/healthz") == 200  # the server itself goes on


@PLAIN
def test_s_d23_one_framing_is_still_served_and_kept_alive(server):
    port, _ = server
    body = b'{"q": "a red circle"}'
    chunked = b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    with _connect(port) as s:
        s.sendall(
            b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nTransfer-Encoding: chunked\r\n\r\n"
            + chunked
            + b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
            % len(body)
            + body
        )
        got, closed = _read_until_closed(s, 5)
    assert got.count(b"HTTP/1.1 200 ") == 2 and closed, got


# ------------------------------------------------------------------------ S-D25: Sec-Fetch-Site

BASE = "http://127.0.0.1"


def test_s_d25_a_foreign_pages_img_tag_is_refused():
    """S-D25: an `<img src>` of another site's page sends no Origin, but Sec-Fetch-Site: cross-site (and
    Sec-Fetch-Mode: no-cors); same-site is another port or program on this host: both refused like a foreign
    Origin, on /thumb and /search alike; the server's own page (same-origin), a typed URL (none) and
    clients without the header are served."""
    with TestClient(create_app(StubEngine(), logger=LOG), base_url=BASE) as c:
        for site in ("cross-site", "same-site", "Cross-Site", "bogus"):
            headers = {"sec-fetch-site": site, "sec-fetch-mode": "no-cors", "sec-fetch-dest": "image"}
            for path in ("/thumb/0", "/search?q=a+cat"):
                r = c.get(path, headers=headers)
                assert r.status_code == 403, (site, path, r.status_code)
                assert "cross-origin request from another site" in r.json()["detail"]
        for site in ("same-origin", "none", None):
            headers = {"sec-fetch-site": site} if site else {}
            assert c.get("/search?q=a+cat", headers=headers).status_code == 200, site
            assert c.get("/thumb/0", headers=headers).status_code == 404, site  # served: no file here
    # --cors-origin still allows its one origin (its fetches carry Origin), and only it
    app = create_app(StubEngine(), logger=LOG, cors_origins=["http://ok.example"])
    with TestClient(app, base_url=BASE) as c:
        ok = {"origin": "http://ok.example", "sec-fetch-site": "cross-site", "sec-fetch-mode": "cors"}
        r = c.get("/search?q=a+cat", headers=ok)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://ok.example"
        assert c.get("/search?q=a+cat", headers={"sec-fetch-site": "cross-site"}).status_code == 403
    assert foreign_origin(None, "127.0.0.1", fetch_site="cross-site")
    assert not foreign_origin("http://127.0.0.1", "127.0.0.1", fetch_site="same-origin")
    assert not foreign_origin(None, "127.0.0.1", frozenset({"*"}), fetch_site="cross-site")


# ------------------------------------------------------------------------ R-D26: bodies trickled


def _trickle_head(port: int) -> socket.socket:
    s = _connect(port)
    s.sendall(
        b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n1\r\n{\r\n"
    )
    return s


def test_r_d26_a_body_trickled_is_closed_at_its_deadline(server):
    """R-D26: a chunked body of one byte every 0.3 s, with a 1 s body deadline and a minimum of 1000 B/s,
    is closed about 1 s after its head (it was held as long as the client liked)."""
    port, records = server
    s = _trickle_head(port)
    t0, closed = time.monotonic(), False
    try:
        while time.monotonic() - t0 < 6 and not closed:
            try:
                s.sendall(b"1\r\n \r\n")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            _, closed = _read_until_closed(s, 0.3)
    finally:
        s.close()
    took = time.monotonic() - t0
    assert closed and 0.8 < took < 3.0, took
    assert any('"reason": "body_timeout"' in r for r in records), records
    time.sleep(0.2)  # the app's request ends as a client that left (499), not an internal error
    assert any('"path": "/search", "status": 499' in r for r in records), records


def test_r_d26_a_body_that_keeps_the_minimum_rate_is_served(server):
    """The deadline grows with the bytes that arrived: 1,200 bytes every 0.5 s (2,400 B/s, above the
    1000 B/s minimum) for 2.5 s, past the 1 s deadline, is answered."""
    port, _ = server
    with _connect(port) as s:
        s.sendall(
            b"POST /search HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Connection: close\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        piece = b" " * 1200
        s.sendall(b"%x\r\n%s\r\n" % (1200, piece))
        for _ in range(5):
            time.sleep(0.5)
            s.sendall(b"%x\r\n%s\r\n" % (1200, piece))
        body = b'{"q": "a red circle"}'
        s.sendall(b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body))
        got, closed = _read_until_closed(s, 5)
    assert got.startswith(b"HTTP/1.1 200 ") and b"a caption" in got, got[:300]


@pytest.mark.parametrize("server", [{"body": 60.0}], indirect=True)  # no deadline in the test: eviction only
def test_r_d26_slow_bodies_give_way_when_the_slots_are_full(server):
    """R-D26: 6 connections each holding a body that stopped after one byte take all 4 slots; new requests
    are still answered, by closing the one that has waited longest (before: 503 for as long as they liked)."""
    port, records = server
    slow = []
    try:
        for _ in range(6):
            slow.append(_trickle_head(port))
            time.sleep(0.05)  # each head parsed, in order
        time.sleep(0.2)
        assert [_get(port, "/healthz") for _ in range(3)] == [200, 200, 200]
        _, closed = _read_until_closed(slow[0], 0.5)
        assert closed
        assert any('"reason": "evicted"' in r for r in records)
    finally:
        for s in slow:
            s.close()


# ---------------------------------------------------------- S-D28, R-D20, C-D19: an embeddings folder

DIM = 8
FINGERPRINT = {
    "run_dir": "/nowhere/run",
    "checkpoint": "best",
    "weights": "model_best.pth",
    "weights_sha256": "ab" * 32,
    "recipe": "vsepp",
    "similarity": "cosine",
    "embed_dim": DIM,
    "rerank": False,
}


def _embeddings(dir: Path, root, paths: list[str]) -> Path:
    """A `vse embed`-layout folder written by hand: len(paths) unit vectors, their metadata, embed.json
    recording `root` (left out when None)."""
    (dir / "img_emb").mkdir(parents=True)
    (dir / "metadata").mkdir()
    x = np.random.default_rng(0).normal(size=(len(paths), DIM)).astype(np.float32)
    np.save(dir / "img_emb" / "img_emb_0.npy", x / np.linalg.norm(x, axis=1, keepdims=True))
    table = pa.table(
        {"image_path": paths, "caption": [None] * len(paths), "id": [str(i) for i in range(len(paths))]}
    )
    pq.write_table(table, dir / "metadata" / "metadata_0.parquet")
    info = {
        "format": "vsekit-embeddings/1",
        "model": FINGERPRINT,
        "image_emb_shape": [DIM],
        "written_rows": len(paths),
    }
    if root is not None:
        info["root"] = root
    (dir / "embed.json").write_text(json.dumps(info))
    return dir


def _one_line_error(capsys, argv: list[str], *words: str) -> str:
    capsys.readouterr()
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, (rc, err)
    assert err.count("\n") == 1 and all(w in err for w in words), err
    return err


def test_s_d28_an_embeddings_root_outside_the_named_folder_is_refused(tmp_path, capsys):
    """S-D28: embed.json's `root: "/"` would let `vse serve` read any picture on the machine; the root must
    lie inside the folder the user named (the embeddings folder, or --images-root), else one line, exit 2,
    nothing written."""
    pics = tmp_path / "pics"
    pics.mkdir()
    emb = _embeddings(tmp_path / "emb", "/", ["/etc/passwd", str(pics / "a.png")])
    out = tmp_path / "idx"
    argv = ["index", "--from-embeddings", str(emb), "--out", str(out)]
    _one_line_error(capsys, argv, "embed.json", "'/' points outside", "--images-root")
    _one_line_error(capsys, [*argv, "--images-root", str(pics)], "'/' points outside --images-root")
    assert not out.exists()
    for bad_root in ("../pics", "~/pics", str(pics / ".." / "..")):
        (emb / "embed.json").write_text(
            json.dumps({"model": FINGERPRINT, "image_emb_shape": [DIM], "root": bad_root})
        )
        _one_line_error(capsys, argv, "points outside the embeddings folder")
    _one_line_error(
        capsys,
        ["index", "r", "pics", "--out", str(out), "--images-root", str(pics)],
        "goes with --from-embeddings",
    )
    assert not out.exists()

    # the pictures' folder named on the command line (or one above it): its root is used, read inside it
    (emb / "embed.json").write_text(
        json.dumps({"model": FINGERPRINT, "image_emb_shape": [DIM], "root": str(pics)})
    )
    assert main([*argv, "--images-root", str(tmp_path)]) == 0
    from vsekit.search.index import SearchIndex

    idx = SearchIndex(out)
    assert [str(r) for r in idx.roots] == [str(pics.resolve())]
    assert idx.picture_file(0) is None  # /etc/passwd is outside the root: never read
    assert "/etc/passwd" not in idx.pictures[0]["path"]  # … nor shown: the row keeps a CHUNK:ROW label
    assert "outside the pictures' root" in capsys.readouterr().err
    # a folder that records no root: its pictures are looked for inside it
    emb2 = _embeddings(tmp_path / "emb2", None, ["a.png"])
    assert main(["index", "--from-embeddings", str(emb2), "--out", str(tmp_path / "idx2")]) == 0
    assert [str(r) for r in SearchIndex(tmp_path / "idx2").roots] == [str(emb2.resolve())]


def test_r_d20_a_fifo_in_an_embeddings_folder_never_blocks(tmp_path):
    """R-D20: a FIFO named img_emb_0.npy (or metadata_0.parquet) is one line, exit 2, at once (it hung)."""
    emb = _embeddings(tmp_path / "emb", None, ["a.png"])
    for name in ("img_emb/img_emb_0.npy", "metadata/metadata_0.parquet"):
        target = emb / name
        keep = target.with_name("kept")
        target.rename(keep)
        os.mkfifo(target)
        cmd = [
            sys.executable,
            "-m",
            "vsekit.cli",
            "index",
            "--from-embeddings",
            str(emb),
            "--out",
            str(tmp_path / "i"),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"vse index --from-embeddings blocked on the FIFO {name}")
        finally:
            target.unlink()
            keep.rename(target)
        assert proc.returncode == 2, proc.stderr
        assert proc.stderr.count("\n") == 1 and "FIFO" in proc.stderr and target.name in proc.stderr, (
            proc.stderr
        )


def _npy_header(shape, descr: str = "<f4") -> bytes:
    header = repr({"descr": descr, "fortran_order": False, "shape": shape}).encode()
    header += b" " * (63 - (10 + len(header)) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header


@pytest.mark.parametrize("kind", ["objects", "text", "claims_200gb", "dev_zero", "v2_4gb_header", "strings"])
def test_c_d19_foreign_npy_files_are_one_line(tmp_path, capsys, kind):
    """C-D19: each of these was an internal error (raw np.load); now one line naming the file, exit 2, with
    nothing mapped or read beyond the header."""
    emb = _embeddings(tmp_path / "emb", None, ["a.png"])
    target = emb / "img_emb" / "img_emb_0.npy"
    target.unlink()
    expect = {
        "objects": "Python objects",
        "text": "looks like a text file",
        "claims_200gb": "truncated",
        "dev_zero": "character device",
        "v2_4gb_header": "header claims",
        "strings": "expected floating-point",
    }[kind]
    if kind == "objects":
        np.save(target, np.array([[{"a": 1}]], dtype=object), allow_pickle=True)
    elif kind == "text":
        target.write_text("0.1 0.2 0.3\n")
    elif kind == "claims_200gb":  # 10^8 x 512 float32 = 204.8 GB claimed by a 1 KB file
        target.write_bytes(_npy_header((10**8, 512)) + b"\0" * 1024)
    elif kind == "dev_zero":
        target.symlink_to("/dev/zero")
    elif kind == "v2_4gb_header":
        target.write_bytes(b"\x93NUMPY\x02\x00" + (0xFFFFFFF0).to_bytes(4, "little") + b"{" * 100)
    else:
        np.save(target, np.array([["x"] * DIM]))
    err = _one_line_error(
        capsys,
        ["index", "--from-embeddings", str(emb), "--out", str(tmp_path / "i")],
        "img_emb_0.npy",
        expect,
    )
    assert "internal error" not in err
    assert not (tmp_path / "i").exists()


def test_c_d19_open_npy_checks_the_header_against_the_file_size(tmp_path):
    """The one .npy reader: a header's shape x itemsize is compared with the file's size before mapping
    (hand count: 2 x 3 float64 = 48 bytes after the 128-byte header numpy 2 writes), and a good file is still a memmap."""
    good = tmp_path / "good.npy"
    np.save(good, np.arange(6, dtype=np.float64).reshape(2, 3))
    assert good.stat().st_size == 128 + 48
    a = open_npy(good)
    assert isinstance(a, np.memmap) and a.shape == (2, 3) and a[1, 2] == 5.0
    cut = tmp_path / "cut.npy"
    cut.write_bytes(good.read_bytes()[:-1])
    with pytest.raises(ValueError, match=r"cut\.npy: not a plain numeric \.npy array .*176 bytes.*holds 175"):
        open_npy(cut)
    empty_rows = tmp_path / "none.npy"
    np.save(empty_rows, np.zeros((0, 4), np.float32))
    assert open_npy(empty_rows).shape == (0, 4)
    os.mkfifo(tmp_path / "fifo.npy")
    with pytest.raises(ValueError, match="is not a regular file"):
        open_npy(tmp_path / "fifo.npy")
