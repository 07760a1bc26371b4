"""The package's shape: no two `vsekit` modules import each other, directly or through others (lazy imports
inside functions count), and the layers of docs/architecture.md hold (`lint-imports`, the contract in
pyproject.toml). grimp parses every import statement of the source, so nothing here imports vsekit."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

grimp = pytest.importorskip("grimp")
ROOT = Path(__file__).resolve().parents[1]


def import_cycles(graph, package: str = "vsekit") -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    modules = sorted(m for m in graph.modules if m == package or m.startswith(package + "."))
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for root in modules:
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            node, i = work.pop()
            if i == 0:
                index[node] = low[node] = counter
                counter += 1
                stack.append(node)
                on_stack.add(node)
            nexts = edges.get(node, [])
            if i < len(nexts):
                work.append((node, i + 1))
                child = nexts[i]
                if child not in index:
                    work.append((child, 0))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            if low[node] == index[node]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == node:
                        break
                if len(comp) > 1:
                    found.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[node])
    return found


def test_cycle_finder_finds_a_planted_cycle():
    """The finder itself, on a hand-made graph: a -> b -> c -> a is one cycle, d -> a is not part of it."""
    g = grimp.ImportGraph()
    for m in ("p", "p.a", "p.b", "p.c", "p.d"):
        g.add_module(m)
    for a, b in (("p.a", "p.b"), ("p.b", "p.c"), ("p.c", "p.a"), ("p.d", "p.a")):
        g.add_import(importer=a, imported=b)
    assert import_cycles(g, "p") == [["p.a", "p.b", "p.c"]]


def test_no_import_cycles_among_vsekit_modules():
    graph = grimp.build_graph("vsekit", include_external_packages=False)
    assert import_cycles(graph) == []


def test_layers_contract_holds():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install import-linter)")
    done = subprocess.run([exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
