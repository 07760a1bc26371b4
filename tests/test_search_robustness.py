"""Bad input to `vse index` / `vse embed` / `vse search` / `vse serve` from a user/attacker probe: every case
is a one-line error (exit 2) or a reported skip, decided before work is wasted, and leaves nothing behind."""

import json
import os
import shlex
import shutil
import socket
import struct
import subprocess
import sys
import time
import warnings
import zlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import interrupt_on_call
from vsekit.cli import main
from vsekit.data.precomp import DataFormatError
from vsekit.errors import VseInputError

pytest.importorskip("faiss")
pytest.importorskip("efficientnet_lite_pytorch")

from vsekit.search.index import IndexFormatError, SearchIndex, build_index, resolve_source  # noqa: E402


def quiet(*_):
    pass


def png_header(width: int, height: int) -> bytes:
    """A PNG signature + IHDR (+ IEND): enough for PIL to open it and read its size, no pixels."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + chunk(b"IEND", b"")
    )


def pictures(data, folder, n):
    """`n` shapes pictures copied into `folder`."""
    folder.mkdir(parents=True, exist_ok=True)
    for p in sorted((data / "images").glob("test_*.png"))[:n]:
        shutil.copy(p, folder / p.name)
    return folder


def index_argv(run, source, out, *extra):
    return ["index", str(run), str(source), "--out", str(out), "--quiet", "--device", "cpu", *extra]


# ------------------------------------------------------------------------ numbers at parse time (3, 4)
# (`vse search -k / --nprobe / --ef-search` keep their own checks: one line, exit 2, as test_search_index expects)

BAD_NUMBERS = [
    ("index", "--chunk-size", "0"),
    ("index", "--batch-size", "-1"),
    ("index", "--chunk-size", "abc"),
    ("index", "--nlist", "-1"),
    ("index", "--nlist", "99999999999"),
    ("index", "--pq-m", "-2"),
    ("index", "--pq-refine", "-1"),
    ("index", "--nprobe", "0"),
    ("index", "--hnsw-m", "1"),
    ("index", "--ef-construction", "0"),
    ("index", "--ef-search", "0"),
    ("embed", "--chunk-size", "0"),
    ("embed", "--batch-size", "-1"),
    ("embed", "--workers", "-1"),
    ("serve", "--port", "99999"),
    ("serve", "--port", "-1"),
    ("serve", "--max-k", "0"),
    ("serve", "--max-query-chars", "-5"),
    ("serve", "--max-body-mb", "-1"),
    ("serve", "--max-connections", "0"),
    ("serve", "--rate-limit", "-1"),
    ("serve", "--rate-limit", "nan"),
    ("serve", "--rate-burst", "0"),
    ("serve", "--timeout", "-1"),
    ("serve", "--timeout", "inf"),
    ("serve", "--threads", "-1"),
]


@pytest.mark.parametrize("verb,flag,value", BAD_NUMBERS)
def test_bad_numbers_are_refused_while_parsing(verb, flag, value, tmp_path, capsys, monkeypatch):
    import vsekit.search.index as index_mod

    monkeypatch.setattr(index_mod, "build_index", None)  # nothing may run: the parser refuses the value
    out = tmp_path / "out"
    argv = {
        "index": ["index", "RUN", "SOURCE", "--out", str(out)],
        "embed": ["embed", "RUN", "SOURCE", "--out", str(out)],
        "serve": ["serve", str(out)],
    }[verb]
    try:
        rc = main([*argv, flag, value])
    except SystemExit as e:  # a word where a number belongs: argparse's own usage error
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    if value == "abc":
        assert err.strip().splitlines()[-1] == f"vse {verb}: error: argument {flag}: invalid int value: 'abc'"
    else:
        assert err.count("\n") == 1 and err.startswith(f"vse {verb}: error: {flag} must be "), err
        assert err.rstrip().endswith(f", got {float(value) if flag in FLOATS else value}"), err
    assert not out.exists()  # nothing was written


FLOATS = ("--rate-limit", "--timeout")


def test_search_k_is_checked_while_parsing(tmp_path, capsys):
    assert main(["search", str(tmp_path / "no-index"), "a query", "-k", "0"]) == 2
    assert capsys.readouterr().err == "vse search: error: -k must be at least 1, got 0\n"


def test_serve_on_a_taken_port_is_one_line(tmp_path, capsys):
    pytest.importorskip("uvicorn")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert main(["serve", str(tmp_path / "idx"), "--port", str(port), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"vse serve: error: --host 127.0.0.1 --port {port}: cannot listen there" in err
    ), err


def test_serve_port_0_prints_the_port_it_got(tmp_path, monkeypatch, capsys):
    uvicorn = pytest.importorskip("uvicorn")
    import vsekit.search.server as server_mod

    seen = {}
    monkeypatch.setattr(server_mod, "create_app", lambda *a, **k: "app")

    def fake_run(self, sockets=None):
        seen["port"], seen["config"] = sockets[0].getsockname()[1], self.config.port

    monkeypatch.setattr(uvicorn.Server, "run", fake_run)
    assert main(["serve", str(tmp_path), "--port", "0", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert seen["port"] > 0 and seen["config"] == seen["port"]
    assert f"on http://127.0.0.1:{seen['port']}  (Ctrl-C stops)" in err and ":0 " not in err


# ------------------------------------------------------------------- a failed first build (1)


@pytest.mark.slow
def test_failed_first_index_leaves_nothing_and_the_rerun_works(shapes_model, tmp_path, monkeypatch, capsys):
    import vsekit.search.encode as encode_mod

    data, run = shapes_model
    pics = pictures(data, tmp_path / "pics", 5)
    (pics / "zz_broken.png").write_bytes(b"not a picture")
    out = tmp_path / "idx"
    # fails late: 6 pictures pass the early check of --nlist 6, one is unreadable, 5 vectors cannot train 6 lists
    assert main(index_argv(run, pics, out, "--index", "ivf", "--nlist", "6")) == 2
    assert not out.exists()  # no segments/, no .work, no folder
    assert (
        "--nlist 6: an IVF index with 6 lists needs at least 6 vectors to train, got 5"
        in capsys.readouterr().err
    )
    out.mkdir()  # a folder that was there before stays, as it was
    assert main(index_argv(run, pics, out, "--index", "ivf", "--nlist", "6")) == 2
    assert out.is_dir() and list(out.iterdir()) == []
    # hopeless from the start: refused before a single picture is embedded
    calls = []
    real = encode_mod.ImageEmbedder.embed
    monkeypatch.setattr(
        encode_mod.ImageEmbedder, "embed", lambda self, px: calls.append(len(px)) or real(self, px)
    )
    assert main(index_argv(run, pics, out, "--index", "ivf", "--nlist", "1000")) == 2
    err = capsys.readouterr().err
    assert "--nlist 1000: an IVF index with 1000 lists needs at least 1000 vectors to train, got 6" in err
    assert calls == [] and list(out.iterdir()) == []
    assert (
        main(index_argv(run, pics, out, "--index", "ivf", "--nlist", "2")) == 0
    )  # the message's advice works
    assert SearchIndex(out).n_pictures == 5 and calls


@pytest.mark.slow
def test_failed_add_leaves_the_index_as_it_was(shapes_model, tmp_path, monkeypatch):
    import vsekit.search.store as store_mod

    data, run = shapes_model
    out = tmp_path / "idx"
    build_index(run, f"{data}:test", out, progress=False, log=quiet)
    files = {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()}

    def disk_full(index, path):
        path.write_bytes(b"half a FAISS file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(store_mod, "write_faiss", disk_full)
    with pytest.raises(OSError, match="No space left"):
        build_index(run, f"{data}:dev", out, progress=False, log=quiet)
    assert {p.relative_to(out).as_posix(): p.read_bytes() for p in out.rglob("*") if p.is_file()} == files
    assert SearchIndex(out).n_pictures == 24


@pytest.mark.slow
def test_leftovers_of_a_killed_first_build_do_not_block_the_rerun(shapes_model, tmp_path):
    data, run = shapes_model
    out = tmp_path / "idx"
    (out / "segments" / "0000").mkdir(parents=True)
    (out / "segments" / "0000" / "pictures.jsonl").write_text("{}\n")
    (out / "images.g1.faiss").write_bytes(b"x")
    notes = []
    build_index(run, f"{data}:test", out, progress=False, log=notes.append)
    assert SearchIndex(out).n_pictures == 24
    assert any(
        "removing what an unfinished first `vse index` left (images.g1.faiss, segments)" in n for n in notes
    )
    user = tmp_path / "user"
    (user / "segments").mkdir(parents=True)
    (user / "notes.txt").write_text("mine")
    with pytest.raises(IndexFormatError, match="exists, is not empty and holds no index.json"):
        build_index(run, f"{data}:test", user, progress=False, log=quiet)
    assert (user / "notes.txt").read_text() == "mine" and (user / "segments").is_dir()


# --------------------------------------------------------------------- Ctrl-C and resuming (5, 7)


@pytest.mark.slow
def test_interrupted_index_says_how_to_resume(shapes_model, tmp_path, monkeypatch, capsys):
    import vsekit.search.build as build_mod

    data, run = shapes_model
    out = tmp_path / "my idx"
    calls = interrupt_on_call(monkeypatch, build_mod, "embed_features", 3)
    assert main(index_argv(run, f"{data}:test", out, "--chunk-size", "4", "--batch-size", "4")) == 130
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(
        "vse index: interrupted; 2 finished chunk(s) of embeddings are kept in"
    )
    command = err.split("resume with the same command: ")[1]
    assert sorted(p.name for p in out.iterdir()) == [".work"]  # the finished chunks, nothing else
    argv = shlex.split(command)
    assert argv[:2] == ["vse", "index"] and "--chunk-size" in argv
    assert main(argv[1:]) == 0
    assert calls["n"] == 3 + 6 - 2 and SearchIndex(out).n_pictures == 24  # 2 of 6 chunks were reused


@pytest.mark.slow
def test_index_resumed_with_another_chunk_size_keeps_every_picture(shapes_model, tmp_path, monkeypatch):
    import vsekit.search.build as build_mod

    data, run = shapes_model
    calls = interrupt_on_call(monkeypatch, build_mod, "embed_features", 3)
    with pytest.raises(KeyboardInterrupt):
        build_index(
            run, f"{data}:test", tmp_path / "idx", chunk_size=4, batch_size=4, progress=False, log=quiet
        )
    build_index(
        run, f"{data}:test", tmp_path / "idx", chunk_size=256, batch_size=4, progress=False, log=quiet
    )
    assert (
        SearchIndex(tmp_path / "idx").n_pictures == 24
    )  # the finished chunks of 4 were not taken for one of 256
    assert calls["n"] == 3 + 6 - 2


def _recording(module, attr, monkeypatch):
    """Replace module.attr (an embed function taking (model, items, ...)) by one that records each batch as the
    tuple of its items' bytes: what the model is fed, independent of floating point."""
    real = getattr(module, attr)
    batches = []

    def spy(model, items, *args, **kwargs):
        batches.append(tuple(np.asarray(x).tobytes() for x in items))
        return real(model, items, *args, **kwargs)

    monkeypatch.setattr(module, attr, spy)
    return batches


