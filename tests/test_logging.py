"""Logging conventions: library modules log through `logging` and never print; the CLI
configures logging once (`vse -q` warnings only, `vse -v` debug); `vse --version` without torch;
`vse train --report-to wandb` logs metrics.jsonl's records to an offline W&B run."""

import ast
import json
import logging
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import vsekit
import vsekit_lab
from vsekit.cli import configure_logging, main
from vsekit.training import reporting

SRC = Path(vsekit.__file__).resolve().parent.parent  # src/: the library (vsekit) and its lab (vsekit_lab)
PACKAGES = (Path(vsekit.__file__).resolve().parent, Path(vsekit_lab.__file__).resolve().parent)
TINY = [
    "model.embed_dim=32",
    "model.text.word_dim=16",
    "train.batch_size=16",
    "train.log_every=1",
    "optim.lr_decay_epochs=[1]",
]
TINY_ARGS = ["--recipe", "vsepp", "--no-progress", "--epochs", "1", *[x for s in TINY for x in ("--set", s)]]

# Where `print` is the interface, not a diagnostic: the CLI and its verbs (anywhere in them), and the `main()`
# of modules run as scripts (`python -m ...`), whose output is a table or JSON on stdout (only in `main`).
PRINT_ANYWHERE = ("vsekit/cli.py", "vsekit/commands/", "vsekit_lab/commands/")
PRINT_IN_MAIN: dict[str, str] = {}  # "package/module.py": why (none today: bench/aeom.py lost its own parser)


def package_files() -> list[Path]:
    return [path for root in PACKAGES for path in sorted(root.rglob("*.py"))]


@pytest.fixture(autouse=True)
def _one_thread(_threads):
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _reset_cli_logging():
    yield
    configure_logging(logging.INFO)  # a `-q` / `-v` test leaves the next one the default level


def print_calls(path: Path) -> list[tuple[int, str]]:
    """(line, enclosing function) of every call of the builtin `print` (strings and comments do not count)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if isinstance(child, ast.Call) and isinstance(child.func, ast.Name) and child.func.id == "print":
                found.append((child.lineno, func))
            visit(child, name)

    visit(tree, "<module>")
    return found


# --------------------------------------------------------------------------------------- no print in the library


def test_library_modules_do_not_print():
    offenders = []
    for path in package_files():
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(PRINT_ANYWHERE):
            continue
        offenders += [
            f"{rel}:{line} in {func}()"
            for line, func in print_calls(path)
            if not (rel in PRINT_IN_MAIN and func == "main")
        ]
    assert not offenders, (
        "library code logs through logging (or takes a log= callback), it does not print: "
        + ", ".join(offenders)
    )
    assert all(print_calls(SRC / rel) for rel in PRINT_IN_MAIN)  # the allow-list names no file without prints


def test_the_print_scan_sees_calls_and_ignores_strings(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text('"""print(x) in a docstring"""\ndef f():\n    print("hi")  # print(\ns = "print(y)"\n')
    assert print_calls(sample) == [(3, "f")]


def test_library_modules_never_configure_logging():
    for path in package_files():
        if path.name != "cli.py":
            assert "basicConfig" not in path.read_text(encoding="utf-8"), path


# ------------------------------------------------------------------------------------------------- --version


def test_version_prints_the_package_version_without_torch():
    code = (
        "import sys\nfrom vsekit.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit as e:\n"
        "    print('exit', e.code)\nprint('torch loaded' if 'torch' in sys.modules else 'no torch')\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split("\n")
    from importlib.metadata import version

    assert out[:3] == [f"vsekit {version('vsekit')}", "exit 0", "no torch"], out
    assert version("vsekit") == vsekit.__version__


# ------------------------------------------------------------------------------------------------ -q and -v


def test_quiet_hides_info_and_verbose_shows_debug(tiny_data, tmp_path, capsys):
    info = "INFO vsekit.training.trainer: training "  # the trainer's start line (a library INFO record)
    debug = "DEBUG vsekit.training.trainer: "  # where the TensorBoard scalars go
    assert main(["train", "--data", str(tiny_data), "--out", str(tmp_path / "a"), *TINY_ARGS]) == 0
    err = capsys.readouterr().err
    assert info in err and debug not in err
    assert main(["-q", "train", "--data", str(tiny_data), "--out", str(tmp_path / "b"), *TINY_ARGS]) == 0
    got = capsys.readouterr()
    assert info not in got.err and debug not in got.err
    assert "best dev rsum" in got.out  # -q quiets the logs, not what a verb prints as its result
    assert main(["-v", "train", "--data", str(tiny_data), "--out", str(tmp_path / "c"), *TINY_ARGS]) == 0
    err = capsys.readouterr().err
    assert info in err and debug in err


def test_quiet_and_verbose_exclude_each_other(capsys):
    with pytest.raises(SystemExit):
        main(["-q", "-v", "recipes"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_logger_with_its_own_handler_is_not_echoed_twice(capsys):
    configure_logging(logging.INFO)
    own = logging.getLogger("vsekit.test.own_handler")  # like the search server's JSON access log
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    own.addHandler(handler)
    try:
        own.info("request")
        logging.getLogger("vsekit.test.plain").info("plain record")
    finally:
        own.removeHandler(handler)
    err = capsys.readouterr().err
    assert lines == ["request"] and "request" not in err and "INFO vsekit.test.plain: plain record" in err


# --------------------------------------------------------------------------------------- --report-to wandb


def read_wandb_history(path: Path) -> list[dict]:
    """The history rows of a `.wandb` transaction log (LevelDB log format of wandb's `Record` protobufs;
    wandb 0.31 ships no Python reader for it)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B", data[:8]
    pos, block, buf, rows = 7, 32768, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind == 0:
            continue
        buf = chunk if kind in (1, 2) else buf + chunk  # 1 full, 2 first, 3 middle, 4 last
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(buf)
            if record.WhichOneof("record_type") == "history":
                rows.append(
                    {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
                )
            buf = b""
    return rows


def _offline_env(monkeypatch, tmp_path):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)


