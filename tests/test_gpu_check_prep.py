"""scripts/prepare_gpu_check.sh on a stand-in of the shipped check: the copy it adapts imports a module that
exists here, and its CUDA test list names tests that pytest collects, each once."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "prepare_gpu_check.sh"
# the two places of the shipped gpu_check.sh that the script edits, as they stand there
SHIPPED = """#!/usr/bin/env bash
run_step tests_cuda "$OUT/tests.log" 150 40 env -u VSE_DEBUG "$PY" -m pytest -q \\
  "tests/test_cuda_graph.py::test_cuda_graph_step_equals_the_eager_step" \\
  "tests/test_ladder.py::test_cuda_graph_levels_equal_eager_and_cpu"
cat >"$TMPD/prof.py" <<'EOF'
from vsekit.bench.train_step import build_train_step
EOF
"""


def _shared(tmp_path: Path, check: str) -> Path:
    shared = tmp_path / "shared"
    (shared / "tools").mkdir(parents=True)
    (shared / "reference-code" / "vse_infty_bigru").mkdir(parents=True)
    (shared / "tools" / "gpu_check.sh").write_text(check)
    (shared / "tools" / "bench_released_vse_infty.py").write_text("print('{}')\n")
    return shared


def _prepare(tmp_path: Path, shared: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "REF_DIR": str(tmp_path / "ref"), "PYTHON": sys.executable}
    return subprocess.run(
        ["bash", str(SCRIPT), str(shared)], capture_output=True, text=True, env=env, timeout=60
    )


def test_the_adapted_check_imports_what_exists_and_lists_collectable_tests(tmp_path):
    proc = _prepare(tmp_path, _shared(tmp_path, SHIPPED))
    assert proc.returncode == 0, proc.stderr
    check = (tmp_path / "ref" / "tools" / "gpu_check.sh").read_text()
    assert (tmp_path / "ref" / "reference-code" / "vse_infty_bigru").is_dir()
    module = re.search(r"^from (\S+) import build_train_step$", check, re.M).group(1)
    assert callable(importlib.import_module(module).build_train_step)
    ids = re.findall(r'^  "(tests/[^"]+)"', check, re.M)
    assert len(ids) == len(set(ids)) and ids[:2] == [
        "tests/test_cuda_graph.py::test_cuda_graph_step_equals_the_eager_step",
        "tests/test_ladder.py::test_cuda_graph_levels_equal_eager_and_cpu",
    ]
    assert "tests/test_cuda_full_size.py::test_full_size_graph_step_equals_the_eager_step" in ids
    collected = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *ids],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert collected.returncode == 0, collected.stdout[-2000:]
    assert subprocess.run(["bash", "-n", str(tmp_path / "ref" / "tools" / "gpu_check.sh")]).returncode == 0


@pytest.mark.parametrize(
    "check, words",
    [
        (SHIPPED.replace("from vsekit.bench", "from somewhere.else"), "import line changed"),
        (SHIPPED.replace("test_cuda_graph_levels_equal_eager_and_cpu", "renamed"), "test list changed"),
    ],
)
def test_a_check_that_changed_is_refused_not_half_adapted(tmp_path, check, words):
    proc = _prepare(tmp_path, _shared(tmp_path, check))
    assert proc.returncode == 1 and words in proc.stderr


def test_a_missing_shared_folder_is_named(tmp_path):
    proc = _prepare(tmp_path, tmp_path / "nowhere")
    assert proc.returncode == 2 and "nowhere/tools not found" in proc.stderr
