"""Webdataset shards and table cells made by someone else (issue: untrusted inputs): every member and cell is
bounded, checked and reported by name before it is used.

Tar files are built in memory here with `tarfile` and then cut or patched byte by byte; a member that
declares 20 GB is a hand-written header over a short body (nothing big is ever written). Tests whose failure
would exhaust memory run `vse` in a subprocess whose address space is capped 1 GiB above what its imports
need (RLIMIT_AS), under a timeout.
"""

from __future__ import annotations

import io
import json
import struct
import subprocess
import sys
import tarfile
import zlib
from pathlib import Path

import pytest
from PIL import Image

from vsekit.cli import main
from vsekit.datasets import own_shards, own_sources
from vsekit.datasets.own_pairs import BAD_NAME, BROKEN_SHARD, UNREADABLE
from vsekit.datasets.own_shards import brace_count, expand_braces, read_webdataset

PIXELS = ["--pixels", "--no-progress", "--dev", "0", "--test", "0"]


def png(px: int = 8, colour: tuple[int, int, int] = (200, 20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (px, px), colour).save(buf, format="PNG")
    return buf.getvalue()


def png_header(width: int, height: int, idat: int = 1024) -> bytes:
    """The start of a PNG declaring width x height: signature, IHDR, and an IDAT chunk of `idat` zero bytes
    (PIL's open reads up to the IDAT's head to know the size, nothing after it)."""
    ihdr = b"IHDR" + struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + ihdr + struct.pack(">I", zlib.crc32(ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk + struct.pack(">I", idat) + b"IDAT" + bytes(idat + 4)


def tar_bytes(
    members: list[tuple[str, bytes]], fmt: int = tarfile.PAX_FORMAT, encoding: str = "utf-8"
) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, encoding=encoding) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def without_end(data: bytes) -> bytes:
    """The tar up to the end of its last member (the end-of-archive blocks dropped), to append to."""
    last = tarfile.open(fileobj=io.BytesIO(data)).getmembers()[-1]
    return data[: last.offset_data + -(-last.size // tarfile.BLOCKSIZE) * tarfile.BLOCKSIZE]


def three_samples() -> bytes:
    """k0, k1, k2: each a 512-byte-block header + one block of PNG, then a header + one block of caption."""
    return tar_bytes(
        [m for k in range(3) for m in ((f"k{k}.png", png(8 + k)), (f"k{k}.txt", f"caption {k}".encode()))],
        fmt=tarfile.GNU_FORMAT,
    )


def problems_of(out: Path) -> dict[str, int]:
    return json.loads((out / "manifest.json").read_text())["problems"]


LIMITED = """
import resource, sys
import PIL.Image
import vsekit.cli, vsekit.commands.own_data, vsekit.datasets.own_pairs  # `vse data`'s imports, before the cap
size = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:")) * 1024
cap = size + (1 << 30)
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
sys.exit(vsekit.cli.main(sys.argv[1:]))
"""


def run_capped(args: list[str], timeout: float = 180) -> subprocess.CompletedProcess:
    """`vse ARGS` in a subprocess with 1 GiB of address space beyond its imports, killed after `timeout` s."""
    if not Path("/proc/self/status").is_file():
        pytest.skip("needs /proc to size the memory cap")
    return subprocess.run(
        [sys.executable, "-c", LIMITED, *args], capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------------------- S7: sizes, pixels, links


def test_s7_members_declaring_20_gb_are_refused_unread_under_a_memory_cap(tmp_path):
    big = 20 * 10**9
    info = tarfile.TarInfo("big.png")
    info.size = big  # base-256 in the size field: 20 GB declared, 1 KB present
    head = without_end(
        tar_bytes([("ok.png", png()), ("ok.txt", b"a red square"), ("big.txt", b"a huge one")])
    )
    (tmp_path / "a.tar").write_bytes(head + info.tobuf(tarfile.GNU_FORMAT) + png_header(16, 16) + bytes(1000))
    longname = tarfile.TarInfo("././@LongLink")  # a GNU long-name record tarfile itself would read whole
    longname.type, longname.size = tarfile.GNUTYPE_LONGNAME, big
    (tmp_path / "b.tar").write_bytes(
        without_end(tar_bytes([("b0.png", png(9)), ("b0.txt", b"another")], fmt=tarfile.GNU_FORMAT))
        + longname.tobuf(tarfile.GNU_FORMAT)
        + b"x" * 2048
    )
    out = tmp_path / "out"
    r = run_capped(
        ["data", "webdataset", str(tmp_path / "a.tar"), str(tmp_path / "b.tar"), "--out", str(out), *PIXELS]
    )
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stderr.splitlines()
    said = [line for line in lines if "a.tar:big.png" in line]
    assert said and f"{big} bytes is more than the" in said[0] and "not read" in said[0], r.stderr
    said = [line for line in lines if "b.tar: broken shard" in line]
    assert said and "more than the" in said[0] and "unreadable after 2 member(s)" in said[0], r.stderr
    assert json.loads((out / "manifest.json").read_text())["counts"]["pictures"] == 2  # ok.png and b0.png


def test_s7_a_picture_is_checked_from_its_header_and_only_regular_members_are_read(tmp_path):
    data = tar_bytes(
        [
            ("ok.png", png()),
            ("ok.txt", b"fine"),
            ("wide.png", png_header(9000, 8000)),
            ("wide.txt", b"72 M pixels"),
            ("huge.png", png_header(30000, 30000)),
            ("huge.txt", b"900 M pixels"),
        ]
    )  # (the headers say so; no pixel follows)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tf:  # links and a FIFO named like sample members
        for name, kind in (
            ("ln.png", tarfile.SYMTYPE),
            ("hard.png", tarfile.LNKTYPE),
            ("fifo.txt", tarfile.FIFOTYPE),
        ):
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, "/etc/passwd" if kind != tarfile.FIFOTYPE else ""
            tf.addfile(info)
        for name in ("ln.txt", "hard.txt"):
            info = tarfile.TarInfo(name)
            info.size = 3
            tf.addfile(info, io.BytesIO(b"cap"))
    (tmp_path / "s.tar").write_bytes(without_end(data) + buf.getvalue())
    got = read_webdataset([str(tmp_path / "s.tar")])
    assert [i.key for i in got.items] == ["ok"]
    by_name = {p.name.rsplit(":", 1)[-1]: p for p in got.problems}
    assert (
        by_name["wide.png"].kind == UNREADABLE
        and "9000x8000 pixels is larger than" in by_name["wide.png"].detail
    )
    assert by_name["huge.png"].kind == UNREADABLE and "larger than the" in by_name["huge.png"].detail
    for name in ("ln.png", "hard.png", "fifo.txt"):
        assert by_name[name].kind == BROKEN_SHARD and "not a regular file" in by_name[name].detail, name


# ------------------------------------------------------------------------------------ P3: brace patterns


def test_p3_a_billion_name_pattern_is_refused_before_it_is_expanded(tmp_path):
    assert brace_count("s-{0..999}{0..999}{0..999}.tar") == 1000**3  # counted, not expanded
    assert brace_count("{a,b,c}-{08..10}-{x}") == 3 * 3 and expand_braces("{a,b}-{08..10}")[:2] == [
        "a-08",
        "a-09",
    ]
    with pytest.raises(ValueError, match=r"more than 10\*\*18"):
        expand_braces("s-{0.." + "9" * 5000 + "}.tar")
    pattern = str(tmp_path / "{0..999}{0..999}{0..999}.tar")
    r = run_capped(["data", "webdataset", pattern, "--out", str(tmp_path / "out"), *PIXELS], timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and pattern in err[0] and "1000000000 shard names" in err[0], r.stderr
    assert "internal error" not in r.stderr and "memory" not in r.stderr


# ------------------------------------------------------------------------------------ W1: truncated shards


@pytest.mark.parametrize(
    "cut", ["inside a header", "at a member's end", "inside the last member", "bad header"]
)
def test_w1_a_shard_cut_short_is_a_problem_naming_it_and_strict_stops(cut, tmp_path, capsys):
    whole = three_samples()
    k2 = 4 * 2 * tarfile.BLOCKSIZE  # k0.png, k0.txt, k1.png, k1.txt: a header block and a data block each
    data = {
        "inside a header": whole[: k2 + 100],
        "at a member's end": whole[:k2],
        "inside the last member": whole[: k2 + tarfile.BLOCKSIZE + 40],
        "bad header": whole[:k2] + b"\x07" * tarfile.BLOCKSIZE + bytes(2 * tarfile.BLOCKSIZE),
    }[cut]
    shard = tmp_path / "s-000.tar"
    shard.write_bytes(data)
    out = tmp_path / "out"
    assert main(["data", "webdataset", str(shard), "--out", str(out), *PIXELS]) == 0
    err = capsys.readouterr().err
    assert f"{shard}: broken shard" in err, err
    assert problems_of(out)[BROKEN_SHARD] == 1
    ids = (out / "train_ids.txt").read_text().split()
    assert ids == ["k0", "k1"]  # the samples before the cut are used; k2 (cut) is not
    assert (
        main(["data", "webdataset", str(shard), "--out", str(tmp_path / "strict"), "--strict", *PIXELS]) == 2
    )
    err = capsys.readouterr().err
    assert "--strict" in err and f"{shard}: broken shard" in err and not (tmp_path / "strict").exists()


def test_w1_an_intact_shard_has_no_problem(tmp_path, capsys):
    (tmp_path / "s.tar").write_bytes(three_samples())
    got = read_webdataset([str(tmp_path / "s.tar")])
    assert [i.key for i in got.items] == ["k0", "k1", "k2"] and got.problems == []


# ------------------------------------------------------------------------------------ C2, C4: names and JSON


def test_c2_a_member_name_that_is_not_utf8_is_skipped_before_any_feature_work(tmp_path, capsys):
    pytest.importorskip("efficientnet_lite_pytorch")
    shard = tmp_path / "s.tar"  # GNU format writes the name's bytes as they are: 'café' in Latin-1
    shard.write_bytes(
        tar_bytes(
            [
                ("caf\xe9.png", png()),
                ("caf\xe9.txt", b"a cafe"),
                ("ok.png", png(9, (0, 0, 200))),
                ("ok.txt", b"a blue square"),
            ],
            fmt=tarfile.GNU_FORMAT,
            encoding="latin-1",
        )
    )
    out = tmp_path / "out"
    args = [
        "data",
        "webdataset",
        str(shard),
        "--out",
        str(out),
        "--dev",
        "0",
        "--test",
        "0",
        "--image-size",
        "64",
        "--device",
        "cpu",
        "--no-progress",
    ]
    assert main(args) == 0
    err = capsys.readouterr().err
    assert f"{shard}:caf\\xe9.png: bad file name: the member name is not valid UTF-8" in err, err
    assert problems_of(out)[BAD_NAME] == 2  # the picture and its caption member
    assert (out / "train_ids.txt").read_text().split() == ["ok"] and not (out / ".staging").exists()


def test_c4_deeply_nested_json_is_a_problem_not_a_crash(tmp_path, capsys):
    shard = tmp_path / "s.tar"
    shard.write_bytes(
        tar_bytes(
            [
                ("a.png", png()),
                ("a.json", b"[" * 200_000 + b"]" * 200_000),
                ("b.png", png(9)),
                ("b.json", json.dumps({"caption": "a small red square"}).encode()),
                ("c.png", png(10)),
                ("c.json", json.dumps({"caption": {"en": "x"}}).encode()),
            ]
        )
    )
    out = tmp_path / "out"
    assert main(["data", "webdataset", str(shard), "--out", str(out), *PIXELS]) == 0
    err = capsys.readouterr().err
    assert f"{shard}:a.json: unreadable captions: nested more than 64 levels deep" in err, err
    assert f'{shard}:c.json: unreadable captions: its "caption" is dict' in err, err
    assert (out / "train_caps.txt").read_text() == "a small red square\n"


# ------------------------------------------------------------------------------------ W3, P6: table cells


def test_w3_parquet_columns_that_are_not_text_are_refused_naming_table_and_column(tmp_path, capsys):
    """A parquet column has one type for all its rows: bytes, numbers or a struct where text belongs would
    turn every cell into a Python repr (`b'red.png'`, `{'a': 'x'}`), so the column is refused before any row."""
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    for name, px in (("red.png", 8), ("blue.png", 9)):
        (tmp_path / name).write_bytes(png(px))
    paths = pa.array(["red.png", "blue.png"])

    def err_of(name: str, table, *extra: str) -> str:
        pq.write_table(table, tmp_path / name)
        assert (
            main(
                [
                    "data",
                    "table",
                    str(tmp_path / name),
                    "--out",
                    str(tmp_path / "o"),
                    *(extra or PIXELS[2:]),
                    *PIXELS[:2],
                ]
            )
            == 2
        )
        return capsys.readouterr().err

    err = err_of("b.parquet", pa.table({"image": pa.array([b"red.png", b"blue.png"]), "caption": ["a", "b"]}))
    assert f"{tmp_path / 'b.parquet'}: column 'image' holds binary, not text (paths)" in err, err
    err = err_of("s.parquet", pa.table({"image": paths, "caption": pa.array([{"a": "x"}, {"a": "y"}])}))
    assert "s.parquet: column 'caption' holds struct<a: string>, not text or lists of text" in err, err
    err = err_of("n.parquet", pa.table({"image": paths, "caption": pa.array([[1, 2], [3]])}))
    assert "n.parquet: column 'caption' holds list<" in err and "int64>, not text or lists of text" in err, (
        err
    )
    err = err_of(
        "k.parquet",
        pa.table({"image": paths, "caption": ["a", "b"], "kind": pa.array([b"train", b"dev"])}),
        "--split-col",
        "kind",
    )
    assert "k.parquet: column 'kind' holds binary, not text (splits)" in err, err
    assert not (tmp_path / "o").exists()
    good = pa.table(
        {
            "image": paths.dictionary_encode(),  # text in any of arrow's string encodings
            "caption": pa.array(
                [["a red square", None, "red"], ["a blue square"]], pa.list_(pa.large_string())
            ),
            "note": pa.array([1, 2]),
        }
    )  # (a column not used may hold anything)
    pq.write_table(good, tmp_path / "g.parquet")
    out = tmp_path / "g"
    assert main(["data", "table", str(tmp_path / "g.parquet"), "--out", str(out), *PIXELS]) == 0
    assert sorted((out / "train_caps.txt").read_text().splitlines()) == [
        "a blue square",
        "a red square",
        "red",
    ]


def test_p6_a_bad_byte_is_reported_at_its_own_line(tmp_path, capsys):
    (tmp_path / "red.png").write_bytes(png())

    def err_of(data: bytes) -> str:
        (tmp_path / "t.csv").write_bytes(data)
        assert main(["data", "table", str(tmp_path / "t.csv"), "--out", str(tmp_path / "o"), *PIXELS]) == 2
        return capsys.readouterr().err.strip()

    err = err_of(b"image,caption\nred.png,a red square\nred.png,caf\xe9 au lait\n")  # data row 2 = line 3
    assert err.endswith("t.csv:3: not UTF-8 text (byte 12 of the line)") and "header" not in err, err
    lines = [b"\xef\xbb\xbfimage,caption\n"] + [b"red.png,caption %d\n" % i for i in range(2000)]
    lines[1502] = b"red.png,a bad \xff byte\n"  # line 1503, far past the first 8 KB a text reader decodes
    assert err_of(b"".join(lines)).endswith("t.csv:1503: not UTF-8 text (byte 15 of the line)")
    assert "t.csv:1: not UTF-8 text (byte 3 of the line)" in err_of(b"im\xffage,caption\nred.png,a\n")
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------------ bounds on every loop


def test_members_per_shard_rows_per_table_and_line_length_are_bounded(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(own_shards, "MAX_SHARD_MEMBERS", 4)
    (tmp_path / "s.tar").write_bytes(three_samples())  # 6 members
    got = read_webdataset([str(tmp_path / "s.tar")])
    assert [i.key for i in got.items] == ["k0", "k1"]
    assert [(p.kind, p.detail) for p in got.problems] == [
        (BROKEN_SHARD, "more than 4 members; the rest of the shard is not read")
    ]
    monkeypatch.setattr(own_shards, "MAX_SHARD_MEMBERS", 6)  # exactly the bound: nothing left unread
    assert read_webdataset([str(tmp_path / "s.tar")]).problems == []
    monkeypatch.setattr(own_sources, "MAX_TABLE_ROWS", 3)
    (tmp_path / "red.png").write_bytes(png())
    table = tmp_path / "t.csv"
    table.write_text("image,caption\n" + "".join(f"red.png,caption {i}\n" for i in range(4)))
    assert main(["data", "table", str(table), "--out", str(tmp_path / "o"), *PIXELS]) == 2
    assert "t.csv: more than 3 rows" in capsys.readouterr().err
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(
        pa.table({"image": ["red.png"] * 4, "caption": [f"caption {i}" for i in range(4)]}),
        tmp_path / "t.parquet",
    )
    assert main(["data", "table", str(tmp_path / "t.parquet"), "--out", str(tmp_path / "o"), *PIXELS]) == 2
    assert "t.parquet: 4 rows, more than the 3 vsekit reads" in capsys.readouterr().err
    monkeypatch.setattr(own_sources, "MAX_TABLE_LINE_BYTES", 100)
    table.write_text("image,caption\nred.png," + "x" * 200 + "\n")
    assert main(["data", "table", str(table), "--out", str(tmp_path / "o"), *PIXELS]) == 2
    assert "t.csv:2: a line longer than 100 bytes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="more than the 5 vsekit reads"):
        expand_braces("s-{0..5}.tar", limit=5)
