"""The package's shape: no two `vsekit` modules import each other, directly or through others (lazy imports
inside functions count), the layers of docs/architecture.md hold (`lint-imports`, the contracts in
pyproject.toml), and the library never imports its lab (vsekit_lab). grimp parses every import statement of the
source, so nothing here imports vsekit."""

import ast
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
    """Runtime imports only: an `if TYPE_CHECKING:` import (a callback naming the `Trainer` it is handed) is
    never executed, so it makes no cycle."""
    graph = grimp.build_graph(
        "vsekit", "vsekit_lab", include_external_packages=False, exclude_type_checking_imports=True
    )
    assert import_cycles(graph) == []
    assert import_cycles(graph, "vsekit_lab") == []


def lab_imports(path: Path) -> list[str]:
    """`line: statement` of every import of vsekit_lab in `path`: import statements anywhere (inside functions
    too) and `importlib.import_module` / `__import__` calls with a literal name. Strings and comments do not count."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if called in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                names = [node.args[0].value]
        found += [
            f"{node.lineno}: {name}"
            for name in names
            if name == "vsekit_lab" or name.startswith("vsekit_lab.")
        ]
    return found


def test_the_lab_import_finder_sees_every_form(tmp_path):
    sample = tmp_path / "m.py"
    sample.write_text(
        '"""vsekit_lab in a docstring"""\nimport vsekit_lab.demo\nfrom vsekit import cli  # vsekit_lab\n'
        "def f():\n    from vsekit_lab.bench import search\n    import importlib\n"
        "    importlib.import_module('vsekit_lab.commands')\n    __import__('vsekit_lab')\n    s = 'vsekit_lab.x'\n"
    )
    assert lab_imports(sample) == [
        "2: vsekit_lab.demo",
        "5: vsekit_lab.bench",
        "7: vsekit_lab.commands",
        "8: vsekit_lab",
    ]


def test_the_library_never_imports_its_lab():
    """vsekit_lab registers its verbs through entry points (pyproject.toml); no module of src/vsekit names it in an
    import, and grimp finds no chain of imports from vsekit to vsekit_lab."""
    library = ROOT / "src" / "vsekit"
    offenders = [
        f"{p.relative_to(ROOT)}:{hit}" for p in sorted(library.rglob("*.py")) for hit in lab_imports(p)
    ]
    assert offenders == []
    graph = grimp.build_graph("vsekit", "vsekit_lab", include_external_packages=False)
    assert not graph.chain_exists(importer="vsekit", imported="vsekit_lab", as_packages=True)
    assert graph.chain_exists(
        importer="vsekit_lab", imported="vsekit", as_packages=True
    )  # the lab uses the library


def test_layers_contract_holds():
    exe = shutil.which("lint-imports", path=str(Path(sys.executable).parent)) or shutil.which("lint-imports")
    if exe is None:
        pytest.skip("import-linter is not installed (pip install import-linter)")
    done = subprocess.run(
        [exe, "--config", str(ROOT / "pyproject.toml")], cwd=ROOT, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]


def _is_module(src: Path, dotted: str) -> bool:
    path = src.joinpath(*dotted.split("."))
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def private_imports(path: Path, src: Path) -> list[str]:
    """`line: name` of every private (`_x`, not `__x__`) name of another vsekit / vsekit_lab module that `path`
    uses: `from vsekit.m import _x` (relative imports too) and `m._x` where `m` names an imported module."""

    def private(name: str) -> bool:
        return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))

    def absolute(node: ast.ImportFrom) -> str:
        if node.level == 0:
            return node.module or ""
        package = path.relative_to(src).with_suffix("").parts[:-1]
        return ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])

    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules: dict[str, str] = {}  # local name -> module it is bound to
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in ("vsekit", "vsekit_lab"):
                    local = alias.asname or alias.name.split(".")[0]
                    modules[local] = alias.name if alias.asname else local
        elif isinstance(node, ast.ImportFrom):
            module = absolute(node)
            if module.split(".")[0] not in ("vsekit", "vsekit_lab"):
                continue
            for alias in node.names:
                if private(alias.name):
                    found.append(f"{node.lineno}: {module}.{alias.name}")
                elif _is_module(src, f"{module}.{alias.name}"):
                    modules[alias.asname or alias.name] = f"{module}.{alias.name}"
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr):
            value, parts = node.value, []
            while isinstance(value, ast.Attribute):
                parts.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in modules:
                owner = ".".join([modules[value.id], *reversed(parts)])
                if _is_module(src, owner):
                    found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


def test_the_private_name_finder_sees_every_form(tmp_path):
    """The finder itself, on a planted package: each form of reaching into another module's private names."""
    pkg = tmp_path / "vsekit"
    (pkg / "sub").mkdir(parents=True)
    for name in ("__init__.py", "a.py", "sub/__init__.py", "sub/b.py"):
        (pkg / name).write_text("")
    (pkg / "sub" / "c.py").write_text(
        "from vsekit.a import _hidden, public\nfrom . import b\nfrom .b import _x as y\nimport vsekit.a as a_mod\n"
        "import vsekit.sub.b\nfrom vsekit import __version__\nfrom vsekit import a\n"
        "b._one(); a_mod._two; vsekit.sub.b._three; a.public; self_obj = a; self_obj._not_a_module_name\n"
        "a._four\nx = object(); x._fine\n"
    )
    assert sorted(private_imports(pkg / "sub" / "c.py", tmp_path)) == [
        "1: vsekit.a._hidden",
        "3: vsekit.sub.b._x",
        "8: vsekit.a._two",
        "8: vsekit.sub.b._one",
        "8: vsekit.sub.b._three",
        "9: vsekit.a._four",
    ]


def test_no_private_names_across_modules():
    """A module's `_private` names are its own: no module of vsekit or vsekit_lab imports or reads another's
    (one owner per fact; what others need is public, with a docstring)."""
    src = ROOT / "src"
    offenders = [
        f"{p.relative_to(ROOT)}:{hit}"
        for package in ("vsekit", "vsekit_lab")
        for p in sorted((src / package).rglob("*.py"))
        for hit in private_imports(p, src)
    ]
    assert offenders == []