@pytest.mark.slow
def test_resumed_index_feeds_the_model_the_same_batches(shapes_model, tmp_path, monkeypatch):
    import vsekit.search.build as build_mod

    data, run = shapes_model
    torch.set_num_threads(1)
    kw = {"chunk_size": 5, "batch_size": 3, "progress": False, "log": quiet}
    batches = _recording(build_mod, "embed_features", monkeypatch)
    build_index(run, f"{data}:test", tmp_path / "ref", **kw)
    fresh = list(batches)
    assert [len(b) for b in fresh] == [3, 2] * 4 + [3, 1]  # chunks of 5 rows, each batched from its first row
    batches.clear()
    real = build_mod.embed_features

    def dies_in_chunk_1(model, items, *args, **kwargs):
        if len(batches) == 3:
            raise KeyboardInterrupt
        return real(model, items, *args, **kwargs)

    monkeypatch.setattr(build_mod, "embed_features", dies_in_chunk_1)
    with pytest.raises(KeyboardInterrupt):
        build_index(run, f"{data}:test", tmp_path / "idx", **kw)
    monkeypatch.setattr(build_mod, "embed_features", real)
    batches = _recording(build_mod, "embed_features", monkeypatch)
    build_index(run, f"{data}:test", tmp_path / "idx", **kw)
    assert batches == fresh[2:]  # chunk 0 (2 batches) reused, the rest in exactly the uninterrupted batches
    assert np.array_equal(
        SearchIndex(tmp_path / "idx").all_image_emb(), SearchIndex(tmp_path / "ref").all_image_emb()
    )


