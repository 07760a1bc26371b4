"""`vse data folder | table | webdataset`: users' own pictures and captions as a training set.

The pictures are drawn here (coloured shapes at places and sizes, captions that say so). The main check
builds the SAME 200 pictures from a folder, a CSV and two tar shards and compares the three datasets file
by file; features run through EfficientNet-Lite0 at 64 px (a 2 x 2 grid) to keep four builds of 200
pictures cheap on a CPU; the default 224 px / 49 x 1280 grid is checked on a small set.
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageDraw

from vsekit.cli import main
from vsekit.data.precomp import load_precomp_split
from vsekit.data.validate import check_dataset
from vsekit.datasets import own_checks, own_features
from vsekit.datasets.own_pairs import Item, PictureRef, assign_ids, safe_id
from vsekit.datasets.own_shards import expand_braces, expand_shards, split_key

pytest.importorskip("efficientnet_lite_pytorch")

COLOURS = {
    "red": (220, 30, 30),
    "green": (30, 160, 40),
    "blue": (30, 60, 220),
    "yellow": (235, 200, 20),
    "purple": (140, 40, 170),
}
SHAPES = ("circle", "square", "triangle", "bar")
PLACES = {
    "top left": (0.3, 0.3),
    "top right": (0.7, 0.3),
    "bottom left": (0.3, 0.7),
    "bottom right": (0.7, 0.7),
    "centre": (0.5, 0.5),
}
SIZES = {"small": 0.12, "large": 0.22}
SPLITS = ("train", "dev", "test")
FAST = ["--image-size", "64", "--device", "cpu", "--batch-size", "8", "--no-progress"]  # 2 x 2 Lite0 grid


def draw(colour: str, shape: str, place: str, size: str, px: int = 64) -> bytes:
    img = Image.new("RGB", (px, px), (250, 250, 245))
    d = ImageDraw.Draw(img)
    cx, cy = PLACES[place][0] * px, PLACES[place][1] * px
    r = SIZES[size] * px
    fill = COLOURS[colour]
    if shape == "circle":
        d.ellipse([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "square":
        d.rectangle([cx - r, cy - r, cx + r, cy + r], fill=fill)
    elif shape == "triangle":
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=fill)
    else:
        d.rectangle([cx - r, cy - r / 3, cx + r, cy + r / 3], fill=fill)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_pictures(n: int = 200) -> dict[str, tuple[bytes, list[str]]]:
    """name (no extension) -> (PNG bytes, captions): 5 colours x 4 shapes x 5 places x 2 sizes = 200."""
    out = {}
    for colour in COLOURS:
        for shape in SHAPES:
            for place in PLACES:
                for size in SIZES:
                    name = f"pic_{len(out):03d}"
                    out[name] = (
                        draw(colour, shape, place, size),
                        [f"a {size} {colour} {shape}", f"{colour} {shape} in the {place}"],
                    )
    return dict(list(out.items())[:n])


def write_folder(root: Path, pics: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, (png, caps) in pics.items():
        (root / f"{name}.png").write_bytes(png)
        (root / f"{name}.txt").write_text("".join(c + "\n" for c in caps), encoding="utf-8")
    return root


def add_member(tf: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tf.addfile(info, io.BytesIO(data))


def write_shards(folder: Path, pics: dict, n_shards: int) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    names = list(pics)
    paths = []
    for s in range(n_shards):
        path = folder / f"pics-{s:03d}.tar"
        with tarfile.open(path, "w") as tf:
            for name in names[s::n_shards]:
                png, caps = pics[name]
                add_member(tf, f"{name}.png", png)
                add_member(tf, f"{name}.txt", "\n".join(caps).encode())
                add_member(tf, f"{name}.json", json.dumps({"caption": caps[0], "status": "success"}).encode())
        paths.append(path)
    return paths


def split_files(out: Path, split: str) -> dict[str, object]:
    return {
        "ids": (out / f"{split}_ids.txt").read_text(),
        "caps": (out / f"{split}_caps.txt").read_text(),
        "cap2img": (out / f"{split}_cap2img.txt").read_text(),
        "ims": np.load(out / f"{split}_ims.npy"),
    }


def captions_by_id(out: Path, split: str) -> dict[str, list[str]]:
    sp = load_precomp_split(out, split)
    got: dict[str, list[str]] = {}
    for cap, row in zip(sp.captions, sp.cap2img):
        got.setdefault(sp.image_ids[row], []).append(cap)
    return got


# ------------------------------------------------------------------------------------ the same 200 pictures


@pytest.fixture(scope="module")
def pics() -> dict:
    return make_pictures(200)


@pytest.fixture(scope="module")
def three_builds(pics, tmp_path_factory) -> dict[str, Path]:
    """The 200 pictures as a folder, a CSV (two rows per picture) and two shards, each built."""
    base = tmp_path_factory.mktemp("own")
    folder = write_folder(base / "pics", pics)
    with open(
        folder / "pairs.csv", "w", newline="", encoding="utf-8"
    ) as f:  # in the folder: paths relative to it
        w = csv.writer(f)
        w.writerow(["filepath", "caption"])
        for name, (_, caps) in pics.items():
            for c in caps:
                w.writerow([f"{name}.png", c])
    write_shards(base / "shards", pics, 2)
    outs = {k: base / f"out_{k}" for k in ("folder", "table", "webdataset")}
    assert main(["data", "folder", str(folder), "--out", str(outs["folder"]), *FAST]) == 0
    assert main(["data", "table", str(folder / "pairs.csv"), "--out", str(outs["table"]), *FAST]) == 0
    assert (
        main(
            [
                "data",
                "webdataset",
                str(base / "shards" / "pics-{000..001}.tar"),
                "--out",
                str(outs["webdataset"]),
                *FAST,
            ]
        )
        == 0
    )
    return {"base": base, "folder_in": folder, **outs}


@pytest.mark.slow  # three Lite0 builds of 200 pictures: ~10 s on an idle 2-core CPU, more when it is shared
def folder_pixels(root: Path, out: Path, *extra: str, test: str = "1", quiet: bool = False) -> int:
    """`vse [-q] data folder ROOT --out OUT --pixels --dev 1 --test TEST EXTRA...`."""
    argv = ["data", "folder", str(root), "--out", str(out), "--pixels", "--dev", "1", "--test", test, *extra]
    return main(["-q", *argv] if quiet else argv)


def test_folder_table_and_shards_give_the_same_dataset(three_builds, pics):
    outs = [three_builds[k] for k in ("folder", "table", "webdataset")]
    ids_seen: set[str] = set()
    for split, expected_n in zip(SPLITS, (160, 20, 20)):  # --dev 0.1 --test 0.1 of 200 pictures
        ref = split_files(outs[0], split)
        for other in outs[1:]:
            got = split_files(other, split)
            assert (
                got["ids"] == ref["ids"] and got["caps"] == ref["caps"] and got["cap2img"] == ref["cap2img"]
            )
            assert got["ims"].dtype == ref["ims"].dtype == np.float16
            assert np.array_equal(got["ims"], ref["ims"])  # bit-equal: same extractor, same batches
        ids = ref["ids"].split()
        assert len(ids) == expected_n and ref["ims"].shape == (expected_n, 4, 1280)
        assert not ids_seen & set(ids)
        ids_seen |= set(ids)
        for ident, caps in captions_by_id(outs[0], split).items():
            assert caps == pics[ident][1]  # the captions written for that picture, in file order
    assert ids_seen == set(pics)
    for out in outs:
        report = check_dataset(out)
        assert report.ok, report.format()
        assert main(["data", "check", str(out)]) == 0


@pytest.mark.slow
def test_features_match_the_extractor_run_on_the_files(three_builds):
    """The rows are the features of the right pictures: LiteGridExtractor.extract_paths (the openclipart
    path: the bounded reader on the file) on the test split's files, batched differently."""
    from vsekit.data.pictures import open_image
    from vsekit.features.extractor import LiteGridExtractor

    out = three_builds["folder"]
    sp = load_precomp_split(out, "test")
    paths = [sp.abs_image_path(i) for i in range(sp.n_images)]
    assert [p.name for p in paths] == [f"{i}.png" for i in sp.image_ids]
    ref = LiteGridExtractor(image_size=64).extract_paths(
        paths, batch_size=5, progress=False, open_picture=open_image
    )
    got = np.asarray(sp.features, dtype=np.float32)
    # equal bit for bit on the machines tried; another batch size may let oneDNN pick other kernels (float32
    # sums in another order, ~1e-6 relative), which after rounding to float16 (relative step 2**-11 ~ 4.9e-4)
    # moves a value by at most one step
    assert np.allclose(got, ref.astype(np.float32), rtol=1e-3, atol=1e-3)
    assert np.abs(got).max() > 0.5  # not a blank set


