"""One owner each: the precomp split files have one writer (`vsekit.data.precomp`) and the
dataset manifest one reader and writer (`vsekit.data.manifest`), with one rule for the extractor key.

The scans read the source of the packages as imported (so pointed at an older tree with PYTHONPATH they scan
that tree); the suffixes and file names below are written out here, not imported from the owners.
"""

from __future__ import annotations

import ast
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import vsekit
import vsekit_lab

SPLIT_SUFFIXES = (
    "_ims.npy",
    "_ims_lengths.txt",
    "_caps.txt",
    "_cap2img.txt",
    "_ids.txt",
    "_images.txt",
    "_frames.npy",
    "_frame_offsets.npy",
)
# names that stand for a split file: the owner's constants and path helpers
SPLIT_NAMES = {
    "IMS",
    "IMS_LENGTHS",
    "CAPS",
    "CAP2IMG",
    "IDS",
    "IMAGES",
    "FRAMES",
    "OFFSETS",
    "FRAMES_SUFFIX",
    "OFFSETS_SUFFIX",
    "split_path",
    "frames_files",
}
# calls that create or fill a file
WRITE_ATTRS = {
    "atomic_write_text",
    "atomic_write_bytes",
    "atomic_write_json",
    "atomic_save_npy",
    "atomic_path",
    "open_memmap",
    "write_text",
    "write_bytes",
    "tofile",
}
READ_ATTRS = {"read_text", "read_bytes", "loads", "load", "loads_bounded", "read_bounded"}
PRECOMP = Path("vsekit/data/precomp.py")
MANIFEST_OWNER = Path("vsekit/data/manifest.py")


