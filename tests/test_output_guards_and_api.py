"""Result files never destroy inputs and are checked before any work (`--json-out`, `--save-sims`, `vse data
show --out`); a weights file that is not a checkpoint, and bad values given to `vsekit.load` and the model's
`encode_image` / `similarity`, are one-line errors naming the file or argument; the collapse alarm's advice is
something `vse train` accepts."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

import vsekit
from vsekit.api import ModelInputError, ModelInputTypeError
from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.errors import VseInputError
from vsekit.models.vse import DataSpec, VSEModel
from vsekit.training.trainer import Trainer

TINY = ["model.embed_dim=32", "model.text.word_dim=16", "train.batch_size=16", "train.epochs=1"]
VOCAB = ["<pad>", "<start>", "<end>", "<unk>", "a", "dog", "runs", "<mask>"]


@pytest.fixture(scope="module")
def run_and_index(tiny_data, tmp_path_factory):
    """A finished 1-epoch run on the tiny synthetic set, and an index of its test split (from its features)."""
    base = tmp_path_factory.mktemp("guards")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(
            load_recipe("vsepp", TINY), tiny_data, base / "run", progress=False, log=lambda *_: None
        ).fit()
        assert (
            main(
                [
                    "index",
                    str(base / "run"),
                    f"{tiny_data}:test",
                    "--out",
                    str(base / "idx"),
                    "--quiet",
                    "--device",
                    "cpu",
                ]
            )
            == 0
        )
    finally:
        torch.set_num_threads(threads)
    return base / "run", base / "idx"


def snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys, *needles: str) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "error:" in err and "internal error" not in err, err
    for needle in needles:
        assert needle in err, err
    return err


# ------------------------------------------------------------------------ D1: results never overwrite inputs


def test_json_out_never_overwrites_the_index_or_its_run(run_and_index, tmp_path, capsys):
    run, idx = run_and_index
    before_idx, before_run = snapshot(idx), snapshot(run)
    for target in (
        idx / "index.json",
        idx / "new.json",
        run / "config.json",
    ):  # the run: recorded by the index
        assert main(["search", str(idx), "green", "--json-out", str(target), "--device", "cpu"]) == 2
        one_line_error(capsys, f"--json-out {target}", "which this command reads")
    link = tmp_path / "hits.json"
    link.symlink_to(idx / "index.json")  # a link that leads into the index is refused as well
    assert main(["search", str(idx), "green", "--json-out", str(link), "--device", "cpu"]) == 2
    one_line_error(capsys, "--json-out")
    assert snapshot(idx) == before_idx and snapshot(run) == before_run
    assert (
        main(["search", str(idx), "green", "--json-out", str(tmp_path / "ok.json"), "--device", "cpu"]) == 0
    )
    assert isinstance(json.loads((tmp_path / "ok.json").read_text()), list)


def test_eval_result_files_never_overwrite_the_run_or_its_dataset(run_and_index, tiny_data, tmp_path, capsys):
    run, _ = run_and_index
    before_run, before_data = snapshot(run), snapshot(tiny_data)
    for flag, target in (
        ("--json-out", run / "config.json"),
        ("--save-sims", run / "best.safetensors"),
        ("--json-out", tiny_data / "test_caps.txt"),  # the dataset the run records
        ("--save-sims", tiny_data / "test_ims.npy"),
    ):
        assert main(["eval", str(run), "--device", "cpu", flag, str(target)]) == 2
        one_line_error(capsys, f"{flag} {target}", "which this command reads")
    assert snapshot(run) == before_run and snapshot(tiny_data) == before_data
    sims = tmp_path / "s.npy"
    np.save(sims, np.eye(4, 20, dtype=np.float32))
    before = sims.read_bytes()
    assert main(["eval-sims", str(sims), "--json-out", str(sims)]) == 2  # the matrix it reads
    one_line_error(capsys, f"--json-out {sims}")
    assert sims.read_bytes() == before


# ------------------------------------------------------------------------ W4: exactly the named file


def test_save_sims_writes_exactly_the_named_file(run_and_index, tmp_path, capsys):
    run, _ = run_and_index
    out = tmp_path / "sims.bin"
    assert (
        main(
            [
                "eval",
                str(run),
                "--device",
                "cpu",
                "--save-sims",
                str(out),
                "--json-out",
                str(tmp_path / "m.json"),
            ]
        )
        == 0
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.json", "sims.bin"]  # no sims.bin.npy beside it
    assert f"wrote {out}" in capsys.readouterr().out  # and it says so
    sims = np.load(out, allow_pickle=False)
    assert sims.shape == (12, 60)  # the tiny set's test split: 12 images x 5 captions each
    # the saved matrix is the one that was scored: eval-sims of the file gives the same metrics
    assert main(["eval-sims", str(out), "--json-out", str(tmp_path / "again.json")]) == 0
    first, again = (json.loads((tmp_path / n).read_text()) for n in ("m.json", "again.json"))
    assert again["rsum"] == pytest.approx(first["rsum"]) and again["i2t_r1"] == pytest.approx(first["i2t_r1"])


# ------------------------------------------------------------------------ P11: missing folders, before work


def test_result_file_in_a_missing_folder_fails_before_any_work(run_and_index, tmp_path, capsys, monkeypatch):
    import vsekit.evaluation as evaluation

    run, idx = run_and_index

    def no_encoding(*args, **kwargs):
        raise AssertionError("the split was encoded before the output was checked")

    monkeypatch.setattr(evaluation, "evaluate_model", no_encoding)
    missing = tmp_path / "missing" / "dir"
    assert main(["eval", str(run), "--device", "cpu", "--save-sims", str(missing / "s.npy")]) == 2
    one_line_error(capsys, f"--save-sims {missing / 's.npy'}", "does not exist")
    assert main(["eval", str(run), "--device", "cpu", "--json-out", str(missing / "m.json")]) == 2
    one_line_error(capsys, "--json-out", "does not exist")
    assert (
        main(["search", str(idx), "green", "--json-out", str(missing / "hits.json"), "--device", "cpu"]) == 2
    )
    one_line_error(capsys, "--json-out", "does not exist")
    assert not (tmp_path / "missing").exists()  # no parent is created
    (tmp_path / "file").write_text("x")
    assert (
        main(
            ["search", str(idx), "green", "--json-out", str(tmp_path / "file" / "h.json"), "--device", "cpu"]
        )
        == 2
    )
    one_line_error(capsys, "is not a folder")


# ------------------------------------------------------------------------ C6: vse data show --out


@pytest.fixture
def picture_set(tmp_path) -> Path:
    """A two-picture split with one caption each, as `vse data show` reads it."""
    data = tmp_path / "pics"
    data.mkdir()
    for i, colour in enumerate(((255, 0, 0), (0, 0, 255))):
        Image.new("RGB", (32, 32), colour).save(data / f"p{i}.png")
    (data / "test_images.txt").write_text("p0.png\np1.png\n")
    (data / "test_caps.txt").write_text("a red square\na blue square\n")
    return data


def test_data_show_out_must_be_a_picture_outside_the_dataset(picture_set, tmp_path, capsys):
    bad = tmp_path / "x.npy"
    assert main(["data", "show", str(picture_set), "--out", str(bad)]) == 2
    one_line_error(capsys, f"--out {bad}", "'.npy' is not a picture format")
    assert not bad.exists()
    inside = picture_set / "montage.png"
    assert main(["data", "show", str(picture_set), "--out", str(inside)]) == 2
    one_line_error(capsys, "which this command reads")
    assert not inside.exists()
    good = tmp_path / "m.jpg"
    assert main(["data", "show", str(picture_set), "--out", str(good), "--n", "2"]) == 0
    with Image.open(good) as im:
        assert im.format == "JPEG" and im.width == 2 * (224 + 16)  # two cells of 224 px and their padding


# ------------------------------------------------------------------------ C5: --backbone-weights


def test_weights_file_that_is_no_checkpoint_is_named_in_one_line(tmp_path):
    pytest.importorskip("efficientnet_lite_pytorch")
    from vsekit.features.backbones import build_backbone
    from vsekit.features.efficientnet import GridFeatureExtractor

    text = tmp_path / "notes.txt"
    text.write_text("these are not weights\n")
    empty = tmp_path / "empty.pth"
    empty.write_bytes(b"")
    listed = tmp_path / "list.pth"
    torch.save([torch.zeros(1)], listed)
    for path in (text, empty, listed):
        for make in (
            lambda p: build_backbone("efficientnet_lite0", str(p)),
            lambda p: GridFeatureExtractor(str(p)),
        ):
            with pytest.raises(VseInputError) as info:
                make(path)
            msg = str(info.value)
            assert msg.startswith(f"{path}: ") and len(msg.splitlines()) == 1, msg
    small = tmp_path / "small.pth"
    torch.save({"weight": torch.zeros(2, 2)}, small)
    with pytest.raises(VseInputError, match=r"small.pth: does not fit EfficientNet-Lite0"):
        GridFeatureExtractor(str(small))


# ------------------------------------------------------------------------ W5: the API's input rules


@pytest.fixture(scope="module")
def features_run() -> VSEModel:
    torch.manual_seed(0)
    recipe = load_recipe("vsepp", ["model.embed_dim=16", "model.text.word_dim=8"])
    return VSEModel(recipe, DataSpec(img_dim=8, vocab_words=VOCAB)).eval()


def test_uint8_is_refused_by_a_feature_run_and_nan_embeddings_by_similarity(features_run):
    pixels = np.random.default_rng(0).integers(0, 256, (2, 3, 8), dtype=np.uint8)
    for x in (pixels, torch.from_numpy(pixels)):
        with pytest.raises(
            ModelInputError, match=r"encode_image: features of dtype torch.uint8: .*float features"
        ):
            features_run.encode_image(x)
    with torch.no_grad():
        img = features_run.encode_image(torch.randn(3, 2, 8))
        txt = features_run.encode_text(["a dog", "a dog runs"])
        assert torch.isfinite(features_run.similarity(img, txt)).all()
        bad_img, bad_txt = img.clone(), txt.clone()
        bad_img[1, 0] = float("nan")
        bad_txt[0, 3] = float("inf")
        with pytest.raises(
            ModelInputError, match=r"similarity: image embeddings hold NaN or inf \(1 of 48 values\)"
        ):
            features_run.similarity(bad_img, txt)
        with pytest.raises(
            ModelInputError, match=r"similarity: caption embeddings hold NaN or inf \(1 of 32 values\)"
        ):
            features_run.similarity(img, bad_txt.numpy())
        assert isinstance(ModelInputError("x"), ValueError)


# ------------------------------------------------------------------------ P10: vsekit.load's arguments


def test_load_names_a_bad_argument(tmp_path):
    for run in (None, 3):
        with pytest.raises(ModelInputTypeError, match=r"^load: run must be the path of a run folder") as info:
            vsekit.load(run)
        assert isinstance(info.value, TypeError) and isinstance(info.value, VseInputError)
    with pytest.raises(ModelInputError, match=r"load: checkpoint 'newest'; choose one of best, last"):
        vsekit.load(tmp_path, checkpoint="newest")
    with pytest.raises(ModelInputError, match=r"load: device 'gpu' is not a device"):
        vsekit.load(tmp_path, device="gpu")


# ------------------------------------------------------------------------ P8: the collapse alarm's advice


def test_collapse_advice_is_a_new_run_with_settings_vse_train_takes(run_and_index, capsys):
    from vsekit.commands.train import RESUME_KEYS
    from vsekit.training.collapse import CollapseReport

    msg = CollapseReport(
        step=9,
        steps=3,
        loss=1.6,
        collapse_value=1.6,
        spread=0.5,
        by_loss=True,
        by_spread=False,
        kind="hardest-negative triplet",
    ).message()
    assert "start a new run" in msg and "--set optim.lr=" in msg
    keys = re.findall(r"--set ([a-z_.]+)=", msg)
    assert "optim.lr" in keys and len(keys) >= 3
    values = {
        "optim.lr": "0.0001",
        "loss.warmup_epochs": "1",
        "loss.max_violation": "false",
        "model.image.backbone_frozen_epochs": "2",
    }
    load_recipe("vsepp", [f"{k}={values[k]}" for k in keys])  # a new run takes every advised setting
    run, _ = run_and_index  # and --resume refuses them, as the advice says: it is not advised
    assert not set(keys) & set(RESUME_KEYS)
    assert main(["train", "--resume", str(run), "--set", "optim.lr=0.0001", "--no-progress"]) == 2
    one_line_error(capsys, "start a new run to change optim.lr")
