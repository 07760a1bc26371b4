"""`vse data karpathy --images DIR` with the pictures outside the dataset folder: the dataset declares the
images root (manifest.json `images_root`), `{split}_images.txt` lists paths under it, training and
evaluation read the pictures there, and a path that escapes the declared root is still refused."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.data.precomp import DataFormatError, load_precomp_split
from vsekit.data.raw_images import convert_karpathy
from vsekit.data.validate import check_dataset

PIL = pytest.importorskip("PIL.Image")

# the tiniest backbone training the tests use: 32-pixel pictures, 16-d embeddings, one epoch
TINY_E2E = [
    "--recipe",
    "vse_infty_grid_e2e",
    "--epochs",
    "1",
    "--batch-size",
    "4",
    "--device",
    "cpu",
    "--no-progress",
    "--set",
    "model.image.image_size=32",
    "--set",
    "model.embed_dim=16",
    "--set",
    "model.text.word_dim=8",
    "--set",
    "model.text.vocab_min_count=1",
    "--set",
    "data.captions_per_image=2",
    "--set",
    "train.log_every=0",
]


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


def _karpathy(tmp_path: Path, pics: Path, splits=("train",) * 6 + ("val",) * 3 + ("test",) * 3) -> Path:
    """A Karpathy JSON beside `pics/sub/im{i}.png`, two captions per picture."""
    (pics / "sub").mkdir(parents=True, exist_ok=True)
    images = []
    for i, split in enumerate(splits):
        arr = (np.random.default_rng(i).random((20, 24, 3)) * 255).astype(np.uint8)
        PIL.fromarray(arr).save(pics / "sub" / f"im{i}.png")
        sents = [{"raw": f"a {w} picture number {i}", "tokens": []} for w in ("red", "blue")]
        images.append(
            {"filepath": "sub", "filename": f"im{i}.png", "split": split, "imgid": i, "sentences": sents}
        )
    js = tmp_path / "dataset_test.json"
    js.write_text(json.dumps({"images": images}))
    return js


def test_images_outside_the_dataset_folder_train_and_evaluate(tmp_path, capsys):
    """The docs' flow: convert with --images elsewhere, then `vse train` a backbone recipe on the folder."""
    pics = tmp_path / "elsewhere" / "pics"
    js = _karpathy(tmp_path, pics)
    data, run = tmp_path / "data" / "f30k_raw", tmp_path / "run"
    assert main(["data", "karpathy", str(js), "--images", str(pics), "--out", str(data)]) == 0
    capsys.readouterr()
    assert main(["train", "--data", str(data), "--out", str(run), *TINY_E2E]) == 0, capsys.readouterr().err
    assert "best dev rsum" in capsys.readouterr().out
    assert main(["eval", str(run), "--device", "cpu"]) == 0
    assert "rsum" in capsys.readouterr().out
    assert (
        main(["data", "show", str(data), "--split", "test", "--n", "3", "--out", str(tmp_path / "m.png")])
        == 0
    )
    # `vse index` reads the split's pictures under the declared root too
    assert main(["index", str(run), f"{data}:test", "--out", str(tmp_path / "idx")]) == 0, (
        capsys.readouterr().err
    )
    index_json = json.loads((tmp_path / "idx" / "index.json").read_text())
    assert index_json.get("count", index_json.get("n_images", 1)) != 0
    # the layout: the declared root, paths under it, a dataset `vse data check` passes
    manifest = json.loads((data / "manifest.json").read_text())
    assert manifest["images_root"] == str(pics.resolve()) and manifest["format"] == "karpathy"
    assert (data / "train_images.txt").read_text().splitlines()[:2] == ["sub/im0.png", "sub/im1.png"]
    assert check_dataset(data, captions_per_image=2).ok


def test_pictures_under_the_dataset_folder_are_recorded_relative_and_move_with_it(tmp_path):
    data = tmp_path / "data"
    js = _karpathy(tmp_path, data / "pics")
    convert_karpathy(js, data, data / "pics")
    assert json.loads((data / "manifest.json").read_text())["images_root"] == "pics"
    moved = shutil.move(str(data), str(tmp_path / "moved"))
    split = load_precomp_split(moved, "train", 2)
    assert split.abs_image_path(0) == (Path(moved) / "pics" / "sub" / "im0.png").resolve()
    assert (
        split.truncate(2).abs_image_path(1).is_file()
        and split.sample_images(0.5, 0).abs_image_path(0).is_file()
    )