@pytest.mark.slow
def test_resumed_embed_feeds_the_model_the_same_batches(shapes_model, tmp_path, monkeypatch, capsys):
    import vsekit.search.embed as embed_mod
    import vsekit.search.encode as encode_mod

    data, run = shapes_model
    torch.set_num_threads(1)
    argv = [
        "embed",
        str(run),
        f"{data}:test",
        "--device",
        "cpu",
        "--no-progress",
        "--chunk-size",
        "5",
        "--batch-size",
        "3",
    ]
    batches = _recording(encode_mod, "embed_features", monkeypatch)
    assert main([*argv, "--out", str(tmp_path / "ref")]) == 0
    fresh = list(batches)
    assert [len(b) for b in fresh] == [3, 2] * 4 + [3, 1]
    batches.clear()
    real = embed_mod.write_chunk

    def dies_after_two(out_dir, name, *args, **kwargs):
        if name == "2":
            raise KeyboardInterrupt
        real(out_dir, name, *args, **kwargs)

    monkeypatch.setattr(embed_mod, "write_chunk", dies_after_two)
    assert main([*argv, "--out", str(tmp_path / "out")]) == 130
    err = capsys.readouterr().err
    assert (
        "interrupted; 2 finished chunk(s) are kept in" in err
        and "resume with the same command: vse embed" in err
    )
    monkeypatch.setattr(embed_mod, "write_chunk", real)
    batches.clear()
    assert main([*argv, "--out", str(tmp_path / "out")]) == 0
    assert (
        batches == fresh[4:]
    )  # chunks 0 and 1 (4 batches) kept; the rest batched as in the uninterrupted run
    for sub in ("img_emb", "text_emb", "metadata"):
        for p in sorted((tmp_path / "ref" / sub).iterdir()):
            assert (tmp_path / "out" / sub / p.name).read_bytes() == p.read_bytes(), p.name


