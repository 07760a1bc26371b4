"""`check_dataset` / `vse data check`: one report naming every problem with its file and line/row."""

import shutil

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.data.precomp import DataFormatError, load_precomp_split
from vsekit.data.validate import check_dataset, discover_splits
from vsekit.training.trainer import Trainer
from vsekit_lab.datasets.synthetic import make_synthetic_precomp


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)  # tiny models: a second thread only adds spin-waiting on a shared CPU


@pytest.fixture
def data(tmp_path):
    return make_synthetic_precomp(tmp_path / "d", n_train=40, n_dev=10, n_test=10, regions=4, dim=8)


def _lines(path):
    return path.read_text(encoding="utf-8").splitlines()


def _found(report, path_end, where, text):
    return any(p.path.endswith(path_end) and p.where == where and text in p.message for p in report.problems)


def test_clean_dataset_passes(data):
    report = check_dataset(data)
    assert report.ok and report.problems == []
    assert discover_splits(data) == ["train", "dev", "test"]
    assert report.splits["train"] == {"feature_shape": (4, 8), "captions": 200, "images": 40}
    assert "OK: 0 error(s)" in report.format()


def test_every_problem_is_reported_with_file_and_line(data):
    feats = np.load(data / "train_ims.npy")
    feats[7, 2, 3] = np.nan
    feats[9, 0, 0] = np.inf
    np.save(data / "train_ims.npy", feats)
    caps = (data / "train_caps.txt").read_bytes().split(b"\n")
    caps[2] = b"   "
    caps[4] = b"caf\xe9 latte"  # Latin-1, not UTF-8
    caps[6] = b"word " * 300
    (data / "train_caps.txt").write_bytes(b"\n".join(caps))
    np.save(data / "test_ims.npy", np.zeros((10, 4, 9), dtype=np.float32) + 1)
    (data / "dev_caps.txt").unlink()
    ids = _lines(data / "test_ids.txt")
    ids[3] = "train00005"  # the same picture in train and test
    (data / "test_ids.txt").write_text("\n".join(ids) + "\n")
    report = check_dataset(data)
    assert not report.ok
    assert _found(report, "train_ims.npy", " row 7", "NaN or inf features (2 bad row(s)")
    assert _found(report, "train_caps.txt", ":3", "empty caption")
    assert _found(report, "train_caps.txt", ":5", "not UTF-8")
    assert _found(report, "train_caps.txt", ":7", "300 words")
    assert _found(report, "dev_caps.txt", "", "missing")
    assert _found(report, "", "", "feature size differs between splits (train 8, dev 8, test 9)")
    assert _found(report, "test_ids.txt", "", "also in split 'train', e.g. 'train00005' (train/test leakage)")
    text = report.format()
    assert "train_caps.txt:5: not UTF-8" in text and text.endswith("error(s), 1 warning(s)")
    assert [p.severity for p in report.problems if "300 words" in p.message] == ["warning"]


def test_layout_and_ids_problems(data):
    (data / "dev_caps.txt").write_text("\n".join(_lines(data / "dev_caps.txt")[:-1]) + "\n")  # 49 captions
    c2i = ["0"] * 49 + ["x"]
    caps = "\n".join(f"c {i}" for i in range(50)) + "\n"
    (data / "test_caps.txt").write_text(caps)
    (data / "test_cap2img.txt").write_text("\n".join(c2i) + "\n")
    ids = _lines(data / "train_ids.txt")
    (data / "train_ids.txt").write_text(
        "\n".join([i for i in ids for _ in range(5)][:-1] + ["train00099"]) + "\n"
    )
    report = check_dataset(data)
    assert _found(
        report, "dev_caps.txt", "", "49 captions do not fit 10 image rows with 5 captions per image"
    )
    assert _found(report, "test_cap2img.txt", ":50", "expected one integer, got 'x'")
    assert _found(report, "train_ids.txt", ":200", "id 'train00099' differs from 'train00039'")
    (data / "test_cap2img.txt").write_text("\n".join(["0"] * 49 + ["10"]) + "\n")
    report = check_dataset(data, splits=["test"])
    assert list(report.splits) == ["test"]
    assert _found(report, "test_cap2img.txt", ":50", "image row 10 outside 0..9")
    (data / "test_cap2img.txt").write_text("\n".join(["0"] * 50) + "\n")
    assert _found(
        check_dataset(data, splits=["test"]),
        "test_cap2img.txt",
        "",
        "image row 1 has no caption (9 such rows)",
    )


