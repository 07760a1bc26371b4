"""The repository reads as a product for its users: no absolute paths of the machine a page was written on,
no wording about how the work was done (internal issue numbers, sessions, lent machines), and a README a
newcomer can read in one sitting; docs/architecture.md names only modules that exist, and its layers tables are the
import contracts of pyproject.toml."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README_MAX_LINES = 130

# Top-level folders of a developer's or CI machine. A path a user must type on any machine (e.g. Debian's
# /usr/share/openclipart, /dev/null, /proc/self/...) is not one of them.
MACHINE_PATH = re.compile(r"(?<![\w.~/*-])/(?:work|root|home|tmp|mnt|opt|data|Users)/")
HISTORY = re.compile(
    r"\bissues? #?\d+\b"
    r"|\bthe issue's\b"
    r"|\bthis session\b|\bworking session\b|\bsessions? that\b"
    r"|\bno (?:GPU|device)(?: machine)? was (?:lent|available)\b|\blent (?:machine|GPU)\b|\bwas lent\b"
    r"|\bother (?:engineers|helpers)\b",
    re.IGNORECASE,
)
TEXT_SUFFIXES = {".py", ".md", ".sh", ".yaml", ".yml", ".toml", ".txt", ".html", ".js", ".css"}


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for top in ("docs", "src", "tests", "scripts", ".ci"):
        for p in sorted((ROOT / top).rglob("*")):
            if (
                p.is_file()
                and p.suffix in TEXT_SUFFIXES
                and ".egg-info" not in p.parts
                and p.name != Path(__file__).name
            ):
                out.append(p)
    return out


def _hits(pattern: re.Pattern[str]) -> list[str]:
    hits = []
    for p in _files():
        for n, line in enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1):
            if pattern.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    return hits


def test_no_absolute_machine_paths() -> None:
    assert _hits(MACHINE_PATH) == []


def test_no_work_history_wording() -> None:
    assert _hits(HISTORY) == []


def test_readme_is_short() -> None:
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= README_MAX_LINES


@pytest.mark.parametrize(
    "line, machine_path",
    [
        (
            "see " + "/wo" + "rk/data/openclipart",
            True,
        ),  # split: no literal machine path stands in the repository
        ("`--out " + "/tm" + "p/x`", True),
        ('source_json: "/data/coco.json"', True),
        ("Debian puts them in /usr/share/openclipart/svg", False),
        ("runs/demo/seed0", False),
        ("usr/share/games/wesnoth/*/data/core/units", False),
    ],
)
def test_the_path_rule_matches_what_it_should(line: str, machine_path: bool) -> None:
    assert bool(MACHINE_PATH.search(line)) is machine_path


@pytest.mark.parametrize(
    "line, history",
    [
        ("as " + "iss" + "ue 33 asked", True),
        ("No GPU was " + "lent to this " + "session", True),
        ("the issue's shapes", True),
        ('@pytest.fixture(scope="session")', False),
        ("a loss hook issues no host sync", False),
    ],
)
def test_the_history_rule_matches_what_it_should(line: str, history: bool) -> None:
    assert bool(HISTORY.search(line)) is history


# ------------------------------------------------------------------ docs/architecture.md names what exists
ARCHITECTURE = ROOT / "docs" / "architecture.md"
OLD_TO_NEW = "## Old import → new"
# a dotted vsekit / vsekit_lab name; `{a,b}` lists alternatives, `.*` stands for every module of a package
DOTTED = re.compile(r"(?<![\w/.-])vsekit(?:_lab)?(?:\.(?:[A-Za-z_]\w*|\{[\w, ]+\}|\*))+")
# a file or folder in backticks (`search/store.py`, `models/*_parts.py`, `src/vsekit/recipes/`), and a
# repository path in plain text (docs/security.md)
CODE_PATH = re.compile(r"`([\w.*-]+(?:/[\w.*-]+)*(?:\.py|/)|[\w.*-]+(?:/[\w.*-]+)+)`")
REPO_PATH = re.compile(r"(?<![\w/.-])(?:docs|tests|scripts)/[\w/.-]+\.(?:md|py|sh)")


def _expand(name: str) -> list[str]:
    """`a.{b,c}.d` -> [`a.b.d`, `a.c.d`] (any number of brace groups)."""
    m = re.search(r"\{([^{}]*)\}", name)
    if not m:
        return [name]
    return [
        out
        for alt in m.group(1).split(",")
        for out in _expand(name[: m.start()] + alt.strip() + name[m.end() :])
    ]


def _module_file(parts: list[str]) -> Path | None:
    base = ROOT / "src" / Path(*parts)
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _bound_names(body: list[ast.stmt]) -> dict[str, ast.stmt | None]:
    """Names a module or class body binds (definitions, assignments, imports, `__all__`), with the node of a
    def or class; the bodies of module-level `if` / `try` blocks (TYPE_CHECKING imports) count."""
    out: dict[str, ast.stmt | None] = {}
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out[node.name] = node
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Name):
                    out.setdefault(t.id, None)
                    if t.id == "__all__" and isinstance(node.value, (ast.List, ast.Tuple)):
                        out.update({e.value: None for e in node.value.elts if isinstance(e, ast.Constant)})
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.setdefault(node.target.id, None)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            out.update({(a.asname or a.name).split(".")[0]: None for a in node.names})
        elif isinstance(node, (ast.If, ast.Try)):
            for sub in (node.body, node.orelse, *(h.body for h in getattr(node, "handlers", []))):
                out.update({k: v for k, v in _bound_names(sub).items() if k not in out})
    return out


def resolves(name: str) -> bool:
    """Whether a dotted name exists in the source, read with `ast` (nothing is imported): the longest prefix
    that is a module, then names bound in it, then (after a class) names bound in the class body. `pkg.*`: a
    package."""
    parts = name.split(".")
    if parts[-1] == "*":
        return (ROOT / "src" / Path(*parts[:-1]) / "__init__.py").is_file()
    for i in range(len(parts), 0, -1):
        path = _module_file(parts[:i])
        if path is not None:
            break
    else:
        return False
    body: list[ast.stmt] = ast.parse(path.read_text(encoding="utf-8")).body
    rest = parts[i:]
    for j, attr in enumerate(rest):
        names = _bound_names(body)
        if attr not in names:
            return False
        node = names[attr]
        if j < len(rest) - 1:
            if not isinstance(node, ast.ClassDef):
                return False
            body = node.body
    return True


def _entry_point_groups() -> set[str]:
    text = (ROOT / "pyproject.toml").read_text(encoding="utf-8")
    return set(re.findall(r'^\[project\.entry-points\."([^"]+)"\]', text, re.MULTILINE))


def _path_exists(token: str) -> bool:
    """A path in the page: from the repository root, or anywhere below src/ (tables name a package's files
    relative to it)."""
    token = token.rstrip("/")
    if any(ROOT.glob(token)):
        return True
    return any((ROOT / "src").glob(f"**/{token}"))


def architecture_name_problems(text: str) -> list[str]:
    """Every vsekit module, name or file the page mentions that does not exist; in the old → new table, an old
    name that still exists (its row would be wrong)."""
    groups = _entry_point_groups()
    problems = []
    in_moves = False
    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("## "):
            in_moves = line.strip() == OLD_TO_NEW
        cells = line.strip().strip("|").split("|")
        old_cell = in_moves and line.startswith("|") and len(cells) == 2 and not line.startswith("|---")
        for k, cell in enumerate(cells if old_cell else [line]):
            gone = old_cell and k == 0
            for m in DOTTED.finditer(cell):
                for name in _expand(m.group(0)):
                    if name in groups:
                        continue
                    if resolves(name) == gone:
                        problems.append(f"line {n}: {name} {'still exists' if gone else 'does not exist'}")
        for token in CODE_PATH.findall(line) + REPO_PATH.findall(line):
            if not _path_exists(token):
                problems.append(f"line {n}: {token} does not exist")
    return problems


def test_architecture_names_only_modules_that_exist() -> None:
    assert architecture_name_problems(ARCHITECTURE.read_text(encoding="utf-8")) == []


def test_the_architecture_checker_finds_stale_names() -> None:
    page = (
        "`vsekit.search.store.SearchIndex.picture_file`, `vsekit.similarity.CosineSimilarity`, `search/store.py`\n"
        "`vsekit.search.nowhere`, `vsekit.runs.no_such_name`, `vsekit.search.store.SearchIndex.nope`\n"
        "`vsekit_lab.bench.*`, `vsekit.bench.*`, `nowhere/gone.py`, docs/no_such_page.md\n"
        f"{OLD_TO_NEW}\n| old | new |\n|---|---|\n"
        "| `vsekit.demo` | `vsekit_lab.demo` |\n"
        "| `vsekit.runs.{weights_path,gone}` | `vsekit.runs.{load_run,gone_too}` |\n"
    )
    assert architecture_name_problems(page) == [
        "line 2: vsekit.search.nowhere does not exist",
        "line 2: vsekit.runs.no_such_name does not exist",
        "line 2: vsekit.search.store.SearchIndex.nope does not exist",
        "line 3: vsekit.bench.* does not exist",
        "line 3: nowhere/gone.py does not exist",
        "line 3: docs/no_such_page.md does not exist",
        "line 8: vsekit.runs.weights_path still exists",
        "line 8: vsekit.runs.gone_too does not exist",
    ]


def _contract_layers(container: str) -> list[str]:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: tomli, which import-linter itself reads pyproject.toml with
        tomllib = pytest.importorskip("tomli")
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["importlinter"]
    return next(
        c["layers"]
        for c in contracts["contracts"]
        if c["type"] == "layers" and c["containers"] == [container]
    )


def _table_entries(text: str, package: str) -> list[str]:
    """The second column of the layers table whose header names `package`'s contract entries."""
    rows, inside = [], False
    for line in text.splitlines():
        if line.startswith("|") and f"`{package}` contract entry" in line:
            inside = True
            continue
        if inside and not line.startswith("|"):
            break
        if inside and not line.startswith("|---"):
            rows.append(line.split("|")[2].strip().strip("`"))
    return rows


@pytest.mark.parametrize("package", ["vsekit", "vsekit_lab"])
def test_the_layers_tables_are_the_import_contracts(package: str) -> None:
    assert _table_entries(ARCHITECTURE.read_text(encoding="utf-8"), package) == _contract_layers(package)
