"""Where the data comes from: a `.deb` of the package, an extracted package root or its data folder, an installed
copy, else `apt-get download` into a cache folder."""

from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from vsekit.errors import SetupError, VseInputError

log = logging.getLogger(__name__)

PACKAGE = "wesnoth-1.16-data"
INSTALLED_GLOB = "/usr/share/games/wesnoth/*/data"


@dataclass
class Source:
    data_dir: Path
    origin: str  # "deb" | "folder" | "installed" | "apt-get download"
    package: str | None = None
    version: str | None = None
    deb: str | None = None
    deb_sha256: str | None = None
    package_root: Path | None = None  # the extracted package root (for its copyright file)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vsekit" / "wesnoth"


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        raise SetupError(f"`{cmd[0]}` is not installed; it is needed for `{' '.join(cmd)}`") from None
    except subprocess.TimeoutExpired:
        raise SetupError(f"`{' '.join(cmd)}` did not finish within 30 minutes") from None


def _data_dir_in(root: Path) -> Path | None:
    """`root` itself when it is a Wesnoth `data` folder, else the newest `usr/share/games/wesnoth/*/data` in it."""
    if (root / "core" / "units").is_dir():
        return root
    found = sorted(Path(p) for p in glob.glob(str(root / "usr/share/games/wesnoth/*/data")))
    found = [p for p in found if (p / "core" / "units").is_dir()]
    return found[-1] if found else None


def _version_dir(data_dir: Path) -> str | None:
    """'1.16' from .../wesnoth/1.16/data."""
    return data_dir.parent.name if data_dir.parent.parent.name == "wesnoth" else None


def _package_root(data_dir: Path) -> Path | None:
    parts = data_dir.parts
    if len(parts) >= 6 and parts[-6:-2] == ("usr", "share", "games", "wesnoth"):
        return Path(*parts[:-6]) if len(parts) > 6 else Path("/")
    return None


def extract_deb(deb: Path, cache_dir: Path) -> Source:
    """Extract a .deb (`dpkg-deb -x`) into `cache_dir/<sha256 prefix>`, once; its data folder and provenance."""
    from vsekit.utils.io import sha256_file

    if not deb.is_file():
        raise VseInputError(f"{deb}: no such .deb file")
    sha = sha256_file(deb)
    info = _run(["dpkg-deb", "-f", str(deb), "Package", "Version"])
    if info.returncode != 0:
        raise SetupError(f"{deb}: not a readable .deb (dpkg-deb -f: {info.stderr.strip()[-300:]})")
    fields = dict(line.split(": ", 1) for line in info.stdout.splitlines() if ": " in line)
    target = cache_dir / f"{fields.get('Package', 'deb')}-{sha[:16]}"
    if not (target / ".complete").is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=cache_dir))
        log.info("extracting %s into %s", deb, target)
        r = _run(["dpkg-deb", "-x", str(deb), str(tmp)])
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SetupError(f"{deb}: `dpkg-deb -x` failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
        (tmp / ".complete").write_text(sha + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    data_dir = _data_dir_in(target)
    if data_dir is None:
        raise VseInputError(f"{deb}: holds no usr/share/games/wesnoth/*/data/core/units; is it {PACKAGE}?")
    return Source(data_dir, "deb", fields.get("Package"), fields.get("Version"), str(deb), sha, target)


def download_deb(cache_dir: Path, package: str = PACKAGE) -> Path:
    """`apt-get download PACKAGE` into `cache_dir` (reusing a .deb already there)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    have = sorted(cache_dir.glob(f"{package}_*.deb"))
    if have:
        return have[-1]
    log.info("downloading %s with apt-get into %s", package, cache_dir)
    r = _run(["apt-get", "download", package], cwd=cache_dir)
    have = sorted(cache_dir.glob(f"{package}_*.deb"))
    if r.returncode != 0 or not have:
        raise SetupError(
            f"`apt-get download {package}` in {cache_dir} failed (exit {r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[-300:]}\nFix: run `sudo apt-get update` and retry; or install the "
            f"game data (`sudo apt-get install {package}`); or fetch the .deb elsewhere and pass it with "
            f"--source path/to/{package}_*.deb (an extracted package root or its data folder works too)"
        )
    return have[-1]


def _installed_version(version_dir: str | None) -> tuple[str | None, str | None]:
    package = f"wesnoth-{version_dir}-data" if version_dir else None
    if package is None or shutil.which("dpkg-query") is None:
        return package, None
    r = _run(["dpkg-query", "-W", "-f=${Version}", package])
    return package, (r.stdout.strip() or None) if r.returncode == 0 else None


def locate_source(source: str | Path | None = None, cache_dir: str | Path | None = None) -> Source:
    """The Wesnoth data folder: `source` (.deb, package root or data folder), else installed, else apt-get."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if source is not None:
        src = Path(source)
        if src.is_file():
            return extract_deb(src, cache)
        if not src.is_dir():
            raise VseInputError(
                f"{src}: --source must be a {PACKAGE} .deb, an extracted package root or its data folder"
            )
        data_dir = _data_dir_in(src)
        if data_dir is None:
            raise VseInputError(
                f"{src}: no Wesnoth data here (neither core/units nor usr/share/games/wesnoth/*/data)"
            )
        ver = _version_dir(data_dir)
        return Source(
            data_dir,
            "folder",
            f"wesnoth-{ver}-data" if ver else None,
            ver,
            package_root=_package_root(data_dir),
        )
    installed = sorted(p for p in glob.glob(INSTALLED_GLOB) if (Path(p) / "core" / "units").is_dir())
    if installed:
        data_dir = Path(installed[-1])
        package, version = _installed_version(_version_dir(data_dir))
        return Source(data_dir, "installed", package, version, package_root=Path("/"))
    src = extract_deb(download_deb(cache), cache)
    src.origin = "apt-get download"
    return src