# -------------------------------------------------------------------- names that are not UTF-8 (2)


def _non_utf8_folder(data, tmp_path):
    pics = pictures(data, tmp_path / "pics", 2)
    first, second = sorted(p.name for p in pics.iterdir())
    bad = os.fsdecode(os.fsencode(pics) + b"/caf\xe9.png")
    try:
        shutil.copy(pics / first, bad)
    except (OSError, UnicodeError):
        pytest.skip("this file system refuses file names that are not UTF-8")
    (pics / second).with_suffix(".txt").write_bytes(b"a caption \xff\n")
    return pics, first, second


@pytest.mark.slow
def test_names_that_are_not_utf8_are_skipped_before_embedding(shapes_model, tmp_path, monkeypatch, capsys):
    import vsekit.search.encode as encode_mod

    data, run = shapes_model
    pics, first, second = _non_utf8_folder(data, tmp_path)
    loaded = []
    real = encode_mod.ImageEmbedder.load
    monkeypatch.setattr(
        encode_mod.ImageEmbedder, "load", lambda self, p: loaded.append(str(p)) or real(self, p)
    )
    assert (
        main(index_argv(run, pics, tmp_path / "strict", "--strict")) == 2
    )  # decided before anything is loaded
    assert "caf\\xe9.png: its file name is not valid UTF-8" in capsys.readouterr().err
    assert loaded == [] and not (tmp_path / "strict").exists()

    assert main(index_argv(run, pics, tmp_path / "idx")) == 0
    err = capsys.readouterr().err
    assert (
        "warning: skipped " in err
        and "caf\\xe9.png: its file name is not valid UTF-8; rename it to index it" in err
    )
    assert f"{second[:-4]}.txt: not UTF-8 text" in err and "its captions were skipped" in err
    assert len(loaded) == 2 and all(n.isprintable() and "caf" not in n for n in loaded)  # never opened
    idx = SearchIndex(tmp_path / "idx")
    assert [(p["path"], p["caption"]) for p in idx.pictures] == [(first, None), (second, None)]
    skipped = json.loads((tmp_path / "idx" / "index.json").read_text())["segments"][0]["skipped"]
    assert len(skipped) == 2 and "caf\\xe9.png" in skipped[0]

    assert (
        main(
            ["embed", str(run), str(pics), "--out", str(tmp_path / "emb"), "--device", "cpu", "--no-progress"]
        )
        == 0
    )
    info = json.loads((tmp_path / "emb" / "embed.json").read_text())
    assert info["written_rows"] == 2 and len(info["skipped"]) == 2 and "caf\\xe9.png" in info["skipped"][0]
    assert "input_skipped" not in info


