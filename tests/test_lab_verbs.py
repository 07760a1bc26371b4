"""The lab's `vse` verbs come through entry points (pyproject.toml), not through imports: the installed metadata
names the same verbs as pyproject.toml, every lab verb answers, a package that cannot be loaded costs one warning
line and leaves the other verbs working, and the records of a package that registers verbs reach the CLI's log."""

import contextlib
import io
import os
import subprocess
import sys
from importlib.metadata import distribution
from pathlib import Path

import pytest

from vsekit.cli import main

ROOT = Path(__file__).resolve().parents[1]
GROUPS = ("vsekit.commands", "vsekit.data_commands")


def declared_entry_points() -> dict[str, dict[str, str]]:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return {group: project["entry-points"][group] for group in GROUPS}


def test_the_installed_metadata_names_the_verbs_of_pyproject():
    """Fails when pyproject.toml's entry points changed and `pip install -e .` was not rerun (scripts/setup.sh)."""
    installed = {group: {} for group in GROUPS}
    for ep in distribution("vsekit").entry_points:
        if ep.group in installed:
            installed[ep.group][ep.name] = ep.value
    assert installed == declared_entry_points(), "rerun: .venv/bin/python -m pip install --no-deps -e ."
    assert set(installed["vsekit.commands"]) == {"bench", "demo", "experiment"}
    assert set(installed["vsekit.data_commands"]) == {
        "openclipart",
        "convert-video",
        "synthetic",
        "moving-shapes",
        "wesnoth",
    }


def help_of(argv: list[str]) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as done:
        main([*argv, "--help"])
    assert done.value.code == 0, argv
    return out.getvalue()


@pytest.mark.parametrize(
    "argv",
    [
        ["demo"],
        ["bench", "search"],
        ["bench", "startup"],
        ["experiment", "gpo-synthetic"],
        ["data", "openclipart"],
        ["data", "convert-video"],
        ["data", "synthetic"],
        ["data", "moving-shapes"],
        ["data", "wesnoth"],
    ],
)
def test_every_lab_verb_answers(argv):
    assert help_of(argv).startswith(f"usage: vse {' '.join(argv)} ")


def test_the_lab_verbs_are_listed_beside_the_library_verbs():
    top, data = help_of([]), help_of(["data"])
    for verb in ("train", "eval", "index", "demo", "bench", "experiment"):
        assert f"    {verb} " in top, verb
    for verb in ("karpathy", "folder", "check", "show", "openclipart", "wesnoth", "synthetic"):
        assert f"    {verb} " in data, verb


def test_a_package_that_cannot_be_loaded_costs_one_line_and_its_records_reach_the_log(tmp_path):
    """A fake installed package (a dist-info folder on PYTHONPATH) registers a working verb and a `vse data` sub-verb
    and names a module that does not exist: `vse` warns once, keeps every other verb, and shows the package's own
    log records like vsekit's."""
    (tmp_path / "fakeverbs.py").write_text(
        "import logging\n"
        "def run(args):\n    logging.getLogger('fakeverbs.job').info('working on %s', args.word)\n    print('done')\n"
        "    return 0\n"
        "def register(sub):\n    p = sub.add_parser('hello', help='a verb of another package')\n"
        "    p.add_argument('word')\n    p.set_defaults(func=run)\n"
        "def register_data(dsub):\n    dsub.add_parser('fake-set', help='a set builder of another package')\n"
    )
    info = tmp_path / "fakeverbs-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fakeverbs\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(
        "[vsekit.commands]\nhello = fakeverbs:register\n"
        "broken = no_such_module_here:register\n\n"
        "[vsekit.data_commands]\nfake-set = fakeverbs:register_data\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    run = subprocess.run(
        [sys.executable, "-m", "vsekit.cli", "hello", "world"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout == "done\n"
    lines = run.stderr.splitlines()
    warnings = [line for line in lines if "no_such_module_here" in line]
    assert len(warnings) == 1 and warnings[0].startswith("WARNING vsekit.commands.plugins: "), run.stderr
    assert "broken = no_such_module_here:register cannot be loaded (ModuleNotFoundError" in warnings[0]
    assert "INFO fakeverbs.job: working on world" in lines
    listed = subprocess.run(
        [sys.executable, "-m", "vsekit.cli", "data", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert listed.returncode == 0 and "fake-set" in listed.stdout and "openclipart" in listed.stdout
