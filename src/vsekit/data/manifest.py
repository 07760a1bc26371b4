"""The dataset manifest, `manifest.json` beside a dataset's split files: its one reader, its one writer and the
rule that finds the feature extractor a builder recorded in it.

Every builder (`vse data folder | table | webdataset | karpathy | link-images | noise`, the lab's sets) writes
it through `write_manifest`, and every consumer (the trainer copying the extractor into a run's config.json,
the images root of `{split}_images.txt`, `vse index`, `vse data check`, the noise record) reads it through
`read_manifest`, so its file name, its bounds and what a broken one means are decided here once. A missing
manifest is an empty one; one that cannot be read, is not bounded JSON or is not an object is a
`ManifestError` naming the file, and each caller decides whether that stops it or is ignored.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from vsekit.errors import VseInputError
from vsekit.utils.io import atomic_write_json
from vsekit.utils.safe_json import JsonBoundsError, read_json_file

log = logging.getLogger(__name__)

MANIFEST = "manifest.json"
# a manifest records counts, sha256s and specs (a few KiB); the cap only keeps a stray huge file from being read
MAX_MANIFEST_BYTES = 16 << 20
# where builders record the extractor that made a set's features, in the order they are looked up: `extractor`
# (the lab's shapes and moving shapes), `feature_extractor` (older sets), `features` (`vse data folder` and the
# openclipart set); a spec is a JSON object with a `name`
EXTRACTOR_KEYS = ("extractor", "feature_extractor", "features")


class ManifestError(VseInputError):
    """A `manifest.json` that cannot be read, is not bounded JSON or is not an object; names the file."""

    def __init__(self, path: Path, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path, self.detail = path, detail


def manifest_path(root: str | Path) -> Path:
    """Where a dataset folder's manifest lies (for a message, or to skip it when copying a folder)."""
    return Path(root) / MANIFEST


def read_manifest(root: str | Path) -> dict[str, Any]:
    """The manifest of dataset folder `root` as a dict, {} when it has none; a `ManifestError` when it cannot
    be read, is larger than MAX_MANIFEST_BYTES, is not bounded JSON (`loads_bounded`) or is not an object."""
    path = manifest_path(root)
    if not path.exists() and not path.is_symlink():
        return {}
    if not path.is_file():
        raise ManifestError(path, "not a regular file")
    try:
        value = read_json_file(path, MAX_MANIFEST_BYTES, "a dataset manifest")
    except JsonBoundsError as e:
        raise ManifestError(path, str(e).removeprefix(f"{path}: ")) from None
    if not isinstance(value, dict):
        raise ManifestError(path, "expected a JSON object")
    return value


def write_manifest(root: str | Path, manifest: dict[str, Any], ensure_ascii: bool = True) -> Path:
    """Write `manifest` as `root/manifest.json`, crash-safely (a builder writes it last: a folder without one is
    an unfinished build); `ensure_ascii` as each builder always wrote it. Returns its path."""
    path = manifest_path(root)
    atomic_write_json(path, manifest, ensure_ascii=ensure_ascii)
    log.debug("wrote %s", path)
    return path


def remove_manifest(root: str | Path) -> None:
    """Remove a folder's manifest (a build about to replace its files: from here on it is unfinished)."""
    manifest_path(root).unlink(missing_ok=True)


def manifest_extractor(manifest: dict[str, Any]) -> dict | None:
    """The extractor spec a manifest records: the first of EXTRACTOR_KEYS holding an object with a `name`."""
    for key in EXTRACTOR_KEYS:
        spec = manifest.get(key)
        if isinstance(spec, dict) and spec.get("name"):
            return spec
    return None


def read_manifest_extractor(root: str | Path) -> dict | None:
    """The extractor spec of dataset folder `root`'s manifest (None without one); `ManifestError` when broken."""
    return manifest_extractor(read_manifest(root))