def test_caption_file_that_is_not_utf8_beside_one_picture_is_reported(tmp_path):
    (tmp_path / "one.png").write_bytes(png_header(4, 4))
    (tmp_path / "one.txt").write_bytes(b"\xff\xfe caption\n")
    src = resolve_source(str(tmp_path / "one.png"))
    assert src.paths == ["one.png"] and src.captions == []
    assert len(src.problems) == 1 and "one.txt: not UTF-8 text" in src.problems[0]


# ---------------------------------------------------------------- pictures over PIL's limit (5)


def test_picture_beyond_pils_limit_is_refused_without_a_warning(tmp_path):
    from vsekit.search.encode import open_image

    bomb = tmp_path / "bomb.png"
    bomb.write_bytes(png_header(10_000, 10_000))  # 100M pixels: PIL warns (it refuses only beyond 2x its 89M)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(DataFormatError, match=r"bomb.png: larger than the 64000000 pixel limit"):
            open_image(bomb)
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]
    big = tmp_path / "big.png"
    big.write_bytes(png_header(9_000, 8_000))  # under PIL's limit, over ours: the same policy
    with pytest.raises(DataFormatError, match=r"big.png: 9000x8000 pixels is larger than the 64000000 limit"):
        open_image(big)


@pytest.mark.slow
def test_index_skips_a_bomb_with_one_line_and_no_warning(shapes_model, tmp_path, capsys):
    data, run = shapes_model
    pics = pictures(data, tmp_path / "pics", 2)
    (pics / "bomb.png").write_bytes(png_header(10_000, 10_000))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert main(index_argv(run, pics, tmp_path / "idx")) == 0
    assert not [w for w in seen if issubclass(w.category, Image.DecompressionBombWarning)]
    lines = [ln for ln in capsys.readouterr().err.splitlines() if "bomb.png" in ln]
    assert len(lines) == 1 and "larger than the 64000000 pixel limit" in lines[0]
    assert SearchIndex(tmp_path / "idx").n_pictures == 2


