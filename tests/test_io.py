"""vsekit.utils.io: the one sha256-of-a-file helper and the one atomic-write path every writer goes through."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from vsekit.utils.io import atomic_path, atomic_save_npy, atomic_write_bytes, atomic_write_json, sha256_file

SRC = Path(__file__).resolve().parents[1] / "src" / "vsekit"


def test_sha256_file_known_digests(tmp_path):
    abc = tmp_path / "abc"
    abc.write_bytes(b"abc")  # FIPS 180-2 test vector
    assert sha256_file(abc) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    empty = tmp_path / "empty"
    empty.write_bytes(b"")
    assert sha256_file(empty) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
    big = tmp_path / "big"
    data = os.urandom(3 * (1 << 20) + 17)  # crosses several read blocks
    big.write_bytes(data)
    assert sha256_file(big) == sha256_file(big, chunk=4096) == hashlib.sha256(data).hexdigest()


def _leftovers(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


def test_atomic_path_replaces_on_success_and_keeps_the_old_file_on_error(tmp_path):
    target = tmp_path / "sub" / "f.bin"
    atomic_write_bytes(target, b"old")  # creates the folder
    with pytest.raises(RuntimeError, match="killed"):
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half of the new")
            raise RuntimeError("killed mid-write")
    assert target.read_bytes() == b"old" and _leftovers(target.parent) == []
    with atomic_path(target) as tmp:
        assert tmp.parent == target.parent and tmp != target
        tmp.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # readers see the old file until the block ends
    assert target.read_bytes() == b"new" and _leftovers(target.parent) == []


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_atomic_writes_get_the_mode_open_would_give(tmp_path, umask):
    old = os.umask(umask)
    try:
        atomic_write_bytes(tmp_path / "a", b"x", fsync=False)
        atomic_save_npy(tmp_path / "b.npy", [1, 2])
    finally:
        os.umask(old)
    for name in ("a", "b.npy"):
        assert (tmp_path / name).stat().st_mode & 0o777 == 0o666 & ~umask  # not mkstemp's 0o600


def test_atomic_write_json_keeps_non_ascii_when_asked(tmp_path):
    atomic_write_json(tmp_path / "a.json", {"t": "Lézard"})
    atomic_write_json(tmp_path / "b.json", {"t": "Lézard"}, ensure_ascii=False)
    assert "\\u00e9" in (tmp_path / "a.json").read_text() and "Lézard" in (tmp_path / "b.json").read_text()
    assert json.loads((tmp_path / "b.json").read_text(encoding="utf-8")) == {"t": "Lézard"}


def test_no_module_keeps_its_own_copy_of_these_helpers():
    """A file digest and a temp-file-then-rename write each live once, in utils/io.py."""
    for path in [*SRC.rglob("*.py"), *(SRC.parent / "vsekit_lab").rglob("*.py")]:  # the library and its lab
        if path.name == "io.py" and path.parent.name == "utils":
            continue
        text = path.read_text(encoding="utf-8")
        assert "mkstemp(" not in text, f"{path}: use vsekit.utils.io.atomic_path"
        assert "hashlib.sha256()" not in text or ".update(block)" not in text, f"{path}: use sha256_file"