@pytest.mark.parametrize("target", ["wandb", "wandb-offline"])
def test_report_to_wandb_logs_the_metrics_records_offline(target, tiny_data, tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    _offline_env(monkeypatch, tmp_path)
    if target == "wandb-offline":
        monkeypatch.delenv("WANDB_MODE")  # offline by the flag alone
    run = tmp_path / "run"
    assert (
        main(["train", "--data", str(tiny_data), "--out", str(run), *TINY_ARGS, "--report-to", target]) == 0
    )
    assert "offline run" in capsys.readouterr().err  # says where the run is and how to upload it
    files = list((tmp_path / "wandb_dir").rglob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    expected = {
        (r["step"], f"{r['kind']}/{k}"): v
        for r in records
        for k, v in r.items()
        if isinstance(v, (int, float)) and k not in ("step", "epoch")
    }
    # wandb's writer is a separate service process: on a loaded machine its last records can reach the file a
    # moment after `finish` returns, so read until every expected key is there (or 30 s have passed)
    deadline = time.monotonic() + 30
    while True:
        rows = read_wandb_history(files[0])
        logged: dict[tuple[int, str], float] = {}
        for row in rows:
            for key, value in row.items():
                if "/" in key:
                    logged[(row["_step"], key)] = value
        if logged.keys() >= expected.keys() or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {"train/loss", "train/lr", "val/rsum", "val/i2t_r1"} <= {key for _, key in expected}
    assert logged.keys() == expected.keys()
    for (
        key,
        value,
    ) in expected.items():  # the same Python floats, through W&B's writer (float64 or float32 there)
        assert logged[key] == pytest.approx(value, rel=1e-6), key
    assert {row.get("epoch") for row in rows} == {1}


def test_report_to_wandb_without_wandb_says_what_to_install(tiny_data, tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a)
    )
    out = tmp_path / "run"
    assert (
        main(["train", "--data", str(tiny_data), "--out", str(out), *TINY_ARGS, "--report-to", "wandb"]) == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("vse train: error: --report-to wandb needs the wandb package: pip install wandb"), (
        err
    )
    assert not out.exists()


def test_wandb_is_offline_without_credentials(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    monkeypatch.delenv("NETRC", raising=False)
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    assert reporting.wandb_mode("wandb") == "offline" and reporting.wandb_mode("wandb-offline") == "offline"
    (tmp_path / ".netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    (tmp_path / ".netrc").chmod(0o600)
    assert reporting.wandb_mode("wandb") is None  # logged in: wandb decides (online)
    assert reporting.wandb_mode("wandb-offline") == "offline"
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert reporting.wandb_mode("wandb") is None  # the user's WANDB_MODE applies
