"""Start-up time of the `vse` verbs that need no model, as whole processes.

`vse --help`, `vse recipes` and `vse eval-sims --help` parse their arguments without importing torch (the
verbs import what they need when they run), so they start in about the time of the interpreter plus numpy and
PyYAML. `bench_startup` times each command and a bare `python -c pass` (the floor no Python tool beats),
alternated `repeats` times after one untimed run, and says for each whether torch was imported
(`python -X importtime`, which lists every module a process imports).

    from vsekit_lab.bench.startup import bench_startup
    rows = bench_startup(repeats=5)   # [{"verb", "median_s", "min_s", "imports_torch"}, ...]
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import time

from vsekit.errors import SetupError, VseInputError

# what is timed: the interpreter's arguments for each command
COMMANDS: tuple[tuple[str, list[str]], ...] = (
    ("python -c pass", ["-c", "pass"]),
    ("vse --help", ["-m", "vsekit.cli", "--help"]),
    ("vse recipes", ["-m", "vsekit.cli", "recipes"]),
    ("vse eval-sims --help", ["-m", "vsekit.cli", "eval-sims", "--help"]),
)


def _argv(args: list[str], importtime: bool = False) -> list[str]:
    return [sys.executable, *(["-X", "importtime"] if importtime else []), *args]


def _run(argv: list[str]) -> subprocess.CompletedProcess:
    proc = subprocess.run(argv, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SetupError(f"{' '.join(argv[1:])} exited with {proc.returncode}: {proc.stderr.strip()[-500:]}")
    return proc


def imports_torch(args: list[str]) -> bool:
    """Whether `python ARGS` imports torch (`-X importtime` writes one line per imported module to stderr)."""
    lines = _run(_argv(args, importtime=True)).stderr.splitlines()
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in lines)


def bench_startup(repeats: int = 5) -> list[dict]:
    if repeats < 1:
        raise VseInputError("repeats must be positive")
    times: dict[str, list[float]] = {name: [] for name, _ in COMMANDS}
    for _, verb in COMMANDS:  # untimed: the files are then in the page cache for every command
        _run(_argv(verb))
    for _ in range(repeats):
        for name, verb in COMMANDS:
            t0 = time.perf_counter()
            _run(_argv(verb))
            times[name].append(time.perf_counter() - t0)
    base = statistics.median(times[COMMANDS[0][0]])
    return [
        {
            "verb": name,
            "median_s": statistics.median(times[name]),
            "min_s": min(times[name]),
            "over_python_s": statistics.median(times[name]) - base,
            "imports_torch": imports_torch(verb),
            "repeats": repeats,
        }
        for name, verb in COMMANDS
    ]