def test_server_refuses_an_upload_beyond_pils_limit_with_413(recwarn):
    pytest.importorskip("fastapi")
    pytest.importorskip("httpx")
    import logging

    from fastapi.testclient import TestClient

    from vsekit.search.engine import SearchEngine
    from vsekit.search.server import create_app

    class Stub(SearchEngine):
        def __init__(self) -> None:
            self.index = SimpleNamespace(n_pictures=0, pictures=[], picture_file=lambda i: None)
            self.text = SimpleNamespace(unknown_words=lambda q: [])

        def picture_query_problem(self):
            return None

        def search_image(self, image, k=10, distinct=True):
            raise AssertionError("a bomb must not reach the model")

        def info(self) -> dict:
            return {"pictures": 0}

    app = create_app(Stub(), logger=logging.getLogger("vsekit.test.robustness"))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        r = client.post("/search/image?k=3", content=png_header(10_000, 10_000))
    assert r.status_code == 413 and "pixels" in r.json()["detail"]
    assert not [w for w in recwarn.list if issubclass(w.category, Image.DecompressionBombWarning)]


# ---------------------------------------------------------- a folder where a file was expected (6)


def test_wrong_kind_of_path_is_named(tmp_path, capsys):
    pytest.importorskip("pyarrow")
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert main(["index", "--from-embeddings", str(afile), "--out", str(tmp_path / "i")]) == 2
    err = capsys.readouterr().err
    assert f"{afile}: is a file, expected a folder" in err and not (tmp_path / "i").exists()
    with pytest.raises(IndexFormatError, match="afile: is a file, expected an index folder"):
        SearchIndex(afile)
    (tmp_path / "idx" / "index.json").mkdir(parents=True)
    with pytest.raises(IndexFormatError, match="index.json: is a folder, expected the index's JSON file"):
        SearchIndex(tmp_path / "idx")
    from vsekit.search.encode import open_image

    with pytest.raises(DataFormatError, match="is a folder, expected a picture file"):
        open_image(tmp_path / "idx")
    if hasattr(os, "mkfifo"):
        os.mkfifo(tmp_path / "fifo")
        with pytest.raises(DataFormatError, match="fifo: is not a regular file or folder"):
            resolve_source(str(tmp_path / "fifo"))


@pytest.mark.slow
def test_captions_option_naming_a_folder_fails_before_embedding(shapes_model, tmp_path, capsys):
    data, run = shapes_model
    assert main(index_argv(run, f"{data}:test", tmp_path / "idx", "--captions", str(tmp_path))) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path}: is a folder, expected a text file of captions" in err
    assert not (tmp_path / "idx").exists()


# --------------------------------------------------------------------------- a real server (4)


@pytest.mark.slow
def test_vse_serve_port_0_answers_on_the_port_it_prints(shapes_model, tmp_path):
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("uvicorn")
    data, run = shapes_model
    build_index(run, f"{data}:test", tmp_path / "idx", progress=False, log=quiet)
    cmd = [
        sys.executable,
        "-m",
        "vsekit.cli",
        "serve",
        str(tmp_path / "idx"),
        "--port",
        "0",
        "--device",
        "cpu",
        "--log-level",
        "warning",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 120
        while "serving" not in line and time.monotonic() < deadline and proc.poll() is None:
            line = proc.stderr.readline()
        assert "serving" in line, line
        port = int(line.split("http://127.0.0.1:")[1].split()[0])
        assert port > 0
        r = None
        for _ in range(100):
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        assert r is not None and r.status_code == 200 and r.json()["pictures"] == 24
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def test_library_checks_stay_for_callers_without_the_cli(tmp_path):
    from vsekit.search.index import FaissParams, encode_resumable

    with pytest.raises(VseInputError, match="--chunk-size and --batch-size must be >= 1"):
        encode_resumable(
            tmp_path / "w", 3, lambda i: i, lambda items: torch.zeros(len(items), 2), chunk_size=0
        )
    with pytest.raises(VseInputError, match="hnsw_m must be >= 2"):
        FaissParams("hnsw", hnsw_m=1).validate()  # FAISS segfaults building a graph of degree 1
    with pytest.raises(VseInputError, match="ef_search must be <= 2147483647"):
        FaissParams(
            "hnsw", ef_search=2**31
        ).validate()  # `vse search --ef-search N`: an OverflowError in FAISS
