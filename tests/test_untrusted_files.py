"""Files named by untrusted input (a folder, a table, a dataset's picture list, an images folder) are opened only
inside their root, only when they are regular files, and read with a byte cap (`vsekit.data.untrusted`).

Every input that could hang (a FIFO) or exhaust memory (a link to /dev/zero) is run in a subprocess with a
timeout and an address-space limit (RLIMIT_AS), so a regression fails the test instead of hanging the suite or
the machine. The "outside" files hold marker lines and bytes that must not appear in anything vsekit writes.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from PIL import Image

from vsekit.cli import main
from vsekit.data.pictures import decode_bounded
from vsekit.data.precomp import DataFormatError
from vsekit.data.untrusted import (
    NOT_REGULAR,
    OUTSIDE,
    TOO_LARGE,
    UntrustedFileError,
    read_bounded,
    read_inside,
    resolve_inside,
)
from vsekit.data.validate import check_dataset
from vsekit.datasets.own_sources import read_table
from vsekit.search.index import resolve_source
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this system")
SECRET = "SECRET-LINE-never-a-caption"
TIMEOUT_S = 120  # each bounded run takes seconds; a FIFO read blocks forever
MEMORY_LIMIT = 2 << 30  # bytes of address space for a `vse data` run (it needs well under 1 GiB)


def picture(path: Path, colour: tuple[int, int, int], size: int = 16) -> bytes:
    """A small PNG at `path` (its folder made); returns its bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    Image.new("RGB", (size, size), colour).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())
    return buf.getvalue()


def good_folder(root: Path, n: int = 3) -> dict[str, bytes]:
    """`n` captioned pictures p0..p{n-1} under `root`; returns name -> bytes."""
    out = {}
    for i in range(n):
        out[f"p{i}"] = picture(root / f"p{i}.png", (40 * i, 200 - 30 * i, 90))
        (root / f"p{i}.txt").write_text(f"picture number {i}\n")
    return out


def secret_file(path: Path) -> Path:
    path.write_text(f"{SECRET}\n")
    return path


def written_text(folder: Path) -> str:
    """Every file under `folder` as text (bytes that are not UTF-8 replaced)."""
    return "".join(
        p.read_bytes().decode("utf-8", "replace") for p in sorted(folder.rglob("*")) if p.is_file()
    )


def shas_of_set(out: Path) -> set[str]:
    return {
        json.loads(line)["sha256"] for p in out.glob("*_meta.jsonl") for line in p.read_text().splitlines()
    }


def build_folder(root: Path, out: Path, *extra: str) -> int:
    """`vse data folder ROOT --out OUT --pixels`, every picture in train (no dev or test split)."""
    argv = ["data", "folder", str(root), "--out", str(out), "--pixels", "--no-progress"]
    return main([*argv, "--dev", "0", "--test", "0", *extra])


