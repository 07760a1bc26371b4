"""CLI and data safety: float literals in recipes, `--resume` with `--epochs` (and the flags it
refuses), `--epochs 0`, `--out` at a file / a non-run folder, `--overwrite` clearing the old run, Ctrl-C
before the first checkpoint, `vse data synthetic` over a dataset, and the `vse index` writer lock."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import vsekit.training.trainer as trainer_mod
from vsekit.cli import main
from vsekit.config import ConfigError, load_recipe
from vsekit.search.index import IndexFormatError, writer_lock
from vsekit.training.trainer import Trainer

TINY = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "train.batch_size=16",
    "train.log_every=1",
    "optim.lr_decay_epochs=[1]",
]
TINY_ARGS = ["--recipe", "vsepp", "--no-progress", *[x for s in TINY for x in ("--set", s)]]


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny_run(tiny_data, tmp_path_factory):
    """A finished 1-epoch run (copy it before changing it) and the lines its trainer logged. Trained with one
    thread, as the tests that compare their runs with it (a module fixture is set up before `_one_thread`)."""
    run = tmp_path_factory.mktemp("runs") / "one"
    logs: list[str] = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        Trainer(
            load_recipe("vsepp", TINY + ["train.epochs=1"]), tiny_data, run, progress=False, log=logs.append
        ).fit()
    finally:
        torch.set_num_threads(threads)
    return run, logs


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    return dest


def _same_weights(a: Path, b: Path) -> None:
    # Bit-identity by construction: both runs are the same sequence of ops on tensors of the same shapes, with
    # the same thread count (one), seeds and restored optimizer/RNG state, in processes that pick the same CPU
    # kernels (same machine, same ATEN_CPU_CAPABILITY): CPU kernels are deterministic for a fixed shape and
    # thread count, so no rounding can differ. (Runs with other batch shapes or thread counts would not be.)
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def _records(run: Path, kind: str) -> list[dict]:
    return [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if r["kind"] == kind]


# ------------------------------------------------------------------------------------ 1. float literals


@pytest.mark.parametrize(
    "literal,value",
    [("2e-4", 2e-4), ("1E-3", 1e-3), ("5", 5.0), (".5", 0.5), ("1e3", 1000.0), ("3.0e-2", 0.03)],
)
def test_float_fields_take_every_float_literal(literal, value, tmp_path):
    assert load_recipe("vsepp", [f"optim.lr={literal}"]).optim.lr == value
    assert load_recipe("vsepp", [f"loss.ladder_thresholds=[{literal}]"]).loss.ladder_thresholds == [value]
    assert (
        load_recipe("vsepp", [f"loss.ladder_percentile={literal}"]).loss.ladder_percentile == value
    )  # float | None
    user = tmp_path / "r.yaml"
    user.write_text(f"base: vsepp\noptim:\n  lr: {literal}\n")
    assert load_recipe(str(user)).optim.lr == value


@pytest.mark.parametrize(
    "override,needle",
    [
        ("train.epochs=nan", "expected an integer"),
        ("train.epochs=.nan", "expected an integer"),
        ("train.epochs=1e3", "expected an integer"),
        ("train.batch_size=16.0", "expected an integer"),
        ("optim.lr=abc", "expected a number"),
        ("optim.lr=true", "expected a number"),
        ("optim.lr=[1]", "expected a number"),
    ],
)
def test_ints_stay_strict_and_garbage_is_not_a_float(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_recipe("vsepp", [override])


def test_docs_example_lr_override_trains(tiny_data, tmp_path):
    assert (
        main(
            [
                "train",
                "--data",
                str(tiny_data),
                "--out",
                str(tmp_path / "r"),
                "--epochs",
                "1",
                *TINY_ARGS,
                "--set",
                "optim.lr=2e-4",
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "r" / "config.json").read_text())["recipe"]["optim"]["lr"] == 2e-4


# ------------------------------------------------------------------------------- 2. --resume --epochs


def test_resume_with_epochs_extends_the_run_like_a_longer_run(tiny_data, tiny_run, tmp_path, capsys):
    ref = tmp_path / "two"
    Trainer(
        load_recipe("vsepp", TINY + ["train.epochs=2"]), tiny_data, ref, progress=False, log=lambda *_: None
    ).fit()
    run = _copy(tiny_run[0], tmp_path / "extended")
    assert main(["train", "--resume", str(run), "--epochs", "2", "--no-progress"]) == 0
    _same_weights(ref / "last.safetensors", run / "last.safetensors")  # same lr schedule, same batches
    assert [r["rsum"] for r in _records(run, "val")] == [r["rsum"] for r in _records(ref, "val")]
    assert [r["epoch"] for r in _records(run, "val")] == [1, 2]
    assert (
        json.loads((run / "config.json").read_text())["recipe"]["train"]["epochs"] == 2
    )  # a later --resume keeps it
    capsys.readouterr()
    assert main(["train", "--resume", str(run), "--no-progress"]) == 0
    assert "all 2 epochs are trained" in capsys.readouterr().out
    before = _snapshot(run)
    assert main(["train", "--resume", str(run), "--epochs", "1"]) == 2
    err = capsys.readouterr().err
    assert (
        "already trained 2 epoch(s)" in err
        and "--epochs 2 or more" in err
        and len(err.strip().splitlines()) == 1
    )
    assert _snapshot(run) == before


def test_resume_takes_a_new_lr_schedule_and_records_it(tiny_data, tiny_run, tmp_path, capsys):
    # the tiny runs decay the lr after epoch 1; told otherwise on resume, epoch 2 trains at the base lr, exactly as
    # a run started with that schedule does
    ref = tmp_path / "no_decay"
    recipe = load_recipe("vsepp", TINY + ["train.epochs=2", "optim.lr_decay_epochs=[]"])
    Trainer(recipe, tiny_data, ref, progress=False, log=lambda *_: None).fit()
    run = _copy(tiny_run[0], tmp_path / "extended")
    assert (
        main(
            [
                "train",
                "--resume",
                str(run),
                "--epochs",
                "2",
                "--set",
                "optim.lr_decay_epochs=[]",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "optim.lr_decay_epochs [1] -> []" in capsys.readouterr().out
    _same_weights(ref / "last.safetensors", run / "last.safetensors")
    lrs = {r["lr"] for r in _records(run, "train") if r["epoch"] == 2}
    assert lrs == {recipe.optim.lr}
    saved = json.loads((run / "config.json").read_text())["recipe"]
    assert saved["optim"]["lr_decay_epochs"] == [] and saved["train"]["epochs"] == 2


@pytest.mark.parametrize("item", ["optim.lr=1", "model.embed_dim=64", "train.batch_size=8"])
def test_resume_refuses_recipe_changes_other_than_the_schedule(tiny_run, item, capsys):
    before = _snapshot(tiny_run[0])
    assert main(["train", "--resume", str(tiny_run[0]), "--epochs", "3", "--set", item]) == 2
    err = capsys.readouterr().err.strip()
    assert f"--set {item}: a resumed run keeps its recipe" in err and "optim.lr_decay_epochs" in err
    assert len(err.splitlines()) == 1
    assert _snapshot(tiny_run[0]) == before


@pytest.mark.parametrize(
    "extra,flag",
    [
        (["--recipe", "vsepp"], "--recipe"),
        (["--out", "elsewhere"], "--out"),
        (["--batch-size", "8"], "--batch-size"),
        (["--seed", "0"], "--seed"),
        (["--overwrite"], "--overwrite"),
    ],
)
def test_resume_refuses_flags_it_would_ignore(tiny_run, extra, flag, capsys):
    before = _snapshot(tiny_run[0])
    assert main(["train", "--resume", str(tiny_run[0]), "--epochs", "3", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert f"{flag} cannot be combined with --resume" in err and len(err.splitlines()) == 1
    assert _snapshot(tiny_run[0]) == before


# ---------------------------------------------------------------------------------------- 3. epochs < 1


@pytest.mark.parametrize("epochs", ["0", "-1"])
def test_epochs_below_one_is_refused(tiny_data, tmp_path, epochs, capsys):
    with pytest.raises(ConfigError, match="train.epochs"):
        load_recipe("vsepp", [f"train.epochs={epochs}"])
    out = tmp_path / "r"
    assert main(["train", "--data", str(tiny_data), "--out", str(out), "--epochs", epochs, *TINY_ARGS]) == 2
    assert "--epochs" in capsys.readouterr().err
    assert not out.exists()


# ----------------------------------------------------------------------------------------------- 4. --out


def test_out_at_an_existing_file_is_a_clear_error(tiny_data, tmp_path, capsys):
    target = tmp_path / "notes.txt"
    target.write_text("mine\n")
    assert main(["train", "--data", str(tiny_data), "--out", str(target), "--epochs", "1", *TINY_ARGS]) == 2
    err = capsys.readouterr().err
    assert "notes.txt: exists and is not a folder" in err and "internal error" not in err
    assert target.read_text() == "mine\n"


@pytest.mark.parametrize("overwrite", [[], ["--overwrite"]])
def test_out_at_a_folder_that_is_not_a_run_is_refused(tiny_data, tmp_path, overwrite, capsys):
    data = Path(shutil.copytree(tiny_data, tmp_path / "data"))
    before = _snapshot(data)
    assert (
        main(["train", "--data", str(data), "--out", str(data), "--epochs", "1", *TINY_ARGS, *overwrite]) == 2
    )
    assert "is not a vsekit run" in capsys.readouterr().err
    assert _snapshot(data) == before  # the dataset folder got nothing written into it
    hf = tmp_path / "hf_model"  # a config.json alone does not make a folder a run
    hf.mkdir()
    (hf / "config.json").write_text('{"model_type": "bert"}')
    assert (
        main(["train", "--data", str(data), "--out", str(hf), "--epochs", "1", *TINY_ARGS, *overwrite]) == 2
    )
    assert (hf / "config.json").read_text() == '{"model_type": "bert"}'


# ----------------------------------------------------------------------------------------- 6. --overwrite


def test_overwrite_clears_the_previous_runs_files_and_keeps_foreign_ones(
    tiny_data, tiny_run, tmp_path, capsys
):
    run = _copy(tiny_run[0], tmp_path / "run")
    (run / "tb" / "events.out.tfevents.old").write_bytes(b"old events")
    (run / "ckpt" / "last-000099.safetensors").write_bytes(b"stale")
    (run / "notes.txt").write_text("mine\n")
    assert (
        main(
            ["train", "--data", str(tiny_data), "--out", str(run), "--epochs", "1", *TINY_ARGS, "--overwrite"]
        )
        == 0
    )
    assert not (run / "tb" / "events.out.tfevents.old").exists()
    assert not (run / "ckpt" / "last-000099.safetensors").exists()
    assert (run / "notes.txt").read_text() == "mine\n"
    assert "kept 1 file(s) vsekit did not write: notes.txt" in capsys.readouterr().out
    assert [r["epoch"] for r in _records(run, "val")] == [1]  # one run's lines, not two


# ------------------------------------------------------------------------------------------ 7. Ctrl-C


def test_ctrl_c_before_the_run_is_set_up_leaves_nothing_and_says_how_to_restart(
    tiny_data, tmp_path, monkeypatch, capsys
):
    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "create_loss", interrupted)  # Ctrl-C while the model is being built
    out = tmp_path / "run"
    assert main(["train", "--data", str(tiny_data), "--out", str(out), "--epochs", "1", *TINY_ARGS]) == 130
    err = capsys.readouterr().err.strip()
    assert (
        len(err.splitlines()) == 1 and "nothing was saved; start again with: vse train --recipe vsepp" in err
    )
    assert f"--out {out}" in err and "--set 'optim.lr_decay_epochs=[1]'" in err  # quoted for the shell
    assert not out.exists()


def test_ctrl_c_with_overwrite_before_setup_keeps_the_old_run(
    tiny_data, tiny_run, tmp_path, monkeypatch, capsys
):
    run = _copy(tiny_run[0], tmp_path / "run")
    before = _snapshot(run)

    def interrupted(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(trainer_mod, "create_loss", interrupted)
    assert (
        main(
            ["train", "--data", str(tiny_data), "--out", str(run), "--epochs", "1", *TINY_ARGS, "--overwrite"]
        )
        == 130
    )
    err = capsys.readouterr().err
    assert "the run already there is untouched" in err and "--overwrite" in err
    assert _snapshot(run) == before


def test_ctrl_c_before_the_first_checkpoint_resumes_with_the_printed_command(
    tiny_data, tiny_run, tmp_path, monkeypatch, capsys
):
    def interrupted(self, *_a, **_k):
        raise KeyboardInterrupt

    out = tmp_path / "run"
    with monkeypatch.context() as m:
        m.setattr(Trainer, "fit", interrupted)
        assert (
            main(["train", "--data", str(tiny_data), "--out", str(out), "--epochs", "1", *TINY_ARGS]) == 130
        )
    err = capsys.readouterr().err
    assert f"continue with: vse train --resume {out} --no-progress" in err
    assert main(["train", "--resume", str(out), "--no-progress"]) == 0
    _same_weights(tiny_run[0] / "last.safetensors", out / "last.safetensors")


# ------------------------------------------------------------------------------------- 1-based epochs


def test_epochs_are_one_based_in_logs_metrics_and_best(tiny_run):
    run, logs = tiny_run
    assert {r["epoch"] for r in _records(run, "train")} == {1}
    assert [r["epoch"] for r in _records(run, "val")] == [1]
    assert json.loads((run / "best.json").read_text())["epoch"] == 1
    assert any(line.startswith("epoch 1 step 1 ") for line in logs) and not any(
        line.startswith("epoch 0") for line in logs
    )


def test_fit_reports_the_best_epoch_as_best_json_does(tiny_data, tmp_path, capsys):
    run = tmp_path / "two"
    result = Trainer(
        load_recipe("vsepp", TINY + ["train.epochs=2"]), tiny_data, run, progress=False, log=lambda *_: None
    ).fit()
    best = json.loads((run / "best.json").read_text())
    assert result["best_epoch"] == best["epoch"] in (1, 2)
    assert max(_records(run, "val"), key=lambda r: r["rsum"])["epoch"] == best["epoch"]


# ------------------------------------------------------------------------------ 5. vse data synthetic


def test_synthetic_refuses_to_overwrite_a_dataset_without_overwrite(tmp_path, capsys):
    out = tmp_path / "syn"
    assert main(["data", "synthetic", "--out", str(out), "--n-train", "20", "--variable-captions"]) == 0
    before = _snapshot(out)
    assert main(["data", "synthetic", "--out", str(out), "--n-train", "30", "--seed", "1"]) == 2
    assert "--overwrite" in capsys.readouterr().err
    assert _snapshot(out) == before
    (out / "notes.txt").write_text("mine\n")
    assert (
        main(["data", "synthetic", "--out", str(out), "--n-train", "30", "--seed", "1", "--overwrite"]) == 0
    )
    assert not (out / "train_cap2img.txt").exists()  # the old set's file would pair the new captions wrongly
    assert len((out / "train_caps.txt").read_text().splitlines()) == 150
    assert (out / "notes.txt").read_text() == "mine\n"
    assert main(["data", "check", str(out)]) == 0


# ------------------------------------------------------------------------------------- 8. index lock


def _dead_pid() -> int:
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    return int(proc.stdout)


def test_failed_index_leaves_no_folder_and_no_lock(tmp_path, capsys):
    out = tmp_path / "idx"
    assert main(["index", str(tmp_path / "no-run"), "pictures", "--out", str(out), "--quiet"]) == 2
    assert "not a vsekit run" in capsys.readouterr().err
    assert not out.exists()
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(RuntimeError):
        with writer_lock(existing):
            assert (existing / ".lock").read_text().strip() == str(os.getpid())
            raise RuntimeError("boom")
    assert existing.is_dir() and not any(existing.iterdir())


def test_lock_of_a_dead_writer_is_taken_over_and_a_live_one_is_named(tmp_path):
    out = tmp_path / "idx"
    out.mkdir()
    (out / ".lock").write_text(f"{_dead_pid()}\n")
    notes: list[str] = []
    with writer_lock(out, notes.append):
        pass
    assert any("stopped without finishing; taking it over" in n for n in notes)
    assert not (out / ".lock").exists()
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from vsekit.search.index import writer_lock\n"
            f"with writer_lock(__import__('pathlib').Path({str(out)!r})):\n"
            "    print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(
            IndexFormatError,
            match=rf"another `vse index` is writing to this index right now \(pid {holder.pid}\)",
        ):
            with writer_lock(out):
                pass
    finally:
        holder.communicate("")
    with writer_lock(out):  # released when its holder exits
        pass


def test_lock_without_fcntl_checks_the_recorded_pid(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "fcntl", None)  # `import fcntl` fails, as on Windows
    out = tmp_path / "idx"
    out.mkdir()
    (out / ".lock").write_text(f"{_dead_pid()}\n")
    notes: list[str] = []
    with writer_lock(out, notes.append):
        assert (out / ".lock").read_text().strip() == str(os.getpid())
    assert any("is not running any more; taking the lock over" in n for n in notes)
    assert not (out / ".lock").exists()
    (out / ".lock").write_text(f"{os.getpid()}\n")  # a live writer
    with pytest.raises(IndexFormatError, match=rf"\(pid {os.getpid()}\)"):
        with writer_lock(out):
            pass
    assert (out / ".lock").exists()  # not ours to remove
