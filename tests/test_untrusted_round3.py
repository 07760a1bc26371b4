"""Untrusted folders and shards, the probe's defects: hard links (S-D1), terminal injection (S-D9),
file/folder clashes and over-long member names (C-D4, C-D5), JSON captions outside the bounds (C-D6/D7)
and shard samples that vanished without a report (P-D10). Each test names its defect id.

Shards are built in memory with `tarfile`; hostile inputs are also run in a subprocess under a 2 GiB
address-space limit (RLIMIT_AS), where they must end with exit 0 or 2 and never an internal error.
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from vsekit.cli import build_parser, main
from vsekit.data.untrusted import UntrustedFileError, read_bounded, read_inside
from vsekit.datasets.own_sources import read_folder, read_table
from vsekit.search.sources import resolve_source

PIXELS = ["--pixels", "--no-progress", "--dev", "0", "--test", "0"]
SECRET = "root:x:0:0:SECRET-never-a-caption"
FORGED = "\x1b[2K\rFAKE: dataset ready, 0 problems"
TITLE = "\x1b]0;owned\x07"
MEMORY_LIMIT = 2 << 30  # bytes of address space for one hostile `vse data` run
NAME_MAX = 255


def png(px: int = 8, colour: tuple[int, int, int] = (200, 20, 20)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (px, px), colour).save(buf, format="PNG")
    return buf.getvalue()


def tar_bytes(members: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def problems_txt(out: Path) -> str:
    return (out / "problems.txt").read_text(encoding="utf-8")


def folder_with_link(tmp_path: Path) -> tuple[Path, Path]:
    """A folder whose p0.txt is a hard link to a file outside it (p1 is an ordinary pair); the folder and
    the outside file."""
    secret = tmp_path / "outside" / "passwd"
    secret.parent.mkdir()
    secret.write_text(SECRET + "\n")
    root = tmp_path / "pics"
    root.mkdir()
    (root / "p0.png").write_bytes(png(8, (10, 200, 10)))
    os.link(secret, root / "p0.txt")
    (root / "p1.png").write_bytes(png(9, (200, 10, 10)))
    (root / "p1.txt").write_text("a red square\n")
    return root, secret


# ------------------------------------------------------------------------------------------- S-D1


def test_s_d1_hard_link_caption_refused_by_vse_data_folder_unless_trusted(tmp_path, capsys):
    root, _ = folder_with_link(tmp_path)
    out = tmp_path / "out"
    assert main(["data", "folder", str(root), "--out", str(out), *PIXELS]) == 0
    caps = (out / "train_caps.txt").read_text()
    assert "SECRET" not in caps and caps == "a red square\n"
    said = [line for line in problems_txt(out).splitlines() if line.startswith("p0.txt:")]
    assert len(said) == 1 and "hard link (2 names" in said[0] and "--trust-links" in said[0], said
    assert "p0.txt" in capsys.readouterr().err
    trusted = tmp_path / "trusted"
    assert main(["data", "folder", str(root), "--out", str(trusted), "--trust-links", *PIXELS]) == 0
    assert SECRET in (trusted / "train_caps.txt").read_text()  # the user said so: read


def test_s_d1_hard_link_picture_refused_by_vse_data_table(tmp_path):
    outside = tmp_path / "private.png"
    outside.write_bytes(png(12, (1, 2, 3)))
    root = tmp_path / "t"
    root.mkdir()
    os.link(outside, root / "linked.png")
    (root / "own.png").write_bytes(png(10))
    (root / "t.csv").write_text("image,caption\nlinked.png,a private picture\nown.png,a red square\n")
    out = tmp_path / "out"
    assert main(["data", "table", str(root / "t.csv"), "--out", str(out), *PIXELS]) == 0
    assert (out / "train_images.txt").read_text() == "own.png\n"
    assert any(
        line.startswith("linked.png:") and "hard link" in line for line in problems_txt(out).splitlines()
    )
    collected = read_table(root / "t.csv", trust_links=True)
    assert sorted(it.name for it in collected.items) == ["linked.png", "own.png"]


def test_s_d1_the_rule_in_untrusted_reads_and_vse_index_folder(tmp_path):
    from vsekit.data.untrusted import HARD_LINK

    root, secret = folder_with_link(tmp_path)
    with pytest.raises(UntrustedFileError) as e:
        read_inside(root, "p0.txt", 1 << 20)
    assert e.value.kind == HARD_LINK and "2 names" in str(e.value)
    assert read_inside(root, "p0.txt", 1 << 20, trust_links=True).decode() == SECRET + "\n"
    assert read_bounded(secret, 1 << 20, follow_symlinks=True) == (SECRET + "\n").encode()  # a typed path
    # the folder reader refuses it (the picture is then left without captions)
    assert [it.name for it in read_folder(root).items] == ["p1.png"]
    # `vse index FOLDER`: a hard-linked picture (a second name of a private picture) is left out, named
    os.link(root / "p1.png", tmp_path / "outside" / "copy.png")
    src = resolve_source(str(root))
    assert src.paths == [] or "p1.png" not in src.paths
    assert any("p1.png" in p and "hard link" in p for p in src.problems), src.problems
    assert any("p0.txt" in p and "hard link" in p for p in src.problems), src.problems
    trusted = resolve_source(str(root), trust_links=True)
    assert trusted.paths == ["p0.png", "p1.png"] and (SECRET, 0) in trusted.captions
    parser = build_parser()
    assert parser.parse_args(["index", "run", str(root), "--out", "x", "--trust-links"]).trust_links


def test_s_d1_a_file_with_one_name_is_read_as_before(tmp_path):
    (tmp_path / "a.txt").write_text("one name\n")
    assert read_inside(tmp_path, "a.txt", 100) == b"one name\n"


# ------------------------------------------------------------------------------------------- S-D9


@pytest.mark.parametrize(
    ("raw", "shown"),
    [
        (TITLE, "\\x1b]0;owned\\x07"),
        (FORGED, "\\x1b[2K\\x0dFAKE: dataset ready, 0 problems"),
        ("a\tb\nc\x00d\x7fe", "a\\x09b\\x0ac\\x00d\\x7fe"),
        ("\x9b2K", "\\x9b2K"),  # C1 CSI
        (os.fsdecode(b"caf\xe9.png"), "caf\\xe9.png"),  # a byte that is not UTF-8 (surrogate escape)
        ("x\ud800y", "x\\ud800y"),  # a lone surrogate
        ("abc\u202edcba", "abc\\u202edcba"),  # right-to-left override
        ("café ✓ 猫 ..\\..\\evil.png", "café ✓ 猫 ..\\..\\evil.png"),  # printable text unchanged
    ],
)
def test_s_d9_printable_escapes_every_control_character(raw, shown):
    from vsekit.utils.printable import printable

    assert printable(raw) == shown
    assert printable(shown) == shown  # idempotent: escaping twice shows the same
    shown.encode("utf-8")  # valid UTF-8 whatever came in


def test_s_d9_folder_and_shard_names_reach_stderr_escaped(tmp_path, capsys):
    root = tmp_path / "pics"
    root.mkdir()
    (root / "ok.png").write_bytes(png())
    (root / "ok.txt").write_text("a red square\n")
    (root / f"{FORGED}.png").write_bytes(png(9))  # no caption beside it: reported by name
    (root / f"{TITLE}.png").write_bytes(png(10))
    out = tmp_path / "out"
    assert main(["data", "folder", str(root), "--out", str(out), *PIXELS]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err
    assert "\\x1b[2K\\x0dFAKE: dataset ready" in err and "\\x1b]0;owned\\x07.png" in err
    assert "\x1b" not in problems_txt(out)
    shard = tmp_path / "s.tar"
    shard.write_bytes(
        tar_bytes(
            [
                ("a.png", png()),
                ("a.txt", b"a red square"),
                (f"{FORGED}.png", png(9)),
                (f"{FORGED}.txt", b"forged"),
                ("b.png", png(10)),
                ("b.txt", f"{TITLE} a title".encode()),  # a caption holding an escape: skipped
            ]
        )
    )
    out2 = tmp_path / "out2"
    assert main(["data", "webdataset", str(shard), "--out", str(out2), *PIXELS]) == 0
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\r" not in err and "\x07" not in err
    assert f"{shard}:\\x1b[2K\\x0dFAKE" in err and "control character" in err
    assert (out2 / "train_caps.txt").read_text() == "a red square\n"


def test_s_d9_karpathy_sentences_are_screened_like_the_own_builders(tmp_path, capsys):
    pics = tmp_path / "pics"
    pics.mkdir()
    for i in range(2):
        (pics / f"{i}.png").write_bytes(png(8 + i))
    # written by hand: "\ud800" is a JSON escape Python's json would not write for a str
    text = (
        '{"images": ['
        '{"filename": "0.png", "split": "train", "imgid": 0, "sentences": ['
        '{"raw": "a green square"}, {"raw": "\\u001b]0;owned\\u0007 title"}, null, {"raw": "x\\ud800"},'
        ' {"tokens": ["a", "small", "square"]}, {"raw": 7}]},'
        '{"filename": "1.png", "split": "train", "imgid": 1, "sentences": [{"raw": "a red square"}]}'
        "]}"
    )
    js = tmp_path / "k.json"
    js.write_text(text)
    out = tmp_path / "out"
    assert (
        main(["data", "karpathy", str(js), "--images", str(pics), "--out", str(out), "--splits", "train"])
        == 0
    )
    caps = (out / "train_caps.txt").read_text(encoding="utf-8")
    assert caps == "a green square\na small square\na red square\n"
    assert (out / "train_cap2img.txt").read_text() == "0\n0\n1\n"
    err = capsys.readouterr().err
    assert "\x1b" not in err
    for k in (1, 2, 3, 5):
        assert f"images[0].sentences[{k}] (0.png)" in err, (k, err)


def test_s_d9_karpathy_bad_names_and_numbers_are_one_line(tmp_path, capsys):
    js = tmp_path / "k.json"
    js.write_text(
        '{"images": [{"filename": "a\\u001b[2K.png", "split": "train", "sentences": [{"raw": "x"}]}]}'
    )
    assert main(["data", "karpathy", str(js), "--out", str(tmp_path / "o"), "--splits", "train"]) == 2
    err = capsys.readouterr().err
    assert "images[0]: its filename" in err and "\x1b" not in err and "internal error" not in err
    js.write_text('{"images": [], "n": ' + "9" * 5000 + "}")
    assert main(["data", "karpathy", str(js), "--out", str(tmp_path / "o"), "--splits", "train"]) == 2
    err = capsys.readouterr().err
    assert f"{js}: not valid JSON" in err and "internal error" not in err


# ------------------------------------------------------------------------------------- C-D4, C-D5


@pytest.mark.parametrize("nested_first", [False, True])
def test_c_d4_a_member_that_is_also_a_folder_of_another_is_a_problem(tmp_path, nested_first):
    flat = [("a.png", png()), ("a.txt", b"a red square")]
    nested = [("a.png/b.png", png(9)), ("a.png/b.txt", b"a nested one")]
    shard = tmp_path / "s.tar"
    shard.write_bytes(tar_bytes(nested + flat if nested_first else flat + nested))
    out = tmp_path / "out"
    assert main(["data", "webdataset", str(shard), "--out", str(out), *PIXELS]) == 0
    lines = problems_txt(out).splitlines()
    said = [line for line in lines if line.startswith(f"{shard}:a.png/b.")]
    assert len(said) == 2 and all("name clash" in line and "a.png is a member" in line for line in said), (
        lines
    )
    assert (out / "train_caps.txt").read_text() == "a red square\n"


def test_c_d5_output_names_fit_name_max_and_never_clash(tmp_path):
    from vsekit.datasets.own_output import output_name

    ids = [
        "x" * 300,
        "é" * 200,
        "a.png/b",
        "a",
        "a.png_/b",
        "/".join(["d"] * 40),
        "/".join(["d"] * 39) + "_d",
        "/".join(["d"] * 9) + "/e",
    ]
    names = [output_name(i, ".png") for i in ids]
    assert len(set(names)) == len(ids)  # distinct ids, distinct files
    for n in names:
        parts = n.split("/")
        assert all(len(p.encode()) <= NAME_MAX - 14 for p in parts), n  # room for ".NAME.XXXXXXXX.tmp"
        assert len(parts) <= 9 and n.endswith(".png")
    images = tmp_path / "images"
    for n in names:  # the file system agrees: each is a file, none is a folder of another
        (images / n).parent.mkdir(parents=True, exist_ok=True)
        (images / n).write_bytes(b"x")
    assert sum(1 for p in images.rglob("*") if p.is_file()) == len(ids)


def test_c_d5_long_and_deep_member_names_build_or_are_reported(tmp_path):
    long255 = "x" * 251  # + ".png": 255 bytes, the longest legal file name
    long300 = "y" * 296  # 300 characters
    deep = "/".join(["d"] * 2100) + "/z"
    shard = tmp_path / "s.tar"
    shard.write_bytes(
        tar_bytes(
            [
                (f"{long255}.png", png()),
                (f"{long255}.txt", b"the longest legal name"),
                (f"{long300}.png", png(9)),
                (f"{long300}.txt", b"a name longer than NAME_MAX"),
                (f"{deep}.png", png(10)),
                (f"{deep}.txt", b"too deep"),
            ]
        )
    )
    out = tmp_path / "out"
    assert main(["data", "webdataset", str(shard), "--out", str(out), *PIXELS]) == 0
    stored = (out / "train_images.txt").read_text().splitlines()
    assert len(stored) == 2
    for rel in stored:
        assert (out / rel).is_file() and all(len(p.encode()) <= NAME_MAX for p in rel.split("/"))
    caps = (out / "train_caps.txt").read_text().splitlines()
    assert sorted(caps) == ["a name longer than NAME_MAX", "the longest legal name"]
    deep_lines = [line for line in problems_txt(out).splitlines() if "folders deep" in line]
    assert len(deep_lines) == 2 and all("bad file name" in line for line in deep_lines)


def test_c_d5_a_folder_file_name_of_255_bytes_is_copied(tmp_path):
    root = tmp_path / "pics"
    root.mkdir()
    stem = "z" * 251
    (root / f"{stem}.png").write_bytes(png())
    (root / f"{stem}.txt").write_text("a long name\n")
    out = tmp_path / "out"
    assert main(["data", "folder", str(root), "--out", str(out), "--copy-images", *PIXELS]) == 0
    (rel,) = (out / "train_images.txt").read_text().splitlines()
    assert (out / rel).is_file() and len(Path(rel).name.encode()) <= NAME_MAX - 14


# ---------------------------------------------------------------------------------------- C-D6/D7


def test_c_d6_d7_json_captions_outside_the_bounds_are_problems(tmp_path):
    shard = tmp_path / "s.tar"
    shard.write_bytes(
        tar_bytes(
            [
                ("a.png", png()),
                ("a.json", b'{"caption": "big", "n": ' + b"7" * 5000 + b"}"),
                ("b.png", png(9)),
                ("b.json", b'{"caption": "x\\ud800"}'),
                ("c.png", png(10)),
                ("c.json", json.dumps({"caption": "a small red square"}).encode()),
            ]
        )
    )
    out = tmp_path / "out"
    assert main(["data", "webdataset", str(shard), "--out", str(out), *PIXELS]) == 0
    lines = problems_txt(out).splitlines()
    a = [line for line in lines if line.startswith(f"{shard}:a.json: unreadable captions")]
    b = [line for line in lines if line.startswith(f"{shard}:b.json: unreadable captions")]
    assert len(a) == 1 and "5,000 characters" in a[0], lines
    assert len(b) == 1 and "surrogate" in b[0], lines
    assert (out / "train_caps.txt").read_text() == "a small red square\n"


# ------------------------------------------------------------------------------------------- P-D10


def test_p_d10_every_dropped_shard_sample_is_named(tmp_path):
    shard = tmp_path / "s.tar"
    shard.write_bytes(
        tar_bytes(
            [
                ("..png", png(9)),
                ("..txt", b"a hidden one"),
                ("..\\..\\evil.png", png(10)),
                ("README", b"no extension"),
                ("only.txt", b"a caption without its picture"),
                ("ok.png", png()),
                ("ok.txt", b"a red square"),
            ]
        )
    )
    out = tmp_path / "out"
    assert main(["data", "webdataset", str(shard), "--out", str(out), *PIXELS]) == 0
    text = problems_txt(out)
    for member in ("..png", "..txt", "..\\..\\evil.png", "README", "only"):
        assert f"{shard}:{member}: " in text, (member, text)
    assert "no picture" in text and (out / "train_caps.txt").read_text() == "a red square\n"


# --------------------------------------------------------------------- all of it, under a memory cap


def hostile_inputs(tmp_path: Path) -> tuple[Path, Path]:
    """A folder and a shard holding the probe's kinds of input together."""
    root, _ = folder_with_link(tmp_path)
    (root / f"{FORGED}.png").write_bytes(png(11))
    (root / f"{FORGED}.txt").write_text(f"{TITLE}\n")
    (root / "j.png").write_bytes(png(12))
    (root / "j.txt").write_text("x\udcff".encode("utf-8", "surrogateescape").decode("latin-1"))
    shard = tmp_path / "h.tar"
    shard.write_bytes(
        tar_bytes(
            [
                ("a.png", png()),
                ("a.txt", b"a red square"),
                ("a.png/b.png", png(9)),
                ("a.png/b.txt", b"nested"),
                ("x" * 251 + ".png", png(10)),
                ("x" * 251 + ".txt", b"long"),
                ("/".join(["d"] * 2100) + ".png", png(11)),
                ("n.png", png(12)),
                ("n.json", b'{"caption": 1' + b"0" * 5000 + b"}"),
                ("s.png", png(13)),
                ("s.json", b'{"caption": "\\ud800"}'),
                ("..png", png(14)),
                (f"{FORGED}.png", png(15)),
            ]
        )
    )
    return root, shard


def test_s_d1_s_d9_c_d4_c_d5_c_d6_p_d10_hostile_builds_under_2_gib(tmp_path):
    if not hasattr(os, "link"):
        pytest.skip("no hard links here")
    root, shard = hostile_inputs(tmp_path)
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))
        from vsekit.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    for argv in (
        ["data", "folder", str(root), "--out", str(tmp_path / "of"), *PIXELS],
        ["data", "webdataset", str(shard), "--out", str(tmp_path / "ow"), *PIXELS],
    ):
        done = subprocess.run(
            [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=120, cwd=tmp_path
        )
        assert done.returncode in (0, 2), (argv, done.returncode, done.stderr[-2000:])
        assert "internal error" not in done.stderr and "\x1b" not in done.stderr, done.stderr[-2000:]
