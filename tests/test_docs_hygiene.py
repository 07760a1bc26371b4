"""The repository reads as a product for its users: no absolute paths of the machine a page was written on,
no wording about how the work was done (internal issue numbers, sessions, lent machines), and a README a
newcomer can read in one sitting."""

from __future__ import annotations

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
            if p.is_file() and p.suffix in TEXT_SUFFIXES and ".egg-info" not in p.parts and p.name != Path(__file__).name:
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
        ("see /work/data/openclipart", True),
        ("`--out /tmp/x`", True),
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
        ("as issue 33 asked", True),
        ("No GPU was lent to this session", True),
        ("the issue's shapes", True),
        ('@pytest.fixture(scope="session")', False),
        ("a loss hook issues no host sync", False),
    ],
)
def test_the_history_rule_matches_what_it_should(line: str, history: bool) -> None:
    assert bool(HISTORY.search(line)) is history
