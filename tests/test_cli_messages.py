"""Errors name their cause in one line (exit 2) instead of a library's words; `--json` means the same
everywhere; a split without pictures is indexed from its features; `vse` starts without torch; `vse eval-sims`
is as fast as a minimal numpy script; only dedicated input-error types count as bad input."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.config import load_recipe
from vsekit.metrics.retrieval import ranks_both, ranks_i2t, ranks_t2i
from vsekit.training.trainer import Trainer
from vsekit_lab.datasets.synthetic import make_synthetic_precomp

TINY = [
    "model.embed_dim=16",
    "model.text.word_dim=8",
    "train.batch_size=16",
    "train.log_every=0",
    "train.epochs=1",
]


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    """8-wide features, no `{split}_images.txt` (features only)."""
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("d8"), n_train=40, n_dev=10, n_test=10, regions=4, dim=8
    )


@pytest.fixture(scope="module")
def run(data, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs") / "r"
    Trainer(load_recipe("vsepp", TINY), data, out, progress=False, log=lambda *_: None).fit()
    return out


@pytest.fixture(scope="module")
def narrow(data, tmp_path_factory) -> Path:
    """The same dataset with 6-wide features (same captions, so the same vocabulary)."""
    out = tmp_path_factory.mktemp("d6") / "data"
    shutil.copytree(data, out)
    for split in ("train", "dev", "test"):
        feats = np.load(out / f"{split}_ims.npy")
        np.save(out / f"{split}_ims.npy", np.ascontiguousarray(feats[..., :6]))
    return out


def one_line_error(capsys, argv: list[str], verb: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [x for x in err.splitlines() if x.startswith("vse ")]
    assert len(lines) == 1 and lines[0].startswith(f"vse {verb}: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


# ----------------------------------------------------------------------------- 1. messages that name the cause


def test_feature_width_mismatch_names_the_file_and_the_width(run, narrow, tmp_path, capsys):
    ims = str(narrow / "test_ims.npy")
    err = one_line_error(capsys, ["eval", str(run), "--data", str(narrow), "--device", "cpu"], "eval")
    assert ims in err and "6 wide" in err and "expects 8-wide" in err and "mat1" not in err
    err = one_line_error(
        capsys, ["index", str(run), f"{narrow}:test", "--out", str(tmp_path / "i"), "--quiet"], "index"
    )
    assert ims in err and "expects 8-wide" in err
    resumed = shutil.copytree(run, tmp_path / "resumed")
    err = one_line_error(
        capsys,
        ["train", "--resume", str(resumed), "--data", str(narrow), "--epochs", "2", "--no-progress"],
        "train",
    )
    assert str(narrow / "train_ims.npy") in err and "expects 8-wide" in err


@pytest.mark.parametrize("verb", ["eval", "train", "index"])
def test_unknown_device_names_the_valid_choices(verb, run, data, tmp_path, capsys):
    argv = {
        "eval": ["eval", str(run)],
        "index": ["index", str(run), f"{data}:test", "--out", str(tmp_path / "i")],
        "train": ["train", "--data", str(data), "--out", str(tmp_path / "t"), "--no-progress"],
    }[verb]
    err = one_line_error(capsys, [*argv, "--device", "gpu"], verb)
    assert "'gpu' is not a device" in err and "cpu, cuda, cuda:N, mps, auto" in err
    assert not (tmp_path / "t").exists() and not (tmp_path / "i").exists()


@pytest.mark.parametrize("lr", ["0", "-1", "-1e-4", "nan", "inf"])
def test_learning_rate_must_be_positive(lr, data, tmp_path, capsys):
    err = one_line_error(
        capsys,
        [
            "train",
            "--data",
            str(data),
            "--out",
            str(tmp_path / "r"),
            "--no-progress",
            "--set",
            f"optim.lr={lr}",
        ],
        "train",
    )
    # NaN and infinity are refused for every float key (no recipe key means them), the rest by the key's rule
    rule = (
        "must be a finite number (not NaN or infinity)"
        if lr in ("nan", "inf")
        else "must be a positive finite number"
    )
    assert "optim.lr=" in err and rule in err and "Invalid learning rate" not in err
    assert not (tmp_path / "r").exists()


def test_eval_sims_says_what_a_file_is_when_it_is_no_npy_matrix(tmp_path, capsys):
    text = tmp_path / "sims.txt"
    text.write_text("0.1 0.2\n0.3 0.4\n")
    err = one_line_error(capsys, ["eval-sims", str(text)], "eval-sims")
    assert str(text) in err and "not a .npy matrix" in err and "text file" in err and "pickled" not in err
    empty = tmp_path / "empty.npy"
    empty.write_bytes(b"")
    assert "it is empty" in one_line_error(capsys, ["eval-sims", str(empty)], "eval-sims")
    objects = tmp_path / "objects.npy"
    np.save(objects, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    assert "Python objects" in one_line_error(capsys, ["eval-sims", str(objects)], "eval-sims")


def test_nan_test_features_name_the_file_and_row(run, data, tmp_path, capsys):
    bad = shutil.copytree(data, tmp_path / "nan")
    feats = np.load(bad / "test_ims.npy")
    feats[7, 2, 3] = np.nan
    np.save(bad / "test_ims.npy", feats)
    err = one_line_error(capsys, ["eval", str(run), "--data", str(bad), "--device", "cpu"], "eval")
    assert str(bad / "test_ims.npy") in err and "row 7" in err and "NaN" in err
    err = one_line_error(
        capsys, ["index", str(run), f"{bad}:test", "--out", str(tmp_path / "i"), "--quiet"], "index"
    )
    assert str(bad / "test_ims.npy") in err and "row 7" in err


@pytest.mark.parametrize("n", ["0", "-3"])
def test_synthetic_needs_training_images(n, tmp_path, capsys):
    err = one_line_error(capsys, ["data", "synthetic", "--out", str(tmp_path / "s"), "--n-train", n], "data")
    assert "--n-train must be at least 1" in err and "stack" not in err
    assert not (tmp_path / "s").exists()


# ----------------------------------------------------------------------------------------- 2. --json


def test_json_prints_on_stdout_and_json_out_writes_a_file(run, data, tmp_path, capsys):
    capsys.readouterr()
    assert main(["eval", str(run), "--device", "cpu", "--json"]) == 0
    got = capsys.readouterr()
    metrics = json.loads(got.out)  # stdout is the JSON alone; the table went to stderr
    assert 0 <= metrics["rsum"] <= 600 and "rsum" in got.err
    assert main(["eval", str(run), "--device", "cpu", "--json-out", str(tmp_path / "m.json")]) == 0
    assert json.loads((tmp_path / "m.json").read_text()) == metrics
    assert "i2t R@1" in capsys.readouterr().out
    # the old form keeps working, with a note
    assert main(["eval", str(run), "--device", "cpu", "--json", str(tmp_path / "old.json")]) == 0
    assert "deprecated" in capsys.readouterr().err
    assert json.loads((tmp_path / "old.json").read_text()) == metrics
    sims = tmp_path / "s.npy"
    np.save(sims, np.random.default_rng(0).normal(size=(4, 20)).astype(np.float32))
    assert main(["eval-sims", str(sims), "--json"]) == 0
    assert set(json.loads(capsys.readouterr().out)) >= {"rsum", "i2t_r1", "t2i_medr"}
    # `--json FILE.npy` is an input given in the wrong place, never a file to overwrite
    err = one_line_error(capsys, ["eval-sims", "--json", str(sims), str(sims)], "eval-sims")
    assert "--json-out" in err and np.load(sims).shape == (4, 20)


def test_help_documents_both_json_flags(capsys):
    for verb in (["eval"], ["eval-sims"], ["search"], ["data", "relevance-share"], ["pooling"]):
        with pytest.raises(SystemExit):
            main([*verb, "--help"])
        text = capsys.readouterr().out
        assert "--json" in text and "--json-out FILE" in text and "stdout" in text, verb


# ----------------------------------------------------------------------------- 3. index from stored features


def test_split_without_pictures_is_indexed_from_its_features(run, data, tmp_path, capsys):
    pytest.importorskip("faiss")
    assert not (data / "test_images.txt").exists()
    out = tmp_path / "idx"
    assert main(["index", str(run), f"{data}:test", "--out", str(out), "--quiet", "--device", "cpu"]) == 0
    meta = json.loads((out / "index.json").read_text())
    assert meta["counts"] == {"pictures": 10, "captions": 50}
    assert meta["segments"][0]["embedded_from"]["mode"] == "features"
    capsys.readouterr()
    caption = (data / "test_caps.txt").read_text().splitlines()[15]  # image row 3 (5 captions per image)
    assert main(["search", str(out), caption, "-k", "10", "--json", "--device", "cpu"]) == 0
    hits = json.loads(capsys.readouterr().out)
    assert sorted(h["path"] for h in hits) == [f"test:{i}" for i in range(10)]  # rows of the split, each once
    assert (
        main(
            [
                "search",
                str(out),
                caption,
                "-k",
                "3",
                "--json-out",
                str(tmp_path / "h.json"),
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    assert [h["path"] for h in json.loads((tmp_path / "h.json").read_text())] == [h["path"] for h in hits[:3]]
    # --pixels has nothing to read; a picture query is refused before the picture is opened
    err = one_line_error(
        capsys, ["index", str(run), f"{data}:test", "--out", str(tmp_path / "p"), "--pixels"], "index"
    )
    assert "test_images.txt: missing" in err and "--pixels" in err
    err = one_line_error(
        capsys, ["search", str(out), "--image", str(tmp_path / "absent.png"), "--device", "cpu"], "search"
    )
    assert (
        "cannot answer picture queries" in err and "precomputed features" in err and "absent.png" not in err
    )


# ------------------------------------------------------------------------------------------- 4. start-up


def test_cli_builds_its_parser_and_runs_model_free_verbs_without_torch(data, tmp_path):
    np.save(tmp_path / "s.npy", np.eye(6, 30, dtype=np.float32))
    script = f"""