@pytest.mark.slow
def test_webdataset_build_stores_the_pictures_and_vse_train_runs_one_epoch(three_builds, pics, tmp_path):
    out = three_builds["webdataset"]
    m = json.loads((out / "manifest.json").read_text())
    assert "images_root" not in m and m["features"]["name"] == "efficientnet_lite0_grid"
    sp = load_precomp_split(out, "train")
    for i in range(0, sp.n_images, 37):  # the stored picture is the tar member, byte for byte
        assert sp.abs_image_path(i).read_bytes() == pics[sp.image_ids[i]][0]
    run = tmp_path / "run"
    assert (
        main(
            [
                "train",
                "--recipe",
                "bow",
                "--data",
                str(out),
                "--out",
                str(run),
                "--epochs",
                "1",
                "--batch-size",
                "32",
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    cfg = json.loads((run / "config.json").read_text())
    assert cfg["extractor"]["name"] == "efficientnet_lite0_grid"  # vse index can embed raw pictures for it
    assert cfg["machine"]["torch"] == torch.__version__ and cfg["machine"]["device"] == "cpu"
    assert list(run.glob("*.safetensors")) or list(run.glob("*/*.safetensors"))


@pytest.mark.slow
def test_an_interrupted_build_leaves_nothing_half_written_and_resumes_to_the_same_dataset(
    three_builds, tmp_path, monkeypatch, capsys
):
    from conftest import interrupt_on_call

    out = tmp_path / "out"
    monkeypatch.setattr(own_features, "PART_PICTURES", 48)  # 200 pictures -> parts of 48, 48, 48, 48, 8
    calls = interrupt_on_call(monkeypatch, own_features, "extract_part", 2)  # Ctrl-C in the second part
    assert main(["data", "folder", str(three_builds["folder_in"]), "--out", str(out), *FAST]) == 130
    assert "run the same command again to resume" in capsys.readouterr().err
    assert not (out / "manifest.json").exists()
    assert not [p.name for p in out.iterdir() if p.name != ".cache"]  # no split file at all
    assert not check_dataset(out).ok
    parts = list((out / ".cache" / "features").glob("*/part-*.keys"))
    assert len(parts) == 1 and len(parts[0].read_text().split()) == 48
    checks = {"n": 0}
    real_check = own_checks.check_picture

    def counted_check(*args):
        checks["n"] += 1
        return real_check(*args)

    monkeypatch.setattr(own_checks, "check_picture", counted_check)
    assert main(["data", "folder", str(three_builds["folder_in"]), "--out", str(out), *FAST]) == 0
    assert calls["n"] == 6  # 1 before the stop, the stopped one, then the 4 parts left
    assert checks["n"] == 0  # every picture's check came from the cache of the stopped build
    m = json.loads((out / "manifest.json").read_text())
    assert m["cache"] == {"features_computed": 152, "features_reused": 48}
    ref = json.loads((three_builds["folder"] / "manifest.json").read_text())
    assert m["files_sha256"] == ref["files_sha256"]  # every split file equals the uninterrupted build's
    # a rebuild with nothing new computes nothing and changes nothing; a touched file is checked again
    touched = three_builds["folder_in"] / "pic_007.png"
    os.utime(touched, ns=(touched.stat().st_atime_ns, touched.stat().st_mtime_ns + 10**9))
    assert main(["data", "folder", str(three_builds["folder_in"]), "--out", str(out), *FAST]) == 0
    assert checks["n"] == 1
    m2 = json.loads((out / "manifest.json").read_text())
    assert (
        m2["cache"] == {"features_computed": 0, "features_reused": 200}
        and m2["files_sha256"] == ref["files_sha256"]
    )


# ------------------------------------------------------------------------------------ problems by name


def broken_input(kind: str, base: Path) -> list[str]:
    """Six good pictures and: a broken picture, a 0-byte file, a picture without caption, a duplicate picture
    (same bytes as pic_001, its own caption) and a blank caption line, as a folder, a CSV or a shard. Returns
    the build's input arguments."""
    pics = make_pictures(6)
    png_dup, _ = pics["pic_001"]
    broken = pics["pic_002"][0][:60]  # a PNG cut short: the header reads, the pixels do not
    if kind == "folder":
        root = write_folder(base / "in", pics)
        (root / "broken.png").write_bytes(broken)
        (root / "broken.txt").write_text("a broken picture\n")
        (root / "empty.png").write_bytes(b"")
        (root / "empty.txt").write_text("an empty file\n")
        (root / "nocap.png").write_bytes(draw("red", "bar", "centre", "small", 40))
        (root / "zcopy.png").write_bytes(png_dup)
        (root / "zcopy.txt").write_text("the copy's own caption\n")
        (root / "pic_003.txt").write_text("first caption\n\nsecond caption\n\n")
        return ["folder", str(root)]
    if kind == "table":  # the table in the pictures' folder: paths (and so ids) relative to it
        root = write_folder(base / "in", pics)
        (root / "broken.png").write_bytes(broken)
        (root / "empty.png").write_bytes(b"")
        (root / "nocap.png").write_bytes(draw("red", "bar", "centre", "small", 40))
        (root / "zcopy.png").write_bytes(png_dup)
        rows = [(f"{n}.png", c) for n, (_, caps) in pics.items() for c in caps]
        rows += [
            ("broken.png", "a broken picture"),
            ("empty.png", "an empty file"),
            ("nocap.png", ""),
            ("zcopy.png", "the copy's own caption"),
            ("pic_003.png", "  "),
        ]
        table = root / "pairs.tsv"
        table.write_text("image\ttext\n" + "".join(f"{a}\t{b}\n" for a, b in rows), encoding="utf-8")
        return ["table", str(table)]
    shard = base / "shard-000.tar"
    with tarfile.open(shard, "w") as tf:
        for n, (png, caps) in pics.items():
            add_member(tf, f"{n}.png", png)
            add_member(
                tf, f"{n}.txt", "\n".join(caps).encode() + (b"\n\nextra caption" if n == "pic_003" else b"")
            )
        add_member(tf, "broken.png", broken)
        add_member(tf, "broken.txt", b"a broken picture")
        add_member(tf, "empty.png", b"")
        add_member(tf, "empty.json", json.dumps({"caption": "an empty file"}).encode())
        add_member(tf, "nocap.png", draw("red", "bar", "centre", "small", 40))
        add_member(tf, "zcopy.png", png_dup)
        add_member(tf, "zcopy.txt", b"the copy's own caption")
    return ["webdataset", str(shard)]


@pytest.mark.parametrize("kind", ["folder", "table", "webdataset"])
def test_broken_empty_uncaptioned_and_duplicate_pictures_are_named_and_skipped(kind, tmp_path, capsys):
    args = broken_input(kind, tmp_path)
    out = tmp_path / "out"
    extra = ["--device", "cpu", "--no-progress"] if kind == "folder" else ["--pixels", "--no-progress"]
    assert main(["data", *args, "--out", str(out), "--dev", "1", "--test", "1", *extra]) == 0
    err = capsys.readouterr().err
    lines = {
        k: [line for line in err.splitlines() if k in line]
        for k in ("broken.png", "empty.png", "nocap.png", "zcopy.png")
    }
    assert all(lines.values()), err
    said = {k: " | ".join(v) for k, v in lines.items()}
    assert "unreadable picture" in said["broken.png"] and "empty file" in said["empty.png"]
    assert "no caption" in said["nocap.png"]
    assert "duplicate picture" in said["zcopy.png"] and "merged into 'pic_001'" in said["zcopy.png"]
    assert "empty caption" in err  # the blank line (or cell) of pic_003
    m = json.loads((out / "manifest.json").read_text())
    assert m["counts"]["pictures"] == 6 and m["counts"]["duplicates_merged"] == 1
    assert {
        k: m["problems"][k] for k in ("unreadable picture", "empty file", "no caption", "duplicate picture")
    } == {"unreadable picture": 1, "empty file": 1, "no caption": 1, "duplicate picture": 1}
    assert "broken.png" in (out / "problems.txt").read_text()
    merged: dict[str, list[str]] = {}
    shas = []
    for split in SPLITS:
        merged.update(captions_by_id(out, split))
        shas += [
            json.loads(line)["sha256"] for line in (out / f"{split}_meta.jsonl").read_text().splitlines()
        ]
    assert sorted(merged) == [f"pic_{i:03d}" for i in range(6)]  # the copy is no picture of its own
    assert merged["pic_001"] == make_pictures(2)["pic_001"][1] + [
        "the copy's own caption"
    ]  # pooled, kept copy first
    assert len(shas) == len(set(shas)) == 6  # the same bytes lie in one split only
    assert check_dataset(out).ok
    if kind == "folder":  # the default extractor: Lite0 at 224 px, 49 x 1280 float16
        sp = load_precomp_split(out, "train")
        assert sp.features.shape[1:] == (49, 1280) and sp.features.dtype == np.float16
        assert m["features"]["image_size"] == 224
    else:
        assert not list(out.glob("*_ims.npy")) and m["build"]["pixels"]


@pytest.mark.parametrize("kind", ["folder", "table", "webdataset"])
def test_strict_names_every_problem_and_writes_nothing(kind, tmp_path, capsys):
    args = broken_input(kind, tmp_path)
    out = tmp_path / "out"
    assert main(["data", *args, "--out", str(out), "--strict", "--pixels", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "--strict" in err and "nothing was written" in err
    for name in ("broken.png", "empty.png", "nocap.png", "zcopy.png", "pic_003"):
        assert name in err, name
    assert not out.exists()


# ------------------------------------------------------------------------------------ splits, tables, ids


def test_split_by_folder_keeps_declared_splits_and_a_duplicate_goes_to_the_evaluation_side(tmp_path, capsys):
    pics = make_pictures(8)
    names = list(pics)
    root = tmp_path / "in"
    for split, chunk in (("train", names[:5]), ("val", names[5:7]), ("test", names[7:])):
        write_folder(root / split, {n: pics[n] for n in chunk})
    (root / "test" / "again.png").write_bytes(pics[names[0]][0])  # a training picture, also filed under test/
    (root / "test" / "again.txt").write_text("filed twice\n")
    out = tmp_path / "out"
    assert (
        main(
            ["data", "folder", str(root), "--out", str(out), "--split-by-folder", "--pixels", "--no-progress"]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "split conflict" in err and "train/pic_000.png" in err
    ids = {s: (out / f"{s}_ids.txt").read_text().split() for s in SPLITS}
    assert ids == {
        "train": [f"train/{n}" for n in names[1:5]],
        "dev": [f"val/{n}" for n in names[5:7]],
        "test": ["test/again", "test/pic_007"],
    }  # the smallest id of the copies is kept
    assert check_dataset(out).ok
    assert (
        main(
            ["data", "folder", str(root), "--out", str(tmp_path / "o2"), "--split-by-folder", "--dev", "0.2"]
        )
        == 2
    )
    (root / "stray.png").write_bytes(pics[names[1]][0])
    assert (
        main(["data", "folder", str(root), "--out", str(tmp_path / "o3"), "--split-by-folder", "--pixels"])
        == 2
    )
    assert "stray.png" in capsys.readouterr().err and not (tmp_path / "o3").exists()


def test_table_groups_rows_resolves_paths_and_reads_tsv_csv_and_parquet_alike(tmp_path, capsys):
    pics = make_pictures(10)
    write_folder(tmp_path / "photos", pics)
    rows = [
        (f"photos/{n}.png", c, "val" if i < 2 else "train")
        for i, (n, (_, caps)) in enumerate(pics.items())
        for c in caps
    ]
    tables = tmp_path / "tables"
    tables.mkdir()
    with open(tables / "t.csv", "w", newline="", encoding="utf-8") as f:  # other column names, absolute paths
        w = csv.writer(f)
        w.writerow(["Title", "url", "subset"])
        w.writerows([(c, str(tmp_path / p), s) for p, c, s in rows])
    (tmp_path / "t.tsv").write_text(
        "image\tcaption\tsplit\n" + "".join(f"{p}\t{c}\t{s}\n" for p, c, s in rows)
    )
    assert (
        main(
            [
                "data",
                "table",
                str(tables / "t.csv"),
                "--images-root",
                str(tmp_path),
                "--split-col",
                "subset",
                "--out",
                str(tmp_path / "a"),
                "--pixels",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "data",
                "table",
                str(tmp_path / "t.tsv"),
                "--split-col",
                "split",
                "--out",
                str(tmp_path / "b"),
                "--pixels",
                "--no-progress",
            ]
        )
        == 0
    )
    for out in (tmp_path / "a", tmp_path / "b"):
        assert (out / "dev_ids.txt").read_text().split() == ["photos/pic_000", "photos/pic_001"]
        assert not (out / "test_caps.txt").exists()  # no test rows: no test files
        got = captions_by_id(out, "train")
        assert len(got) == 8 and all(got[n] == pics[n.split("/")[1]][1] for n in got)  # two rows, one picture
        assert check_dataset(out).ok
    a, b = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")

    def data_files(m: dict) -> dict:  # _meta.jsonl records the names as each table wrote them
        return {k: v for k, v in m["files_sha256"].items() if not k.endswith("_meta.jsonl")}

    assert (
        data_files(a) == data_files(b) and len(data_files(a)) == 8
    )  # train + dev: caps, cap2img, ids, images
    assert (tmp_path / "a" / a["images_root"]).resolve() == tmp_path.resolve()
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table(
            {
                "image": [p for p, _, _ in rows],
                "caption": [c for _, c, _ in rows],
                "split": [s for _, _, s in rows],
            }
        ),
        tmp_path / "t.parquet",
    )
    assert (
        main(
            [
                "data",
                "table",
                str(tmp_path / "t.parquet"),
                "--split-col",
                "split",
                "--out",
                str(tmp_path / "c"),
                "--pixels",
                "--no-progress",
            ]
        )
        == 0
    )
    assert (
        json.loads((tmp_path / "c" / "manifest.json").read_text())["files_sha256"] == b["files_sha256"]
    )  # same names
    capsys.readouterr()


def test_table_errors_name_the_file_and_the_problem(tmp_path, capsys):
    def err_of(text: str, *extra: str) -> str:
        path = tmp_path / "t.csv"
        path.write_text(text)
        assert main(["data", "table", str(path), "--out", str(tmp_path / "o"), "--pixels", *extra]) == 2
        return capsys.readouterr().err

    assert "found none of the usual column names" in err_of("a,b\nx.png,y\n") and "--image-col" in err_of(
        "a,b\nx,y\n"
    )
    err = err_of("image,caption\nhttps://example.com/x.jpg,a cat\n")
    assert "t.csv:2" in err and "is a URL" in err
    assert "no column 'kind'" in err_of("image,caption\nx.png,a\n", "--split-col", "kind")
    assert "split 'holdout' is not train, dev or test" in err_of(
        "image,caption,s\nx.png,a,holdout\n", "--split-col", "s"
    )
    assert not (tmp_path / "o").exists()


def test_counts_and_fractions_of_a_seeded_split(tmp_path):
    from vsekit.datasets.own_pairs import assign_splits, split_count

    assert [split_count(v, 200, "--dev") for v in (0.1, 0, 0.001, 30)] == [
        20,
        0,
        1,
        30,
    ]  # >0 gives at least 1
    s = assign_splits([f"p{i}" for i in range(50)], dev=5, test=0.2, seed=3)
    assert [len(s[k]) for k in SPLITS] == [35, 5, 10]
    assert sorted(s["train"] + s["dev"] + s["test"]) == sorted(f"p{i}" for i in range(50))
    assert s == assign_splits(
        [f"p{i}" for i in reversed(range(50))], dev=5, test=0.2, seed=3
    )  # input order is no seed
    assert s != assign_splits([f"p{i}" for i in range(50)], dev=5, test=0.2, seed=4)
    with pytest.raises(ValueError, match="keep one to train on"):
        assign_splits(["a", "b"], dev=1, test=1, seed=0)
    with pytest.raises(ValueError, match="whole number"):
        split_count(2.5, 10, "--dev")


def test_ids_are_safe_and_unique():
    assert safe_id("my photos/Été 1") == "my_photos/Été_1"
    assert safe_id("../a/./.hidden") == "a/_hidden"
    items = [
        Item(n, k, PictureRef(Path(n)), ".png", ["c"])
        for n, k in (("a b.png", "a b"), ("a_b.png", "a_b"), ("a?b.jpg", "a?b"))
    ]
    assert assign_ids(items) == ["a_b-2", "a_b", "a_b-3"]  # the name that was safe keeps its id


def test_shard_patterns_expand_like_the_shell(tmp_path):
    assert expand_braces("s-{000..002}.tar") == ["s-000.tar", "s-001.tar", "s-002.tar"]
    assert expand_braces("{a,b}-{8..10}") == ["a-8", "a-9", "a-10", "b-8", "b-9", "b-10"]
    assert expand_braces("x-{2..0}") == ["x-2", "x-1", "x-0"] and expand_braces("x{}y") == ["x{}y"]
    assert split_key("a/000012.jpg") == ("a/000012", "jpg") and split_key("k.seg.json") == ("k", "seg.json")
    for name in ("s-000.tar", "s-001.tar"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in expand_shards([str(tmp_path / "s-*.tar")])] == ["s-000.tar", "s-001.tar"]
    with pytest.raises(ValueError, match=r"s-002\.tar: no such shard"):
        expand_shards([str(tmp_path / "s-{000..002}.tar")])


def test_a_foreign_dataset_folder_is_kept_unless_overwrite(tmp_path, capsys):
    root = write_folder(tmp_path / "in", make_pictures(6))
    out = tmp_path / "out"
    out.mkdir()
    (out / "train_caps.txt").write_text("someone else's captions\n")
    assert folder_pixels(root, out) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert (out / "train_caps.txt").read_text() == "someone else's captions\n"
    assert folder_pixels(root, out, "--overwrite", "--no-progress") == 0
    assert check_dataset(out).ok
    # a later build into the same folder needs no --overwrite, and a split no longer built loses its files
    assert folder_pixels(root, out, "--no-progress", test="0") == 0
    assert not list(out.glob("test_*")) and check_dataset(out).ok


def test_pixels_reference_the_pictures_where_they_are(tmp_path):
    pics = make_pictures(6)
    root = write_folder(tmp_path / "in" / "nested", pics)
    out = tmp_path / "out"
    assert folder_pixels(tmp_path / "in", out, "--no-progress") == 0
    sp = load_precomp_split(out, "train")
    assert not sp.has_features and sp.image_ids[0].startswith("nested/")
    for i in range(sp.n_images):
        path = sp.abs_image_path(i)
        assert path.resolve().parent == root.resolve()
        assert (
            hashlib.sha256(path.read_bytes()).hexdigest()
            == hashlib.sha256(pics[Path(path).stem][0]).hexdigest()
        )
    # a name that a one-path-per-line list cannot hold (leading space): every picture is copied into OUT/images
    (root.parent / " lead.png").write_bytes(
        draw("blue", "bar", "centre", "large")
    )  # at the images root's top
    (root.parent / " lead.txt").write_text("a large blue bar\n")
    assert folder_pixels(tmp_path / "in", out, "--no-progress") == 0
    m = json.loads((out / "manifest.json").read_text())
    assert "images_root" not in m and m["build"]["copy_images"]
    ids = [i for s in SPLITS for i in (out / f"{s}_ids.txt").read_text().split()]
    assert "_lead" in ids and check_dataset(out).ok
    for split in SPLITS:
        sp = load_precomp_split(out, split)
        for i in range(sp.n_images):
            assert sp.abs_image_path(i) == (out / "images" / f"{sp.image_ids[i]}.png").resolve()


def test_progress_bars_go_quiet_under_q(tmp_path, capsys):
    root = write_folder(tmp_path / "in", make_pictures(4))
    assert folder_pixels(root, tmp_path / "a") == 0
    assert "check pictures" in capsys.readouterr().err  # the bar, written once at the end off a terminal
    assert folder_pixels(root, tmp_path / "b", quiet=True) == 0
    captured = capsys.readouterr()
    assert "check pictures" not in captured.err and "dataset ready" in captured.out


def test_another_backbone_gives_its_last_feature_map(tmp_path, monkeypatch):
    """python:<module>:<function> with local weights: a 1x1 convolution with stride 32, so each region of a
    one-colour picture is w . ((c/255 - mean) / std) + b, computed here by hand."""
    import sys

    import torch

    (tmp_path / "tinynet.py").write_text(
        "import torch\n"
        "class Tiny(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.features = torch.nn.Conv2d(3, 2, 1, stride=32)\n"
        "def make():\n"
        "    return Tiny()\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("tinynet", None)
    w = torch.tensor([[[[1.0]], [[2.0]], [[-1.0]]], [[[0.5]], [[0.0]], [[0.25]]]])
    b = torch.tensor([0.1, -0.2])
    torch.save({"features.weight": w, "features.bias": b}, tmp_path / "tiny.pth")
    root = tmp_path / "in"
    root.mkdir()
    colours = {"a": (255, 0, 0), "b": (0, 128, 255), "c": (10, 20, 30), "d": (200, 200, 200)}
    for name, rgb in colours.items():
        Image.new("RGB", (50, 40), rgb).save(root / f"{name}.png")
        (root / f"{name}.txt").write_text(f"colour {name}\n")
    out = tmp_path / "out"
    assert (
        main(
            [
                "data",
                "folder",
                str(root),
                "--out",
                str(out),
                "--backbone",
                "python:tinynet:make",
                "--backbone-weights",
                str(tmp_path / "tiny.pth"),
                "--image-size",
                "64",
                "--dev",
                "1",
                "--test",
                "1",
                "--device",
                "cpu",
                "--no-progress",
            ]
        )
        == 0
    )
    m = json.loads((out / "manifest.json").read_text())
    assert m["features"]["name"] == "grid:python:tinynet:make" and m["features"]["regions"] == 4
    mean, std = np.array([0.485, 0.456, 0.406]), np.array([0.229, 0.224, 0.225])
    for split in SPLITS:
        sp = load_precomp_split(out, split)
        for row, ident in enumerate(sp.image_ids):
            v = (np.array(colours[ident]) / 255 - mean) / std
            expect = np.array([v @ np.array([1.0, 2.0, -1.0]) + 0.1, v @ np.array([0.5, 0.0, 0.25]) - 0.2])
            got = np.asarray(sp.features[row], dtype=np.float64)
            assert got.shape == (4, 2)
            # float16 storage: relative step 2**-11 of values below 8 -> at most 4e-3 off
            assert np.allclose(got, np.broadcast_to(expect, (4, 2)), atol=5e-3), (ident, got, expect)