def test_unreadable_features_and_picture_paths(data):
    raw = (data / "dev_ims.npy").read_bytes()
    (data / "dev_ims.npy").write_bytes(raw[: len(raw) // 2])
    np.save(data / "test_ims.npy", np.ones((10, 8), dtype=np.float32))
    (data / "images").mkdir()
    (data / "images" / "a.png").write_bytes(b"x")
    paths = ["images/a.png"] * 38 + ["../../etc/passwd", "images/missing.png"]
    (data / "train_images.txt").write_text("\n".join(paths) + "\n")
    report = check_dataset(data)
    assert _found(
        report, "dev_ims.npy", "", "not a plain numeric .npy array"
    )  # open_npy's words, as a load's
    assert _found(report, "test_ims.npy", "", "expected shape (images, regions, dim), got (10, 8)")
    assert _found(report, "train_images.txt", ":39", "points outside the dataset directory")
    assert _found(report, "train_images.txt", ":40", "no such picture")


def test_many_problems_of_one_kind_are_summarised(data):
    (data / "train_caps.txt").write_text("\n" * 200)
    report = check_dataset(data)
    empty = [p for p in report.problems if p.message == "empty caption"]
    assert [p.where for p in empty] == [":1", ":2", ":3", ":4", ":5"]
    assert any("and 195 more like 'empty caption'" in p.message for p in report.problems)


def test_cli_exit_code_and_missing_dir(data, tmp_path, capsys):
    assert main(["data", "check", str(data)]) == 0
    assert "OK: 0 error(s)" in capsys.readouterr().out
    shutil.copy(data / "dev_caps.txt", data / "train_caps.txt")
    assert main(["data", "check", str(data)]) == 1
    out = capsys.readouterr().out
    assert "train_caps.txt: 50 captions do not fit 40 image rows" in out and "FAILED: 1 error(s)" in out
    assert main(["data", "check", str(tmp_path / "nope")]) == 1
    assert "dataset directory does not exist" in capsys.readouterr().out


def test_trainer_refuses_bad_data_before_training(data, tmp_path):
    feats = np.load(data / "dev_ims.npy")
    feats[3] = np.nan
    np.save(data / "dev_ims.npy", feats)
    (data / "train_caps.txt").write_text((data / "train_caps.txt").read_text().replace("\n", "\n\n", 1))
    r = load_recipe("vsepp", ["model.embed_dim=16", "train.batch_size=8"])
    with pytest.raises(DataFormatError) as e:
        Trainer(r, data, tmp_path / "run", progress=False, log=lambda *_: None)
    assert "dev_ims.npy row 3" in str(e.value) and "train_caps.txt" in str(e.value)
    assert not (tmp_path / "run").exists()


def test_check_applies_the_load_rules_and_lists_every_problem(data):
    """`vse data check` runs the rules a load runs (one copy, `precomp.read_split_files`), collecting: the
    problem a load stops at is in the report word for word, and so is every other one of the file."""
    (data / "train_ims_lengths.txt").write_text("4\n" * 37 + "0\nx\n9\n")  # 40 rows of 4 regions
    with pytest.raises(DataFormatError) as e:
        load_precomp_split(data, "train")
    report = check_dataset(data)
    listed = [f"{p.path}{p.where}: {p.message}" for p in report.errors]
    assert str(e.value) in listed and str(e.value).endswith(
        "train_ims_lengths.txt:39: expected one integer, got 'x'"
    )
    assert _found(report, "train_ims_lengths.txt", ":38", "set size 0 outside 1..4") is False  # not read: 'x'
    (data / "train_ims_lengths.txt").write_text("4\n" * 37 + "0\n4\n9\n")
    report = check_dataset(data)
    assert _found(report, "train_ims_lengths.txt", ":38", "set size 0 outside 1..4")
    assert _found(report, "train_ims_lengths.txt", ":40", "set size 9 outside 1..4")
    (data / "train_ims_lengths.txt").unlink()
    (data / "dev_images.txt").write_text("a.png\n" * 9)  # 10 images
    with pytest.raises(DataFormatError, match="dev_images.txt: 9 paths for 10 images"):
        load_precomp_split(data, "dev")
    assert _found(check_dataset(data), "dev_images.txt", "", "9 paths for 10 images")