def _modules() -> list[tuple[Path, ast.Module]]:
    out = []
    for pkg in (vsekit, vsekit_lab):
        base = Path(pkg.__file__).parent
        for path in sorted(base.rglob("*.py")):
            out.append((path.relative_to(base.parent), ast.parse(path.read_text(encoding="utf-8"))))
    assert len(out) > 100, "the scan found too few modules"
    return out


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _scopes(tree: ast.Module) -> list[tuple[str, list[ast.AST]]]:
    """(name, nodes) of every function (its whole body) and of the module's top level (outside functions)."""
    scopes = []
    top: list[ast.AST] = []

    def visit(node: ast.AST, into: list[ast.AST]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                scopes.append((child.name, list(ast.walk(child))))
            else:
                into.append(child)
                visit(child, into)

    visit(tree, top)
    return [("<module>", top), *scopes]


def _strings(nodes: list[ast.AST], docs: set[int]) -> list[str]:
    return [
        n.value
        for n in nodes
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs
    ]


def _call_name(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


def _target(call: ast.Call) -> ast.AST | None:
    """The expression naming the file a write call writes (its path argument, or `path.write_text`'s path)."""
    if _call_name(call) in ("write_text", "write_bytes", "tofile") and isinstance(call.func, ast.Attribute):
        return call.func.value
    return call.args[0] if call.args else None


def _writes(nodes: list[ast.AST]) -> list[tuple[str, ast.AST | None]]:
    """(call name, target expression) of every call in `nodes` that creates or fills a file."""
    found = []
    for n in nodes:
        if not isinstance(n, ast.Call):
            continue
        name = _call_name(n)
        f = n.func
        on_numpy = (
            isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in ("np", "numpy")
        )
        if name in WRITE_ATTRS or (on_numpy and name in ("save", "savez", "memmap")):
            found.append((name, _target(n)))
        elif name == "open" and isinstance(f, ast.Name):
            modes = list(n.args[1:2]) + [k.value for k in n.keywords if k.arg == "mode"]
            if any(isinstance(m, ast.Constant) and set(str(m.value)) & set("wax+") for m in modes):
                found.append(("open(w)", _target(n)))
    return found


def _bindings(nodes: list[ast.AST]) -> dict[str, list[ast.AST]]:
    """name -> the expressions assigned to it in the scope (`x = ...`, `a, b = (.., ..)`, `with ... as x`)."""
    out: dict[str, list[ast.AST]] = {}
    for n in nodes:
        pairs: list[tuple[ast.AST, ast.AST]] = []
        if isinstance(n, ast.Assign):
            pairs = [(t, n.value) for t in n.targets]
        elif isinstance(n, (ast.AnnAssign, ast.AugAssign)) and n.value is not None:
            pairs = [(n.target, n.value)]
        elif isinstance(n, ast.withitem) and n.optional_vars is not None:
            pairs = [(n.optional_vars, n.context_expr)]
        for target, value in pairs:
            if (
                isinstance(target, ast.Tuple)
                and isinstance(value, ast.Tuple)
                and len(target.elts) == len(value.elts)
            ):
                pairs += list(zip(target.elts, value.elts))
            elif isinstance(target, ast.Name):
                out.setdefault(target.id, []).append(value)
            elif isinstance(target, ast.Tuple):
                for e in target.elts:
                    if isinstance(e, ast.Name):
                        out.setdefault(e.id, []).append(value)
    return out


def _names_split_file(expr: ast.AST | None, bound: dict[str, list[ast.AST]], depth: int = 0) -> str | None:
    """What in `expr` (or in what its names were assigned, a few steps back) names a split file, if anything."""
    if expr is None or depth > 3:
        return None
    for n in ast.walk(expr):
        if (
            isinstance(n, ast.Constant)
            and isinstance(n.value, str)
            and any(x in n.value for x in SPLIT_SUFFIXES)
        ):
            return n.value
        if (
            isinstance(n, ast.Name)
            and n.id in SPLIT_NAMES
            or isinstance(n, ast.Attribute)
            and n.attr in SPLIT_NAMES
        ):
            return n.id if isinstance(n, ast.Name) else n.attr
        if isinstance(n, ast.Name):
            for value in bound.get(n.id, []):
                hit = _names_split_file(value, bound, depth + 1)
                if hit:
                    return hit
    return None


def _names(nodes: list[ast.AST]) -> set[str]:
    return {n.id for n in nodes if isinstance(n, ast.Name)} | {
        n.attr for n in nodes if isinstance(n, ast.Attribute)
    }


def test_owners_i_one_writer_of_precomp_split_files():
    """no function outside data/precomp.py writes a file whose path names a split file (`_caps.txt`,
    `_ims.npy`, ... or the owner's constants, directly or through a variable assigned in the function): every
    builder, library and lab, goes through `writing_split` / `write_precomp_split` / `write_frames`."""
    bad = []
    for rel, tree in _modules():
        if rel == PRECOMP:
            continue
        for name, nodes in _scopes(tree):
            bound = _bindings(nodes)
            for call, target in _writes(nodes):
                hit = _names_split_file(target, bound)
                if hit:
                    bad.append(f"{rel}:{name} writes {hit!r} itself ({call})")
    assert not bad, "split files written outside vsekit.data.precomp:\n" + "\n".join(bad)


def test_owners_i_no_suffix_tuples_outside_precomp():
    """the split files' suffixes are listed once; a module needing a list composes the owner's."""
    bad = []
    for rel, tree in _modules():
        if rel == PRECOMP:
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                hits = [
                    e.value
                    for e in node.elts
                    if isinstance(e, ast.Constant) and isinstance(e.value, str) and e.value in SPLIT_SUFFIXES
                ]
                if len(hits) >= 2:
                    bad.append(f"{rel}:{node.lineno} {hits}")
    assert not bad, "split-file suffix lists outside vsekit.data.precomp:\n" + "\n".join(bad)


def test_owners_ii_one_reader_and_writer_of_the_manifest():
    """only data/manifest.py builds the path `manifest.json`, and no function that names the
    manifest's file (`MANIFEST`, `manifest_path`) opens, reads, parses or writes it itself."""
    bad = []
    for rel, tree in _modules():
        if rel == MANIFEST_OWNER:
            continue
        docs = _docstrings(tree)
        for name, nodes in _scopes(tree):
            for s in _strings(nodes, docs):
                if s == "manifest.json" or s.endswith("/manifest.json"):
                    bad.append(f"{rel}:{name} spells {s!r}")
            if _names(nodes) & {"MANIFEST", "manifest_path"}:
                io_calls = [
                    _call_name(n)
                    for n in nodes
                    if isinstance(n, ast.Call)
                    and (
                        _call_name(n) in READ_ATTRS | {"atomic_write_json", "atomic_write_text", "write_text"}
                        or (_call_name(n) == "open" and isinstance(n.func, ast.Name))
                    )
                ]
                if io_calls:
                    bad.append(f"{rel}:{name} names the manifest and calls {io_calls[0]}")
    assert not bad, "manifest.json handled outside vsekit.data.manifest:\n" + "\n".join(bad)


def test_owners_ii_one_extractor_key_rule():
    """The keys a builder may record its extractor under are named by one module: the trainer (copying it
    into a run's config.json) and the index (comparing a dataset's with a run's) apply the same rule."""
    where = []
    for rel, tree in _modules():
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and node.value == "feature_extractor" and id(node) not in docs:
                where.append(str(rel))
    assert sorted(set(where)) == [str(MANIFEST_OWNER)], where


# ------------------------------------------------------------------------------------------ behaviour


def test_owners_i_writer_bytes_are_the_layout(tmp_path):
    """The writer's bytes, against hand-written text and numpy's own .npy bytes (the format stays the same)."""
    from vsekit.data.precomp import load_precomp_split, write_precomp_split

    feats = np.arange(2 * 3 * 4, dtype=np.float16).reshape(2, 3, 4)
    write_precomp_split(
        tmp_path,
        "dev",
        feats,
        ["a cat", "two dogs", "a bird"],
        np.array([0, 0, 1]),
        ["x", "y"],
        image_paths=["p/x.png", "p/y.png"],
    )
    buf = io.BytesIO()
    np.save(buf, feats, allow_pickle=False)
    assert (tmp_path / "dev_ims.npy").read_bytes() == buf.getvalue()
    assert (tmp_path / "dev_caps.txt").read_bytes() == b"a cat\ntwo dogs\na bird\n"
    assert (tmp_path / "dev_cap2img.txt").read_bytes() == b"0\n0\n1\n"
    assert (tmp_path / "dev_ids.txt").read_bytes() == b"x\ny\n"
    assert (tmp_path / "dev_images.txt").read_bytes() == b"p/x.png\np/y.png\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "dev_cap2img.txt",
        "dev_caps.txt",
        "dev_ids.txt",
        "dev_images.txt",
        "dev_ims.npy",
    ]  # no temp file left
    split = load_precomp_split(tmp_path, "dev")
    assert split.n_images == 2 and split.cap2img.tolist() == [0, 0, 1]


def test_owners_i_frames_writer_offsets_by_hand(tmp_path):
    """Frames through the one writer: offsets are the running sum of the clips' frame counts, written by hand."""
    from vsekit.data.precomp import write_frames

    clips = [np.ones((2, 3), np.float32), np.zeros((1, 3), np.float32), np.full((4, 3), 2, np.float32)]
    write_frames(tmp_path, "test", clips, dtype=np.float16)
    offsets = np.load(tmp_path / "test_frame_offsets.npy")
    frames = np.load(tmp_path / "test_frames.npy")
    assert offsets.dtype == np.int64 and offsets.tolist() == [0, 2, 3, 7]
    assert frames.dtype == np.float16 and frames.shape == (7, 3) and frames[3:].min() == 2


def test_owners_i_a_failed_split_write_publishes_nothing(tmp_path):
    """`writing_split` renames its files into place only when the block ends without an error: an earlier
    build's captions stay beside its own features, never beside half of a new one."""
    from vsekit.data.precomp import writing_split

    (tmp_path / "train_caps.txt").write_bytes(b"old\n")
    with pytest.raises(RuntimeError, match="stop"):
        with writing_split(tmp_path, "train") as w:
            w.captions(["new"])
            mm = w.memmap("_ims.npy", (3, 2, 2), np.float16)
            mm[:] = 1
            raise RuntimeError("stop")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train_caps.txt"]
    assert (tmp_path / "train_caps.txt").read_bytes() == b"old\n"


def test_owners_ii_manifest_reader_rules(tmp_path):
    """The one reader: absent is {}, not an object or not JSON is a ManifestError naming the file (a
    VseInputError: one line, exit 2 at the CLI)."""
    from vsekit.data.manifest import ManifestError, read_manifest, read_manifest_extractor
    from vsekit.errors import VseInputError

    assert read_manifest(tmp_path) == {}
    path = tmp_path / "manifest.json"
    path.write_text("[1, 2]")
    with pytest.raises(ManifestError, match=f"{path}: expected a JSON object") as e:
        read_manifest(tmp_path)
    assert isinstance(e.value, VseInputError)
    path.write_text("{not json")
    with pytest.raises(ManifestError, match=f"{path}: not valid JSON"):
        read_manifest(tmp_path)
    # the extractor rule: the first key holding an object with a name (a bare string is not a spec)
    spec = {"name": "efficientnet_lite0", "dim": 1280}
    path.write_text(json.dumps({"extractor": "efficientnet", "features": spec}))
    assert read_manifest_extractor(tmp_path) == spec


def test_owners_ii_manifest_read_is_bounded(tmp_path):
    """A huge `manifest.json` (a sparse 64 MiB file) is refused by size, read at most one byte past the cap,
    under a 1 GiB address-space limit."""
    (tmp_path / "manifest.json").touch()
    os.truncate(tmp_path / "manifest.json", 64 << 20)
    code = f"""
import resource
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from vsekit.data.manifest import ManifestError, read_manifest
try:
    read_manifest({str(tmp_path)!r})
except ManifestError as e:
    print("REFUSED", e)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED" in out.stdout and "manifest.json: larger than" in out.stdout


def test_owners_ii_check_warns_on_a_broken_manifest(tmp_path):
    """`vse data check` still warns (not fails) on a manifest that is not JSON, naming it."""
    from vsekit.data.precomp import write_precomp_split
    from vsekit.data.validate import check_dataset

    feats = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    for split in ("train", "dev", "test"):
        write_precomp_split(tmp_path, split, feats, [f"a photo {i}" for i in range(10)])
    (tmp_path / "manifest.json").write_text("{oops")
    report = check_dataset(tmp_path)
    warned = [p for p in report.warnings if Path(p.path) == tmp_path / "manifest.json"]
    assert warned and "not valid JSON" in warned[0].message and not report.errors
