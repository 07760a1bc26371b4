"""Where the SVGs come from: the folder of Debian's `openclipart-svg` (installed when missing and run as
root), the sorted list of its regular .svg files, and the installed package version."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path

from vsekit.errors import SetupError

log = logging.getLogger(__name__)

DEFAULT_SVG_ROOT = "/usr/share/openclipart/svg"
PACKAGE = "openclipart-svg"


def ensure_svg_root(svg_root: str | Path) -> Path:
    """The SVG folder; installs the Debian package when the default folder is missing and we are root."""
    root = Path(svg_root)
    if root.is_dir():
        return root
    if root != Path(DEFAULT_SVG_ROOT):
        raise FileNotFoundError(
            f"{root}: no such folder (svg_root must be a folder of openclipart .svg files)"
        )
    cmd = f"sudo apt-get update && sudo apt-get install -y {PACKAGE}"
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        log.warning("%s is missing; installing the Debian package %s", root, PACKAGE)
        rc = subprocess.run(["apt-get", "install", "-y", PACKAGE], env=env).returncode
        if rc != 0:  # stale or empty package lists: refresh once and retry
            subprocess.run(["apt-get", "update"], env=env)
            rc = subprocess.run(["apt-get", "install", "-y", PACKAGE], env=env).returncode
        if rc == 0 and root.is_dir():
            return root
        raise SetupError(f"`apt-get install -y {PACKAGE}` failed (exit {rc}); {root} is still missing")
    raise FileNotFoundError(f"{root} is missing; install the clip art with: {cmd}")


def find_svgs(root: Path) -> tuple[list[str], int]:
    """Sorted relative paths of regular .svg files, and the number of symlinked ones skipped (aliases)."""
    paths, links = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if not name.lower().endswith(".svg"):
                continue
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                links += 1
                continue
            if os.path.isfile(full):
                paths.append(os.path.relpath(full, root))
    return sorted(paths), links


def package_version(package: str = PACKAGE) -> str | None:
    try:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None
