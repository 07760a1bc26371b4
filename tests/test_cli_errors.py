"""Bad input is one line naming its cause (exit 2), never an internal error: ensembles of runs trained on other
datasets, zero/negative numeric options (refused while the command line is parsed), recipe values out of
range, a NaN loss before any checkpoint, `vse eval-sims`' NaN and empty matrices, `--resume` on another
vocabulary, and a closed stdout (`vse recipes NAME | head -1`)."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe
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
def data_a(tmp_path_factory) -> Path:
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("a"), n_train=40, n_dev=10, n_test=10, regions=4, dim=8
    )


@pytest.fixture(scope="module")
def data_b(tmp_path_factory) -> Path:
    """Another dataset: other pictures, a test split of another size."""
    return make_synthetic_precomp(
        tmp_path_factory.mktemp("b"), n_train=40, n_dev=10, n_test=15, regions=4, dim=8, seed=3
    )


def _train(data: Path, out: Path, extra: list[str] = ()) -> Path:
    Trainer(load_recipe("vsepp", [*TINY, *extra]), data, out, progress=False, log=lambda *_: None).fit()
    return out


@pytest.fixture(scope="module")
def run_a(data_a, tmp_path_factory) -> Path:
    return _train(data_a, tmp_path_factory.mktemp("runs") / "a")


@pytest.fixture(scope="module")
def run_b(data_b, tmp_path_factory) -> Path:
    return _train(data_b, tmp_path_factory.mktemp("runs") / "b")


def one_line_error(capsys, argv: list[str], verb: str) -> str:
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    lines = [x for x in err.splitlines() if x.startswith("vse ")]
    assert len(lines) == 1 and lines[0].startswith(f"vse {verb}: error: "), err
    assert "Traceback" not in err and "internal error" not in err
    return lines[0]


def _no_encoding(monkeypatch) -> None:
    """Fail the test if a split is encoded: the check must come before any work."""
    import vsekit.evaluation as evaluation

    def refuse(*_a, **_k):
        raise AssertionError("a model was run before the inputs were checked")

    monkeypatch.setattr(evaluation, "evaluate_model", refuse)


# ------------------------------------------------------------------------------------- 1. ensembles


def test_ensemble_of_runs_trained_on_other_datasets_is_refused_before_any_work(
    run_a, run_b, data_a, monkeypatch, capsys
):
    _no_encoding(monkeypatch)
    err = one_line_error(capsys, ["eval", str(run_a), str(run_b), "--device", "cpu"], "eval")
    assert str(run_b) in err and str(data_a.resolve()) in err and "--data" in err
    monkeypatch.undo()
    capsys.readouterr()
    assert (
        main(["eval", str(run_a), str(run_b), "--data", str(data_a), "--device", "cpu"]) == 0
    )  # one split chosen
    assert "ensemble (mean similarity)" in capsys.readouterr().out


def test_ensemble_member_that_does_not_fit_the_split_is_named_before_any_work(
    run_a, data_a, tmp_path, monkeypatch, capsys
):
    wide = make_synthetic_precomp(tmp_path / "wide", n_train=40, n_dev=10, n_test=10, regions=4, dim=12)
    run_wide = _train(wide, tmp_path / "run_wide")
    _no_encoding(monkeypatch)
    err = one_line_error(
        capsys, ["eval", str(run_a), str(run_wide), "--data", str(data_a), "--device", "cpu"], "eval"
    )
    assert str(data_a / "test_ims.npy") in err and str(run_wide) in err and "expects 12-wide" in err


# ------------------------------------------------------------------------ 2. numeric options at parse time


@pytest.mark.parametrize(
    "argv, option, needle",
    [
        (["eval", "RUN", "--batch-size", "0"], "--batch-size", "must be at least 1, got 0"),
        (["eval", "RUN", "--batch-size", "-4"], "--batch-size", "must be at least 1, got -4"),
        (["eval", "RUN", "--cs-k", "100", "0"], "--cs-k", "must be at least 1, got 0"),
        (["eval-sims", "S.npy", "--captions-per-image", "0"], "--captions-per-image", "must be at least 1"),
        (["eval-sims", "S.npy", "--cs-k", "-1"], "--cs-k", "must be at least 1"),
        (["train", "--data", "D", "--out", "OUT", "--epochs", "0"], "--epochs", "must be at least 1"),
        (["train", "--data", "D", "--out", "OUT", "--batch-size", "1"], "--batch-size", "must be at least 2"),
        (["train", "--data", "D", "--out", "OUT", "--batch-size", "0"], "--batch-size", "must be at least 2"),
        (["data", "show", "D", "--out", "OUT", "--n", "0"], "--n", "must be at least 1"),
        (["data", "show", "D", "--out", "OUT", "--seed", "-1"], "--seed", "must be at least 0"),
        (["data", "check", "D", "--captions-per-image", "0"], "--captions-per-image", "must be at least 1"),
        (["data", "synthetic", "--out", "OUT", "--seed", "-2"], "--seed", "must be at least 0"),
        (["data", "relevance-share", "D", "--share", "0"], "--share", "must lie in (0, 1]"),
        (["data", "relevance-share", "D", "--share", "1.5"], "--share", "must lie in (0, 1]"),
        (["data", "relevance-share", "D", "--theta", "nan"], "--theta", "must be a finite number"),
        (["data", "relevance-share", "D", "--batch", "0"], "--batch", "must be at least 2"),
        (["data", "relevance-share", "D", "--max-pairs", "0"], "--max-pairs", "must be at least 1"),
        (
            ["data", "moving-shapes", "--out", "OUT", "--clips", "10", "0", "2"],
            "--clips",
            "must be at least 1",
        ),
        (["data", "moving-shapes", "--out", "OUT", "--frames", "0", "4"], "--frames", "must be at least 1"),
        (["data", "openclipart", "--out", "OUT", "--workers", "0"], "--workers", "must be at least 1"),
        (["data", "openclipart", "--out", "OUT", "--limit", "0"], "--limit", "must be at least 1"),
        (
            [
                "data",
                "convert-video",
                "--features",
                "F",
                "--captions",
                "C",
                "--out",
                "OUT",
                "--lmdb-dim",
                "0",
            ],
            "--lmdb-dim",
            "must be at least 1",
        ),
    ],
)
def test_zero_or_negative_numeric_options_are_refused_while_parsing(
    argv, option, needle, run_a, data_a, tmp_path, monkeypatch, capsys
):
    subs = {
        "RUN": str(run_a),
        "D": str(data_a),
        "OUT": str(tmp_path / "out"),
        "S.npy": str(tmp_path / "s.npy"),
    }
    argv = [subs.get(a, a) for a in argv]
    from vsekit.commands import data, evaluate, train

    for module in (data, evaluate, train):  # parse-time: no verb starts
        for name in dir(module):
            if name.startswith("run_"):
                monkeypatch.setattr(module, name, lambda *_a, **_k: pytest.fail("the verb ran"))
    err = one_line_error(capsys, argv, argv[0])
    assert f"{option} {needle}" in err
    assert not (tmp_path / "out").exists()


def test_every_numeric_option_of_every_verb_is_range_checked():
    """One checker (`vsekit.commands.argtypes`) for every numeric option of every `vse` verb, the lab's
    (`vse bench …`, `vse demo`, `vse experiment …`) included: no option that takes a number is stored unchecked."""
    import argparse

    from vsekit.cli import build_parser

    def numeric(parser, path):
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for name, sub in action.choices.items():
                    yield from numeric(sub, [*path, name])
            elif action.type in (int, float):
                yield " ".join(path), action

    found = list(numeric(build_parser(), ["vse"]))
    assert len([c for c, _ in found if c.startswith("vse bench")]) >= 84
    unchecked = [
        f"{c} {a.option_strings[0]}" for c, a in found if type(a).__module__ != "vsekit.commands.argtypes"
    ]
    assert unchecked == []


@pytest.mark.parametrize(
    "argv, option, needle",
    [
        (["bench", "pool", "--repeats", "0"], "--repeats", "must be at least 1, got 0"),
        (
            ["bench", "train-step", "--caption-buckets", "1", "0"],
            "--caption-buckets",
            "must be at least 1, got 0",
        ),
        (["bench", "search", "--hnsw-m", "1"], "--hnsw-m", "must be 0 (no HNSW rows) or at least 2, got 1"),
        (["bench", "search", "--spread", "nan"], "--spread", "must be a finite number"),
        (["bench", "serve", "IDX", "--max-seconds", "0"], "--max-seconds", "must be a finite number above 0"),
        (["search", "IDX", "a query", "--nprobe", "0"], "--nprobe", "must be at least 1, got 0"),
        (["pooling", "RUN", "--text-len", "0"], "--text-len", "must be at least 1, got 0"),
        (["experiment", "gpo-synthetic", "--lr", "-1"], "--lr", "must be a finite number above 0"),
    ],
)
def test_lab_and_search_numeric_options_are_refused_while_parsing(argv, option, needle, capsys):
    err = one_line_error(capsys, argv, argv[0])
    assert f"{option} {needle}" in err


def test_valid_numeric_options_still_parse(tmp_path, capsys):
    sims = tmp_path / "s.npy"
    np.save(sims, np.eye(4, 20, dtype=np.float32))
    assert main(["eval-sims", str(sims), "--cs-k", "1", "5", "--captions-per-image", "5"]) == 0
    assert "rsum" in capsys.readouterr().out


# ---------------------------------------------------------------------------- 3. recipe values in range


@pytest.mark.parametrize(
    "override, key",
    [
        ("loss.margin=inf", "loss.margin"),
        ("loss.margin=.inf", "loss.margin"),
        ("loss.margin=nan", "loss.margin"),
        ("loss.margin=-0.1", "loss.margin"),
        ("loss.ladder_margins=[0.2, inf]", "loss.ladder_margins[1]"),
        ("optim.lr_decay=0", "optim.lr_decay"),
        ("optim.weight_decay=inf", "optim.weight_decay"),
        ("optim.grad_clip=-1", "optim.grad_clip"),
        ("optim.lr_decay_epochs=[-1]", "optim.lr_decay_epochs[0]"),
        ("train.eval_batch_size=0", "train.eval_batch_size"),
        ("train.log_every=-1", "train.log_every"),
        ("data.region_keep_prob=0", "data.region_keep_prob"),
        ("data.text_augment_prob=1.5", "data.text_augment_prob"),
        ("data.captions_per_image=0", "data.captions_per_image"),
        ("model.text.word_dim=0", "model.text.word_dim"),
        ("model.image.image_size=0", "model.image.image_size"),
        ("loss.warmup_epochs=-1", "loss.warmup_epochs"),
        ("train.seed=99999999999999999999", "train.seed"),
    ],
)
def test_recipe_values_out_of_range_are_refused_naming_the_key(override, key, data_a, tmp_path, capsys):
    with pytest.raises(ConfigError, match=key.replace("[", r"\[").replace("]", r"\]")):
        load_recipe("vsepp", [override])
    out = tmp_path / "r"
    err = one_line_error(
        capsys,
        [
            "train",
            "--data",
            str(data_a),
            "--out",
            str(out),
            "--no-progress",
            "--device",
            "cpu",
            "--set",
            override,
        ],
        "train",
    )
    assert f"{key}=" in err and "must be" in err
    assert not out.exists()


def test_a_nan_loss_names_a_checkpoint_only_when_one_was_saved(data_a, tmp_path):
    def nan_step(*_a, **_k):
        return {"loss": torch.tensor(float("nan"))}

    fresh = tmp_path / "fresh"
    trainer = Trainer(load_recipe("vsepp", TINY), data_a, fresh, progress=False, log=lambda *_: None)
    trainer.step_fn = nan_step
    with pytest.raises(FloatingPointError) as e:
        trainer.fit()
    assert "last.safetensors" not in str(e.value) and "no checkpoint was saved" in str(e.value)
    assert not (fresh / "last.safetensors").exists()
    # after an epoch that was saved, the message names that checkpoint, which exists
    run = _train(data_a, tmp_path / "saved")
    trainer = Trainer(
        load_recipe("vsepp", [*TINY[:-1], "train.epochs=2"]),
        data_a,
        run,
        resume=True,
        progress=False,
        log=lambda *_: None,
    )
    trainer.step_fn = nan_step
    with pytest.raises(FloatingPointError, match="last good checkpoint: .*last.safetensors"):
        trainer.fit()
    assert (run / "last.safetensors").is_file()


# --------------------------------------------------------------------------- 4. messages name their cause


def test_eval_sims_nan_names_the_file(tmp_path, capsys):
    good, bad = tmp_path / "good.npy", tmp_path / "bad.npy"
    sims = np.random.default_rng(0).normal(size=(4, 20)).astype(np.float32)
    np.save(good, sims)
    sims[2, 7] = np.nan
    np.save(bad, sims)
    err = one_line_error(capsys, ["eval-sims", str(bad)], "eval-sims")
    assert f"{bad}: " in err and "NaN/inf" in err and "(image 2, caption 7)" in err
    err = one_line_error(capsys, ["eval-sims", str(good), str(bad)], "eval-sims")  # an ensemble: the culprit
    assert f"{bad}: " in err and str(good) not in err


def test_empty_matrix_is_named_before_the_cap2img_file(tmp_path, capsys):
    empty, c2i = tmp_path / "empty.npy", tmp_path / "test_cap2img.txt"
    np.save(empty, np.zeros((0, 0), np.float32))
    c2i.write_text("".join(f"{i // 5}\n" for i in range(25)))
    for extra in ([], ["--cap2img", str(c2i)]):
        err = one_line_error(capsys, ["eval-sims", str(empty), *extra], "eval-sims")
        assert str(empty) in err and "empty (0 x 0)" in err and "test_cap2img.txt" not in err


def test_resume_on_another_vocabulary_says_so_before_loading_weights(
    run_a, data_a, tmp_path, monkeypatch, capsys
):
    other = shutil.copytree(data_a, tmp_path / "other")
    caps = (other / "train_caps.txt").read_text().splitlines()
    (other / "train_caps.txt").write_text("".join(c + " zebra xylophone\n" for c in caps))  # 2 new words
    run = shutil.copytree(run_a, tmp_path / "run")
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    import vsekit.training.checkpointing as checkpointing

    monkeypatch.setattr(checkpointing, "load_weights", lambda *_a, **_k: pytest.fail("weights were loaded"))
    n_words = len(json.loads((run / "vocab.json").read_text())["words"])
    err = one_line_error(
        capsys,
        ["train", "--resume", str(run), "--data", str(other), "--epochs", "2", "--no-progress"],
        "train",
    )
    assert (
        f"this run was trained on another vocabulary ({n_words} words) than {other} ({n_words + 2} words"
        in err
    )
    assert "text_encoder.embed.weight" not in err and str(data_a.resolve()) in err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before  # nothing lost


# ---------------------------------------------------------------------------------------- 5. SIGPIPE


def test_closed_stdout_ends_quietly(monkeypatch, capsys):
    class ClosedPipe(io.StringIO):
        def write(self, _text):
            raise BrokenPipeError(32, "Broken pipe")

        def flush(self):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedPipe())
    assert main(["recipes", "vse_infty"]) == 1
    assert capsys.readouterr().err == ""


def test_recipes_into_a_closed_pipe_prints_no_error():
    """`vse recipes vse_infty | head -1`: the reader is gone before vse writes."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "vsekit.cli", "recipes", "vse_infty"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    proc.stdout.close()  # long before the interpreter has started and written anything
    err = proc.stderr.read().decode()
    proc.wait(timeout=60)
    assert err == "" and proc.returncode == 1


def test_eval_of_cocos_test_split_warns_that_papers_use_testall(run_a, data_a, tmp_path, capsys):
    """SCAN's COCO layout: `test` is the first 1K fold of `testall`; scoring it alone says so and names testall."""
    coco = tmp_path / "coco_precomp"
    shutil.copytree(data_a, coco)
    shutil.copy(coco / "test_caps.txt", coco / "testall_caps.txt")  # what marks the COCO layout
    assert main(["eval", str(run_a), "--data", str(coco), "--split", "test", "--device", "cpu"]) == 0
    err = capsys.readouterr().err
    assert "first 1K fold" in err and "--split testall --fold5" in err
    assert main(["eval", str(run_a), "--data", str(data_a), "--split", "test", "--device", "cpu"]) == 0
    assert "testall" not in capsys.readouterr().err  # a dataset without testall: nothing to say