def run_bounded(argv: list[str], cwd: Path, memory: int = MEMORY_LIMIT) -> subprocess.CompletedProcess:
    """`vse ARGV` in a child process limited to `memory` bytes of address space and TIMEOUT_S seconds: a hang or
    an unbounded read fails (subprocess.TimeoutExpired, or a non-zero exit) instead of running forever."""
    code = textwrap.dedent(f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, ({memory}, {memory}))
        from vsekit.cli import main
        sys.exit(main(sys.argv[1:]))
    """)
    return subprocess.run(
        [sys.executable, "-c", code, *argv], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT_S
    )


def run_python_bounded(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Python `code` in a child process under the same limits as `run_bounded`."""
    head = f"import resource\nresource.setrlimit(resource.RLIMIT_AS, ({MEMORY_LIMIT}, {MEMORY_LIMIT}))\n"
    return subprocess.run(
        [sys.executable, "-c", head + textwrap.dedent(code)],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# --------------------------------------------------------------------------------- the rules themselves


def test_resolve_inside_takes_relative_names_inside_the_root_only(tmp_path):
    root = tmp_path / "root"
    picture(root / "a" / "x.png", (1, 2, 3))
    picture(tmp_path / "outside.png", (3, 2, 1))
    os.symlink(root / "a" / "x.png", root / "inner_link.png")  # a link that stays inside: allowed
    os.symlink(tmp_path / "outside.png", root / "a" / "out_link.png")
    real = root.resolve()
    assert resolve_inside(root, "a/x.png") == real / "a" / "x.png"
    assert resolve_inside(root, "a/../a/x.png") == real / "a" / "x.png"  # '..' that stays inside
    assert resolve_inside(root, "inner_link.png") == real / "a" / "x.png"
    assert resolve_inside(root, str(real / "a" / "x.png"), absolute_ok=True) == real / "a" / "x.png"
    refused = {
        "../outside.png": "points outside",
        "a/../../outside.png": "points outside",
        str(tmp_path / "outside.png"): "points outside",
        "~/x.png": "'~' is not expanded",
        "a/out_link.png": "through a symbolic link",
    }
    for name, why in refused.items():
        with pytest.raises(UntrustedFileError, match=why) as e:
            resolve_inside(root, name, label="the folder", absolute_ok=name.startswith("/"))
        assert e.value.kind == OUTSIDE and "the folder" in str(e.value) and isinstance(e.value, OSError)
    with pytest.raises(UntrustedFileError, match="NUL"):
        resolve_inside(root, "a\0b.png")


def test_read_bounded_checks_the_size_before_reading_and_never_follows_a_last_link(tmp_path):
    (tmp_path / "big.bin").write_bytes(b"x" * 1000)
    assert read_bounded(tmp_path / "big.bin", 1000) == b"x" * 1000
    with pytest.raises(UntrustedFileError, match="1000 bytes is more than the 999 byte limit") as e:
        read_bounded(tmp_path / "big.bin", 999)
    assert e.value.kind == TOO_LARGE
    os.symlink(tmp_path / "big.bin", tmp_path / "link.bin")
    with pytest.raises(UntrustedFileError, match="is a symbolic link") as e:
        read_bounded(tmp_path / "link.bin", 10_000)
    assert e.value.kind == OUTSIDE
    assert (
        read_bounded(tmp_path / "link.bin", 10_000, follow_symlinks=True) == b"x" * 1000
    )  # a path the user typed
    with pytest.raises(UntrustedFileError, match="is a folder, expected a caption file") as e:
        read_inside(tmp_path, ".", 10, expected="a caption file")
    assert e.value.kind == NOT_REGULAR


@needs_fifo
def test_a_fifo_and_a_device_are_refused_without_waiting_on_them(tmp_path):
    os.mkfifo(tmp_path / "pipe.png")
    result = run_python_bounded(
        f"""
        import os
        from vsekit.data.untrusted import UntrustedFileError, read_bounded
        for path in ({str(tmp_path / "pipe.png")!r}, os.devnull):
            try:
                read_bounded(path, 1 << 20, follow_symlinks=True)
            except UntrustedFileError as e:
                print(e.kind, "|", e)
    """,
        tmp_path,
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines == [
        f"not a regular file | {tmp_path / 'pipe.png'}: is a FIFO (named pipe), expected a regular file",
        f"not a regular file | {os.devnull}: is a character device, expected a regular file",
    ]


# ------------------------------------------------------------------------------ vse data folder (S1, S4)


def test_folder_caption_link_out_of_the_folder_is_never_read(tmp_path, capsys):
    root = tmp_path / "in"
    good_folder(root, 3)
    (root / "p0.txt").unlink()
    os.symlink(secret_file(tmp_path / "secret.txt"), root / "p0.txt")
    out = tmp_path / "out"
    assert build_folder(root, out) == 0
    err = capsys.readouterr().err
    assert SECRET not in written_text(out) and SECRET not in err
    said = [line for line in (out / "problems.txt").read_text().splitlines() if line.startswith("p0.txt")]
    assert len(said) == 1 and "points outside the folder" in said[0] and "symbolic link" in said[0], said
    assert (out / "train_ids.txt").read_text().split() == ["p1", "p2"]  # p0 has no readable captions


def test_folder_picture_link_out_of_the_folder_is_never_read(tmp_path, capsys):
    root = tmp_path / "in"
    good_folder(root, 2)
    outside = picture(tmp_path / "outside.png", (250, 250, 0))
    os.symlink(tmp_path / "outside.png", root / "link.png")
    (root / "link.txt").write_text("a picture from elsewhere\n")
    for copy in ([], ["--copy-images"]):
        out = tmp_path / f"out{len(copy)}"
        assert build_folder(root, out, *copy) == 0
        assert "link.png: unreadable picture" in capsys.readouterr().err
        assert hashlib.sha256(outside).hexdigest() not in shas_of_set(out)
        assert (out / "train_ids.txt").read_text().split() == ["p0", "p1"]
        assert all(p.read_bytes() != outside for p in out.rglob("*.png"))


@needs_fifo
def test_folder_fifos_and_links_to_dev_zero_neither_hang_nor_exhaust_memory(tmp_path):
    root = tmp_path / "in"
    good_folder(root, 5)
    os.mkfifo(root / "fifo_caption.txt")  # a caption file nobody writes to: reading it blocks forever
    picture(root / "fifo_caption.png", (9, 9, 9))
    os.mkfifo(root / "fifo_picture.png")
    (root / "fifo_picture.txt").write_text("a fifo\n")
    os.symlink("/dev/zero", root / "zero.png")  # endless bytes: read whole, they exhaust memory
    (root / "zero.txt").write_text("zeros\n")
    picture(root / "zero_caption.png", (8, 8, 8))
    os.symlink("/dev/zero", root / "zero_caption.txt")
    result = run_bounded(
        ["data", "folder", "in", "--out", "out", "--pixels", "--no-progress", "--dev", "1", "--test", "1"],
        tmp_path,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    problems = (tmp_path / "out" / "problems.txt").read_text()
    expected = {
        "fifo_caption.txt: unreadable captions: is a FIFO (named pipe), expected a caption file",
        "fifo_picture.png: unreadable picture: cannot be read (is a FIFO (named pipe), expected a picture file)",
        "zero.png: unreadable picture: 'zero.png' points outside the folder",
        "zero_caption.txt: unreadable captions: 'zero_caption.txt' points outside the folder",
    }
    assert all(any(line.startswith(e) for line in problems.splitlines()) for e in expected), problems
    ids = {s: (tmp_path / "out" / f"{s}_ids.txt").read_text().split() for s in ("train", "dev", "test")}
    assert sorted(sum(ids.values(), [])) == [f"p{i}" for i in range(5)]


def test_x_jpg_and_x_png_beside_x_txt_are_both_reported_and_skipped(tmp_path, capsys):
    root = tmp_path / "in"
    good_folder(root, 2)
    picture(root / "x.png", (1, 100, 1))
    Image.new("RGB", (16, 16), (100, 1, 1)).save(root / "x.jpg")
    (root / "x.txt").write_text("which one am I?\n")
    out = tmp_path / "out"
    assert build_folder(root, out) == 0
    capsys.readouterr()
    problems = (out / "problems.txt").read_text().splitlines()
    assert [line.split(": ")[:2] for line in problems] == [["x.jpg", "name clash"], ["x.png", "name clash"]]
    assert (out / "train_ids.txt").read_text().split() == ["p0", "p1"]
    assert "which one am I?" not in (out / "train_caps.txt").read_text()
    assert json.loads((out / "manifest.json").read_text())["problems"]["name clash"] == 2


def test_a_file_that_is_not_a_picture_is_reported_by_its_name(tmp_path, capsys):
    with pytest.raises(DataFormatError) as e:
        decode_bounded(io.BytesIO(b"just some text, no picture"), "notes.png")
    assert str(e.value).startswith("notes.png: cannot read image") and "BytesIO" not in str(e.value)
    root = tmp_path / "in"
    good_folder(root, 2)
    (root / "notes.png").write_bytes(b"just some text, no picture")
    (root / "notes.txt").write_text("a caption\n")
    out = tmp_path / "out"
    assert build_folder(root, out) == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if "notes.png" in x)
    assert "notes.png: unreadable picture: cannot read image" in line
    assert "object at 0x" not in line and "BytesIO" not in line


# ------------------------------------------------------------------------------- vse data table (S3, P4)


@pytest.mark.parametrize("copy", [False, True], ids=["referenced", "copied"])
def test_table_rows_outside_its_folder_are_refused_and_the_images_root_stays_the_tables_folder(
    copy, tmp_path, monkeypatch, capsys
):
    tab = tmp_path / "tables"
    kept = picture(tab / "pics" / "good.png", (10, 200, 10))
    outside = [picture(tmp_path / f"outside{i}.png", (200, 10 * i, 10)) for i in range(3)]
    home = tmp_path / "home"
    outside.append(picture(home / "x.png", (10, 10, 200)))
    monkeypatch.setenv("HOME", str(home))  # '~/x.png' would name a real picture if it were expanded
    rows = [
        ("pics/good.png", "the good one"),
        (str(tmp_path / "outside0.png"), "an absolute path"),
        ("../outside1.png", "a parent path"),
        ("pics/../../outside2.png", "a longer way out"),
        ("~/x.png", "a home path"),
    ]
    (tab / "t.csv").write_text("image,caption\n" + "".join(f"{a},{b}\n" for a, b in rows))
    out = tmp_path / "out"
    assert (
        main(
            [
                "data",
                "table",
                str(tab / "t.csv"),
                "--out",
                str(out),
                "--pixels",
                "--no-progress",
                "--dev",
                "0",
                "--test",
                "0",
                *(["--copy-images"] if copy else []),
            ]
        )
        == 0
    )
    capsys.readouterr()
    problems = (out / "problems.txt").read_text().splitlines()
    for name, _ in rows[1:]:
        assert any(
            line.startswith(f"{name}: ") and "points outside the table's folder" in line for line in problems
        ), name
    assert shas_of_set(out) == {hashlib.sha256(kept).hexdigest()}
    assert not any(p.read_bytes() in outside for p in out.rglob("*.png"))
    assert (out / "train_caps.txt").read_text() == "the good one\n"
    manifest = json.loads((out / "manifest.json").read_text())
    if copy:
        assert "images_root" not in manifest  # the pictures are in OUT/images/
    else:  # never '/' or a folder above the table's: the set's own out-of-root check stays meaningful
        root = (out / manifest["images_root"]).resolve()
        assert root == tab.resolve() / "pics" or root == tab.resolve(), root
        assert check_dataset(out).ok


@needs_fifo
def test_a_fifo_a_folder_and_a_device_named_in_a_table_are_reported_as_what_they_are(tmp_path):
    tab = tmp_path / "tables"
    picture(tab / "good.png", (1, 2, 3))
    os.mkfifo(tab / "pipe.png")
    (tab / "folder.png").mkdir()
    (tab / "t.csv").write_text("image,caption\ngood.png,a\npipe.png,b\nfolder.png,c\nmissing.png,d\n")
    got = read_table(tab / "t.csv")
    said = {p.name: f"{p.kind}: {p.detail}" for p in got.problems}
    assert said["pipe.png"].startswith("unreadable picture: is a FIFO (named pipe), expected a picture file")
    assert said["folder.png"].startswith("unreadable picture: is a folder, expected a picture file")
    assert said["missing.png"].startswith("missing picture: no such file")
    assert [i.name for i in got.items] == ["good.png"]
    dev = Path(os.devnull)  # a device inside the images root the user gave
    (tmp_path / "d.csv").write_text(f"image,caption\n{dev.name},a\n")
    got = read_table(tmp_path / "d.csv", images_root=dev.parent)
    assert [f"{p.kind}: {p.detail}" for p in got.problems] == [
        "unreadable picture: is a character device, expected a picture file (named at d.csv:2); not read"
    ]


# ---------------------------------------------------------------------------- pictures lists of sets (S2)


def test_index_refuses_a_split_whose_picture_list_points_outside_its_images_root(tmp_path):
    data = make_synthetic_precomp(tmp_path / "set", n_train=2, n_dev=2, n_test=3, regions=2, dim=4)
    for name in ("a.png", "b.png"):
        picture(data / name, (5, 5, 5))
    picture(tmp_path / "outside.png", (6, 6, 6))
    (data / "test_images.txt").write_text("a.png\n../outside.png\nb.png\n")
    with pytest.raises(
        DataFormatError,
        match=r"test_images.txt \(image row 1\): '../outside.png' points outside "
        "the images root",
    ):
        resolve_source(f"{data}:test")
    assert not check_dataset(data, splits=["test"]).ok  # the same rule `vse data check` applies
    (data / "test_images.txt").write_text("a.png\nb.png\nb.png\n")
    assert resolve_source(f"{data}:test").paths == ["a.png", "b.png", "b.png"]


def test_link_images_never_links_a_file_that_resolves_outside_the_images_folder(tmp_path, capsys):
    data = make_synthetic_precomp(tmp_path / "coco_precomp", n_train=2, n_dev=2, n_test=2, regions=2, dim=4)
    (data / "test_ids.txt").write_text("42\n43\n")
    pics = tmp_path / "pictures"
    picture(tmp_path / "outside.jpg", (9, 9, 9))
    (pics / "a").mkdir(parents=True)
    os.symlink("../../outside.jpg", pics / "a" / "COCO_val2014_000000000042.jpg")  # sorts first
    picture(pics / "b" / "COCO_val2014_000000000042.jpg", (1, 1, 1))
    picture(pics / "b" / "COCO_val2014_000000000043.jpg", (2, 2, 2))
    assert main(["data", "link-images", str(data), "--images", str(pics), "--splits", "test"]) == 0
    err = capsys.readouterr().err
    assert "a/COCO_val2014_000000000042.jpg' points outside --images" in err and "skipped" in err
    assert (data / "test_images.txt").read_text().split() == [
        "b/COCO_val2014_000000000042.jpg",
        "b/COCO_val2014_000000000043.jpg",
    ]
    (pics / "b" / "COCO_val2014_000000000042.jpg").unlink()  # now the only candidate is the link out
    before = (data / "test_images.txt").read_text()
    assert main(["data", "link-images", str(data), "--images", str(pics), "--splits", "test"]) == 2
    err = capsys.readouterr().err
    assert "no picture for 1 of the 2 ids" in err and "1 file(s) refused" in err and "points outside" in err
    assert (data / "test_images.txt").read_text() == before  # nothing was written


# ------------------------------------------------------------------------------ vse index / vse search


def test_index_folder_source_leaves_out_links_out_and_reads_no_outside_caption(tmp_path):
    root = tmp_path / "in"
    good_folder(root, 3)
    (root / "p0.txt").unlink()
    os.symlink(secret_file(tmp_path / "secret.txt"), root / "p0.txt")
    picture(tmp_path / "outside.png", (0, 0, 0))
    os.symlink(tmp_path / "outside.png", root / "link.png")
    src = resolve_source(str(root))
    assert src.paths == ["p0.png", "p1.png", "p2.png"]
    assert sorted(t for t, _ in src.captions) == ["picture number 1", "picture number 2"]
    assert any("link.png" in p and "points outside the folder" in p for p in src.problems), src.problems
    assert any("p0.txt" in p and "points outside the folder" in p for p in src.problems), src.problems


def shapes_folder(data: Path, root: Path, n: int) -> list[Path]:
    """`n` shapes pictures copied into `root` as p0.png.. with captions p0.txt..; returns the originals."""
    shots = sorted((data / "images").glob("test_*.png"))[:n]
    root.mkdir(parents=True)
    for i, p in enumerate(shots):
        shutil.copy(p, root / f"p{i}.png")
        (root / f"p{i}.txt").write_text(f"picture number {i}\n")
    return shots


@pytest.mark.slow
def test_vse_index_reads_no_caption_or_picture_that_links_out_of_the_folder(shapes_model, tmp_path, capsys):
    pytest.importorskip("faiss")
    data, run = shapes_model
    root = tmp_path / "in"
    shots = shapes_folder(data, root, 3)
    (root / "p0.txt").unlink()
    os.symlink(secret_file(tmp_path / "secret.txt"), root / "p0.txt")
    shutil.copy(shots[0], tmp_path / "outside.png")
    os.symlink(tmp_path / "outside.png", root / "link.png")
    (root / "link.txt").write_text("OUTSIDE-PICTURE caption\n")
    idx = tmp_path / "idx"
    assert main(["index", str(run), str(root), "--out", str(idx), "--device", "cpu", "--quiet"]) == 0
    capsys.readouterr()
    stored = written_text(idx)
    assert (
        SECRET not in stored and "OUTSIDE-PICTURE" not in stored
    )  # link.png is named only among the skipped
    (segment,) = idx.glob("segments/*/pictures.jsonl")
    pictures = [json.loads(line)["path"] for line in segment.read_text().splitlines()]
    assert pictures == ["p0.png", "p1.png", "p2.png"]
    assert main(["search", str(idx), "picture number", "-k", "5", "--json", "--device", "cpu"]) == 0
    assert SECRET not in capsys.readouterr().out


@pytest.mark.slow
@needs_fifo
def test_vse_search_image_refuses_a_fifo_at_once(shapes_model, tmp_path, capsys):
    pytest.importorskip("faiss")
    data, run = shapes_model
    shapes_folder(data, tmp_path / "in", 2)
    idx = tmp_path / "idx"
    assert (
        main(["index", str(run), str(tmp_path / "in"), "--out", str(idx), "--device", "cpu", "--quiet"]) == 0
    )
    capsys.readouterr()
    os.mkfifo(tmp_path / "query.png")  # nobody writes to it: opening it to read blocks forever
    result = run_bounded(
        ["search", str(idx), "--image", "query.png", "--device", "cpu"], tmp_path, memory=8 << 30
    )  # torch and FAISS map far more address space than they use
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().endswith("query.png: is a FIFO (named pipe), expected a picture file"), (
        result.stderr
    )