import contextlib, io, sys
import vsekit.cli
vsekit.cli.build_parser()
with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()):
    vsekit.cli.main(["--help"])
assert "torch" not in sys.modules, "parser / --help"
for argv in (["eval-sims", {str(tmp_path / "s.npy")!r}], ["recipes"], ["recipes", "vsepp"], ["data", "check", {str(data)!r}],
             ["data", "synthetic", "--out", {str(tmp_path / "syn")!r}, "--n-train", "3"]):
    with contextlib.redirect_stdout(io.StringIO()):
        assert vsekit.cli.main(argv) == 0, argv
    assert "torch" not in sys.modules, argv
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_one_pass_ranks_equal_the_shard_ranks_for_every_dtype():
    rng = np.random.default_rng(5)
    for dtype in (np.float16, np.float32, np.float64):
        for sims in (rng.normal(size=(30, 90)), rng.integers(0, 3, size=(30, 90))):  # the second: many ties
            s = sims.astype(dtype)
            c2i = rng.permutation(np.arange(90) // 3)
            for block in (1, 64, 1 << 20):  # one row per block, a few, all at once
                i2t, t2i = ranks_both(s, c2i, block_bytes=block)
                np.testing.assert_array_equal(i2t, ranks_i2t(s, c2i))
                np.testing.assert_array_equal(t2i, ranks_t2i(s, c2i))


def test_nan_is_found_in_any_block():
    from vsekit.metrics import MetricsInputError, evaluate_sims

    sims = np.random.default_rng(1).normal(size=(40, 200)).astype(np.float32)
    sims[33, 170] = np.nan
    with pytest.raises(MetricsInputError, match=r"first at \(image 33, caption 170\)"):
        ranks_both(sims, np.arange(200) // 5, block_bytes=200 * 4 * 3)
    with pytest.raises(MetricsInputError, match=r"image 33, caption 170"):
        evaluate_sims(sims, np.arange(200) // 5)


def test_bench_eval_sims_times_both_processes_and_checks_the_numbers(capsys):
    from vsekit_lab.bench.eval import bench_eval_sims_process

    row = bench_eval_sims_process(n_images=30, repeats=1)
    assert row["eval_sims_s"] > 0 and row["minimal_s"] > 0
    assert row["ratio"] == pytest.approx(row["eval_sims_s"] / row["minimal_s"])
    # both processes turn the same integer ranks into percentages with the same float64 formula: exactly equal
    assert row["max_abs_diff"] == 0.0 and 0 < row["rsum"] < 600
    assert main(["bench", "eval-sims", "--images", "20", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 20 x 100 |" in out and "`vse bench eval-sims --images 20 --repeats 1`" in out


# ------------------------------------------------------------------------------ 5. dedicated input errors


def test_a_bare_value_or_runtime_error_is_a_bug_not_bad_input(tmp_path, monkeypatch, capsys):
    import vsekit.commands.evaluate as ev

    np.save(tmp_path / "s.npy", np.eye(4, 20, dtype=np.float32))
    for exc in (ValueError("internal slip"), RuntimeError("mat1 and mat2 shapes cannot be multiplied")):

        def buggy(_paths, exc=exc):
            raise exc

        monkeypatch.setattr(ev, "load_sims", buggy)
        assert main(["eval-sims", str(tmp_path / "s.npy")]) == 1
        err = capsys.readouterr().err
        assert "internal error" in err and "this is a bug" in err and type(exc).__name__ in err


def test_every_input_error_type_is_a_vse_input_error_and_still_a_value_error():
    from vsekit.checks import EXPECTED_ERRORS
    from vsekit.config import ConfigError
    from vsekit.data.precomp import DataFormatError
    from vsekit.errors import MissingPackageError, SetupError, VseInputError
    from vsekit.interop.checkpoint_reader import ReleasedCheckpointError
    from vsekit.metrics import MetricsInputError
    from vsekit.runs import CheckpointError
    from vsekit.search.index import IndexFormatError

    assert ValueError not in EXPECTED_ERRORS and RuntimeError not in EXPECTED_ERRORS
    for cls in (
        ConfigError,
        DataFormatError,
        MetricsInputError,
        CheckpointError,
        ReleasedCheckpointError,
        IndexFormatError,
        SetupError,
        MissingPackageError,
    ):
        assert issubclass(cls, VseInputError) and issubclass(cls, ValueError), cls
    assert issubclass(SetupError, RuntimeError) and issubclass(MissingPackageError, ImportError)