def test_a_path_escaping_the_declared_root_is_still_refused(tmp_path, capsys):
    pics = tmp_path / "pics"
    js = _karpathy(tmp_path, pics)
    data = tmp_path / "data"
    convert_karpathy(js, data, pics)
    secret = tmp_path / "secret.png"
    shutil.copy(pics / "sub" / "im0.png", secret)  # a real picture, outside the declared root
    lines = (data / "train_images.txt").read_text().splitlines()
    for bad in ("../secret.png", "sub/../../secret.png", str(secret)):
        (data / "train_images.txt").write_text("\n".join([bad, *lines[1:]]) + "\n")
        report = check_dataset(data, ["train"], captions_per_image=2)
        assert any(
            p.where == ":1" and "points outside the images root" in p.message for p in report.errors
        ), bad
        with pytest.raises(DataFormatError, match="points outside the images root"):
            load_precomp_split(data, "train", 2).abs_image_path(0)
        out = tmp_path / f"run{len(bad)}"
        assert main(["train", "--data", str(data), "--out", str(out), *TINY_E2E]) == 2
        assert "train_images.txt:1" in capsys.readouterr().err and not out.exists()
    if hasattr(os, "symlink"):  # a symlink inside the root that points out of it
        os.symlink(secret, pics / "sub" / "link.png")
        (data / "train_images.txt").write_text("\n".join(["sub/link.png", *lines[1:]]) + "\n")
        with pytest.raises(DataFormatError, match="points outside the images root"):
            load_precomp_split(data, "train", 2).abs_image_path(0)


def test_images_root_that_is_missing_or_not_a_path_is_named(tmp_path):
    pics = tmp_path / "pics"
    data = tmp_path / "data"
    convert_karpathy(_karpathy(tmp_path, pics), data, pics)
    shutil.rmtree(pics)
    report = check_dataset(data, ["train"], captions_per_image=2)
    assert any("manifest.json" in str(p) and "no such folder" in p.message for p in report.errors)
    (data / "manifest.json").write_text(json.dumps({"images_root": 3}))
    with pytest.raises(DataFormatError, match="manifest.json: images_root must be a folder path"):
        load_precomp_split(data, "train", 2)


def test_a_json_entry_outside_the_images_folder_writes_nothing(tmp_path):
    pics = tmp_path / "pics"
    js = _karpathy(tmp_path, pics)
    doc = json.loads(js.read_text())
    shutil.copy(pics / "sub" / "im0.png", tmp_path / "outside.png")
    doc["images"][0]["filepath"], doc["images"][0]["filename"] = "..", "outside.png"  # pics/../outside.png
    js.write_text(json.dumps(doc))
    out = tmp_path / "data"
    with pytest.raises(DataFormatError, match="outside the images folder"):
        convert_karpathy(js, out, pics)
    assert not out.exists()


def test_more_splits_with_another_images_folder_are_refused(tmp_path):
    js = _karpathy(tmp_path, tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")
    data = tmp_path / "data"
    convert_karpathy(js, data, tmp_path / "a", splits=("train",))
    before = {p.name: p.read_bytes() for p in data.iterdir()}
    with pytest.raises(DataFormatError, match="split\\(s\\) train list pictures under"):
        convert_karpathy(js, data, tmp_path / "b", splits=("test",))
    assert {p.name: p.read_bytes() for p in data.iterdir()} == before  # nothing written
    convert_karpathy(js, data, tmp_path / "a", splits=("test",))  # the same folder: added beside train
    manifest = json.loads((data / "manifest.json").read_text())
    assert (
        set(manifest["splits"]) == {"train", "test"}
        and load_precomp_split(data, "test", 2).abs_image_path(0).is_file()
    )


def test_old_layout_with_absolute_paths_says_to_convert_again(tmp_path):
    pics = tmp_path / "pics"
    data = tmp_path / "data"
    convert_karpathy(_karpathy(tmp_path, pics), data, pics)
    (
        data / "manifest.json"
    ).unlink()  # what an older `vse data karpathy` wrote: absolute paths, no images_root
    absolute = [str(pics / "sub" / f"im{i}.png") for i in range(6)]
    (data / "train_images.txt").write_text("\n".join(absolute) + "\n")
    report = check_dataset(data, ["train"], captions_per_image=2)
    assert any(
        "points outside the dataset directory" in p.message and "convert the JSON again" in p.message
        for p in report.errors
    )
