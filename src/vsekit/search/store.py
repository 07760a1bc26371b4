"""The index store: an index folder on disk, read (`SearchIndex`) and written by one protocol.

INDEX_DIR/
  index.json                 written last and atomically: model fingerprint, FAISS settings, roots, segments
  segments/NNNN/             one per `vse index` call (incremental adds append a segment, never rewrite one;
                             `--refresh` writes the refreshed folder's pictures as one new segment: search/refresh.py)
    pictures.jsonl           {"root": i, "path": relative path, "caption": str|null, "id": str, "sha256": hex of the
                             file's bytes (pictures embedded from files; what --refresh compares)} per picture
    image_emb.npy            float32 [n, F]: the model's full image embeddings (re-ranking, rebuilding), F values of
                             index.json's `image_emb_shape`: [D]; [views, D] (multi-view); or for a late-interaction
                             run *set embeddings* [S, D], each picture's set of region vectors padded with zero rows
                             to S (a zero row is padding, as the model's sets mark it: no lengths file is needed)
    captions.jsonl           {"text": str, "image": global picture id|null} per caption (image -> text search)
    caption_emb.npy          float32 [m, D]
  images.gN.faiss            inner-product index over the pictures' proxy vectors (generation N)
  captions.gN.faiss          the same over the captions
  .work/JOB/chunk_*.npz      finished encoding chunks of an interrupted run; reused on restart, then removed
  .lock                      held (flock) by the one `vse index` writing here; records its pid, removed when it exits

The writing protocol, the same for a build, an incremental add (`append_segment`) and a refresh: one writer at a
time (`writing`: the folder lock, and everything new removed when the writer fails before the switch); new
segment folders (`write_segment`) and a new generation of FAISS files under new names, then index.json replaced
in one rename (`commit_generation`, the only writer of index.json), then the files the old index.json listed and
the new one does not are deleted. A reader that opens index.json therefore always sees a consistent set of files.
Picture paths are stored relative to a recorded root, and are only ever resolved inside it (the server depends
on that).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict
from pathlib import Path

import numpy as np

from vsekit.data.precomp import read_lines
from vsekit.errors import VseInputError
from vsekit.search.faiss_index import (
    IVF_KINDS,
    FaissParams,
    RefinedIndex,
    build_caption_faiss,
    build_faiss,
    import_faiss,
    tune_faiss,
    write_faiss,
)
from vsekit.search.proxies import picture_proxies, view_width
from vsekit.search.sources import path_kind
from vsekit.utils.io import (
    StorageFullError,
    atomic_save_npy,
    atomic_write_json,
    atomic_write_text,
    file_stamp,
    storage_full_errno,
    storage_full_error,
)
from vsekit.utils.locks import folder_lock

INDEX_FORMAT = "vsekit-index/1"
LOCK_NAME = ".lock"
SEGMENT_FILES = ("pictures.jsonl", "image_emb.npy", "captions.jsonl", "caption_emb.npy")
# An IVF index's lists were fitted to the vectors present when it was built. Once it holds more than
# RETRAIN_GROWTH times that many, an incremental add re-trains the lists on a fresh sample of all stored
# embeddings and rebuilds the index (nlist re-chosen when automatic) instead of appending to stale lists.
RETRAIN_GROWTH = 2.0

logger = logging.getLogger(__name__)


class IndexFormatError(VseInputError):
    """An index directory that cannot be read or extended safely; the message names the file."""


# ------------------------------------------------------------------------------------------ reading


def _missing(path: Path) -> str:
    """Why an index file is not there: "missing", or "is a folder, expected a file"."""
    return "missing" if not path.exists() else f"{path_kind(path)}, expected a file"


def _read_jsonl(path: Path) -> list[dict]:
    if not path.is_file():
        raise IndexFormatError(f"{path}: {_missing(path)} (the index directory is incomplete)")
    out = []
    for lineno, line in enumerate(read_lines(path), 1):
        try:
            item = json.loads(line)
        except json.JSONDecodeError as e:
            raise IndexFormatError(f"{path}:{lineno}: not valid JSON ({e})") from e
        if not isinstance(item, dict):
            raise IndexFormatError(f"{path}:{lineno}: expected a JSON object")
        out.append(item)
    return out


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def _load_emb(path: Path, rows: int, mmap: bool) -> np.ndarray:
    if not path.is_file():
        raise IndexFormatError(f"{path}: {_missing(path)} (the index directory is incomplete)")
    try:
        arr = np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise IndexFormatError(f"{path}: not a readable .npy array ({e})") from e
    if arr.ndim != 2 or arr.shape[0] != rows or arr.dtype != np.float32:
        raise IndexFormatError(f"{path}: expected float32 [{rows}, dim], got {arr.dtype} {list(arr.shape)}")
    return arr


def _read_faiss(path: Path):
    faiss = import_faiss()
    if not path.is_file():
        raise IndexFormatError(f"{path}: {_missing(path)} (the index directory is incomplete)")
    try:
        return faiss.read_index(str(path))
    except RuntimeError as e:
        raise IndexFormatError(f"{path}: not a readable FAISS index ({str(e).splitlines()[0]})") from e


class SearchIndex:
    """An index directory opened for searching: metadata in memory, embeddings memory-mapped."""

    def __init__(self, index_dir: str | Path, mmap: bool = True) -> None:
        self.dir = Path(index_dir)
        meta_path = self.dir / "index.json"
        if self.dir.exists() and not self.dir.is_dir():
            raise IndexFormatError(
                f"{self.dir}: {path_kind(self.dir)}, expected an index folder (built by `vse index`)"
            )
        if meta_path.exists() and not meta_path.is_file():
            raise IndexFormatError(f"{meta_path}: {path_kind(meta_path)}, expected the index's JSON file")
        if not meta_path.is_file():
            raise IndexFormatError(
                f"{self.dir}: not a vsekit index (no index.json); build one with `vse index`"
            )
        try:
            self.meta = json.loads(meta_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise IndexFormatError(f"{meta_path}: not valid JSON ({e})") from e
        if not isinstance(self.meta, dict) or self.meta.get("format") != INDEX_FORMAT:
            raise IndexFormatError(
                f"{meta_path}: format {self.meta.get('format') if isinstance(self.meta, dict) else None!r}; "
                f"this vsekit reads {INDEX_FORMAT}"
            )
        try:
            self.roots = [Path(r) for r in self.meta["roots"]]
            self.params = FaissParams(**self.meta["faiss"])
            segments = self.meta["segments"]
            files = self.meta["files"]
        except (KeyError, TypeError) as e:
            raise IndexFormatError(f"{meta_path}: missing or malformed field ({e})") from e
        self.pictures: list[dict] = []
        self.captions: list[dict] = []
        self._img: list[np.ndarray] = []
        self._cap: list[np.ndarray] = []
        for seg in segments:
            sdir = self.dir / seg["dir"]
            pics = _read_jsonl(sdir / "pictures.jsonl")
            caps = _read_jsonl(sdir / "captions.jsonl")
            for lineno, p in enumerate(pics, 1):
                if (
                    not isinstance(p.get("path"), str)
                    or not isinstance(p.get("root"), int)
                    or not 0 <= p["root"] < len(self.roots)
                ):
                    raise IndexFormatError(
                        f"{sdir / 'pictures.jsonl'}:{lineno}: needs a 'path' string and a valid 'root'"
                    )
            self.pictures += pics
            self.captions += caps
            self._img.append(_load_emb(sdir / "image_emb.npy", len(pics), mmap))
            self._cap.append(_load_emb(sdir / "caption_emb.npy", len(caps), mmap) if caps else None)
        self._img_offsets = np.cumsum([0] + [len(a) for a in self._img])
        self._cap_offsets = np.cumsum([0] + [0 if a is None else len(a) for a in self._cap])
        self.image_faiss = _read_faiss(self.dir / files["images"])
        self.caption_faiss = _read_faiss(self.dir / files["captions"]) if files.get("captions") else None
        if self.image_faiss.ntotal != len(self.pictures):
            raise IndexFormatError(
                f"{self.dir / files['images']}: holds {self.image_faiss.ntotal} vectors but the "
                f"segments list {len(self.pictures)} pictures"
            )
        n_caps = 0 if self.caption_faiss is None else self.caption_faiss.ntotal
        if n_caps != len(self.captions):
            raise IndexFormatError(
                f"{self.dir}: caption index holds {n_caps} vectors for {len(self.captions)} captions"
            )
        if self.params.kind == "ivfpq" and self.params.refine:
            self.image_faiss = RefinedIndex(
                self.image_faiss, lambda ids: self.proxies(self.image_emb(ids)), self.params.refine
            )
            if self.caption_faiss is not None and type(self.caption_faiss).__name__ == "IndexIVFPQ":
                self.caption_faiss = RefinedIndex(self.caption_faiss, self.caption_emb, self.params.refine)
        tune_faiss(self.image_faiss, self.params)
        if self.caption_faiss is not None:
            tune_faiss(self.caption_faiss, self.params)

    def proxies(self, image_emb: np.ndarray) -> np.ndarray:
        """The inner-product vectors of this index's pictures (`search.proxies`: the embedding, or the
        normalised mean of its views) of image embeddings as stored here."""
        model = self.meta.get("model") or {}
        views = view_width(
            self.meta.get("image_emb_shape") or [], model.get("embed_dim"), bool(model.get("rerank"))
        )
        return picture_proxies(image_emb, views)

    @property
    def n_pictures(self) -> int:
        return len(self.pictures)

    @property
    def n_captions(self) -> int:
        return len(self.captions)

    def set_search_params(self, nprobe: int | None = None, ef_search: int | None = None) -> None:
        if nprobe is not None:
            self.params.nprobe = nprobe
        if ef_search is not None:
            self.params.ef_search = ef_search
        self.params.validate()
        for idx in (self.image_faiss, self.caption_faiss):
            if idx is not None:
                tune_faiss(idx, self.params)

    def _gather(self, parts: list, offsets: np.ndarray, ids: np.ndarray) -> np.ndarray:
        seg = np.searchsorted(offsets, ids, side="right") - 1
        return (
            np.stack([np.asarray(parts[s][i - offsets[s]]) for s, i in zip(seg, ids)]) if len(ids) else None
        )

    def image_emb(self, ids: np.ndarray) -> np.ndarray:
        """Full image embeddings [len(ids), F] of pictures by global id."""
        return self._gather(self._img, self._img_offsets, np.asarray(ids, dtype=np.int64))

    def caption_emb(self, ids: np.ndarray) -> np.ndarray:
        return self._gather(self._cap, self._cap_offsets, np.asarray(ids, dtype=np.int64))

    def all_image_emb(self) -> np.ndarray:
        return (
            np.concatenate([np.asarray(a) for a in self._img]) if self._img else np.zeros((0, 0), np.float32)
        )

    def segment_spans(self) -> list[tuple[range, range]]:
        """Per segment (in index.json's order): the global ids of its pictures and of its captions."""
        return [
            (
                range(int(self._img_offsets[s]), int(self._img_offsets[s + 1])),
                range(int(self._cap_offsets[s]), int(self._cap_offsets[s + 1])),
            )
            for s in range(len(self._img))
        ]

    def segment_arrays(self, s: int) -> tuple[np.ndarray, np.ndarray | None]:
        """Segment `s`'s stored (memory-mapped) image and caption embeddings (None: it has no captions)."""
        return self._img[s], self._cap[s]

    def picture_file(self, i: int) -> Path | None:
        """The picture's file, or None when it is missing or would resolve outside its recorded root."""
        if not 0 <= i < len(self.pictures):
            return None
        pic = self.pictures[i]
        root = self.roots[pic["root"]].resolve()
        try:
            path = (root / pic["path"]).resolve()
        except (OSError, RuntimeError):
            return None
        if not path.is_relative_to(root) or not path.is_file():
            return None
        return path


def check_same_model(meta: dict, fingerprint: dict, out_dir: Path) -> None:
    """Refuse to add embeddings of another model (other weights) to the index in `out_dir`."""
    old = meta.get("model", {})
    if old.get("weights_sha256") != fingerprint["weights_sha256"]:
        raise IndexFormatError(
            f"{out_dir / 'index.json'}: built with {old.get('run_dir')}/{old.get('weights')} "
            f"(sha256 {str(old.get('weights_sha256'))[:12]}), not with {fingerprint['run_dir']}/{fingerprint['weights']} "
            f"(sha256 {fingerprint['weights_sha256'][:12]}); embeddings of two models cannot share an index — use a new --out"
        )


# ------------------------------------------------------------------------------ one writer at a time


@contextmanager
def writer_lock(out_dir: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """One writer per index directory: two `vse index` runs adding to the same index at once would both write
    segment N and one would be lost, so the second fails fast instead, naming the pid that holds the lock
    (`vsekit.utils.locks.folder_lock`: removed on every exit; an `--out` it created is removed when empty)."""
    with folder_lock(out_dir, "`vse index`", "this index", IndexFormatError, log, LOCK_NAME):
        yield


_LEFTOVER = re.compile(
    r"(images|captions)\.g\d+\.faiss|\.(index\.json|(images|captions)\.g\d+\.faiss)\..+\.tmp"
)


def _first_build_leftovers(out_dir: Path) -> list[Path] | None:
    """What a first `vse index` killed outright (SIGKILL, power cut) leaves in a folder without index.json:
    segments/NNNN folders and FAISS / temp files no index.json lists. None when the folder holds anything
    else (then it is not ours to clear)."""
    found = []
    for p in out_dir.iterdir():
        if p.name in (".work", LOCK_NAME):
            continue
        if p.name == "segments" and p.is_dir() and all(q.name.isdigit() and q.is_dir() for q in p.iterdir()):
            found.append(p)
        elif _LEFTOVER.fullmatch(p.name) and p.is_file():
            found.append(p)
        else:
            return None
    return found


def check_new_out(out_dir: Path, log: Callable[[str], None]) -> None:
    """A first build needs an empty folder (or one holding only its own .work/.lock): refuse anything else,
    and clear what a killed first build left, so its rerun is not refused."""
    if not out_dir.exists():
        return
    leftovers = _first_build_leftovers(out_dir)
    if leftovers is None:
        raise IndexFormatError(
            f"{out_dir}: exists, is not empty and holds no index.json; choose an empty or new --out"
        )
    if leftovers:
        log(
            f"note: {out_dir}: removing what an unfinished first `vse index` left ({', '.join(sorted(p.name for p in leftovers))})"
        )
        for p in leftovers:
            shutil.rmtree(p) if p.is_dir() else p.unlink()


@contextmanager
def _undo_on_failure(out_dir: Path) -> Iterator[None]:
    """Remove what this run created in `out_dir` when it fails before switching index.json over, and never
    anything that was there before: new top-level files and folders, new segments/NNNN, new .work/JOB. After
    Ctrl-C the finished chunks in .work are kept (the rerun resumes from them); after an error they are not
    (the folder is left as it was, so a rerun is never refused because of this run)."""

    def listing(d: Path) -> set[str]:
        try:
            return set(os.listdir(d))
        except OSError:
            return set()

    before = {
        ".": listing(out_dir),
        "segments": listing(out_dir / "segments"),
        ".work": listing(out_dir / ".work"),
    }
    stamp = file_stamp(out_dir / "index.json")
    try:
        yield
    except BaseException as e:
        if (
            file_stamp(out_dir / "index.json") == stamp
        ):  # not committed: nothing of this run is listed anywhere
            keep_work = isinstance(e, KeyboardInterrupt)
            for sub in ("segments", ".work"):
                if sub in before["."] and not (sub == ".work" and keep_work):
                    for name in listing(out_dir / sub) - before[sub]:
                        shutil.rmtree(out_dir / sub / name, ignore_errors=True)
            for name in listing(out_dir) - before["."] - {LOCK_NAME}:
                if name == ".work" and keep_work:
                    continue
                path = out_dir / name
                with contextlib.suppress(OSError):
                    shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        raise


def segment_dir_name(number: int) -> str:
    """`segments/NNNN`: where segment `number` of an index lives."""
    return f"segments/{number:04d}"


def next_segment_number(meta: dict | None) -> int:
    """The number of the next new segment folder: one past every folder index.json lists (a refresh drops and
    renumbers segments, so their count is not enough: a new folder must never be one that is still listed)."""
    if not meta:
        return 0
    listed = [
        int(m.group(1))
        for seg in meta["segments"]
        if (m := re.fullmatch(r"segments/(\d+)", str(seg.get("dir"))))
    ]
    return max(len(meta["segments"]), max(listed, default=-1) + 1)


# ------------------------------------------------------------------------------------------ writing


@contextmanager
def writing(out_dir: Path, log: Callable[[str], None] = print) -> Iterator[None]:
    """The one writer of `out_dir` (`writer_lock`), whose new files are removed when it fails before
    `commit_generation` switched index.json over (`_undo_on_failure`). A write stopped by a full disk, quota
    or file-size limit is a `StorageFullError` naming the file and the free space (the index kept as it was)."""
    try:
        with writer_lock(Path(out_dir), log), _undo_on_failure(Path(out_dir)):
            yield
    except (OSError, RuntimeError, StorageFullError) as e:  # a full disk, quota or file-size limit: one line
        if storage_full_errno(e) is None:
            raise
        kept = f"{out_dir} is as it was before this run" if (Path(out_dir) / "index.json").is_file() else ""
        raise storage_full_error(getattr(e, "filename", None) or out_dir, e, kept) from e


def timestamp() -> str:
    """The local time as index.json records it (`created`, `updated`, a segment's `added`)."""
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def _link_or_copy(src: Path, dst: Path) -> None:
    """`dst` as a hard link to `src` (index files are never rewritten in place, only replaced, so the two names
    can share one file), or a synced copy where the file system has no hard links."""
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())


def write_segment(
    out_dir: Path,
    number: int,
    pictures: list[dict] | Path,
    image_emb: np.ndarray | Path,
    captions: list[dict] | Path,
    caption_emb: np.ndarray | Path,
) -> str:
    """Write segment folder `number` (unlisted until `commit_generation` names it) and return its name in
    index.json (`segments/NNNN`). Each file is given as its rows / array, or as the Path of an existing
    segment's file with the same content, which is hard-linked (copied where links fail). A folder of that name
    that no index.json lists is a killed writer's leftover and is replaced."""
    seg_rel = segment_dir_name(number)
    seg_dir = Path(out_dir) / seg_rel
    if seg_dir.exists():
        shutil.rmtree(seg_dir)
    seg_dir.mkdir(parents=True)
    for name, value in zip(SEGMENT_FILES, (pictures, image_emb, captions, caption_emb)):
        if isinstance(value, Path):
            _link_or_copy(value, seg_dir / name)
        elif name.endswith(".jsonl"):
            _write_jsonl(seg_dir / name, value)
        else:
            atomic_save_npy(seg_dir / name, np.asarray(value, dtype=np.float32))
    return seg_rel


def commit_generation(
    out_dir: Path,
    old: SearchIndex | None,
    *,
    fingerprint: dict,
    params: FaissParams,
    roots: list[str],
    emb_shape: list[int],
    segments: list[dict],
    image_index,
    caption_index,
    counts: dict,
    now: str,
) -> dict:
    """Switch the index in `out_dir` over to `segments` (already written) and the given FAISS indexes: write the
    indexes as the next generation's files, then index.json in one rename (the commit point), then delete what
    the old index.json listed and this one does not, and segment folders no index.json lists (a killed writer's).
    Readers that opened the old index.json keep their open files. Returns the new index.json contents."""
    out_dir = Path(out_dir)
    gen = int(old.meta["generation"]) + 1 if old else 1
    files = {
        "images": f"images.g{gen}.faiss",
        "captions": f"captions.g{gen}.faiss" if caption_index is not None else None,
    }
    write_faiss(image_index, out_dir / files["images"])
    if caption_index is not None:
        write_faiss(caption_index, out_dir / files["captions"])
    meta = {
        "format": INDEX_FORMAT,
        "generation": gen,
        "created": old.meta["created"] if old else now,
        "updated": now,
        "model": fingerprint,
        "image_emb_shape": list(emb_shape),
        "faiss": asdict(params),
        "roots": roots,
        "segments": segments,
        "files": files,
        "counts": counts,
    }
    atomic_write_json(out_dir / "index.json", meta)
    if old is not None:
        for name in old.meta["files"].values():
            if name and name not in files.values():
                (out_dir / name).unlink(missing_ok=True)
    listed = {seg["dir"] for seg in segments}
    for d in sorted((out_dir / "segments").iterdir()) if (out_dir / "segments").is_dir() else []:
        if d.is_dir() and f"segments/{d.name}" not in listed:
            shutil.rmtree(d, ignore_errors=True)
    return meta


def append_segment(
    out_dir: Path,
    old: SearchIndex | None,
    *,
    fingerprint: dict,
    params: FaissParams,
    roots: list[str],
    pictures: list[dict],
    image_emb: np.ndarray,
    emb_shape: list[int],
    proxies: np.ndarray,
    captions: list[dict],
    caption_emb: np.ndarray,
    segment: dict,
) -> dict:
    """Write one segment, extend (or build) the FAISS indexes, then switch index.json over to them
    (`commit_generation`) — a crash at any point leaves a readable index."""
    out_dir = Path(out_dir)
    seg_rel = write_segment(
        out_dir, next_segment_number(old.meta if old else None), pictures, image_emb, captions, caption_emb
    )
    if old is None:
        img_index = build_faiss(proxies, params)
    else:
        img_index = old.image_faiss
        total = img_index.ntotal + len(proxies)
        trained = params.trained_on or int(
            old.meta["segments"][0]["pictures"]
        )  # indexes from before the rule
        if params.kind in IVF_KINDS and total > RETRAIN_GROWTH * trained:
            logger.info(
                "%s: %d vectors, more than %g x the %d its IVF lists were trained on: re-training them on "
                "a fresh sample and rebuilding the index",
                out_dir,
                total,
                RETRAIN_GROWTH,
                trained,
            )
            stored = old.proxies(old.all_image_emb())
            img_index = build_faiss(np.concatenate([stored, np.asarray(proxies, dtype=np.float32)]), params)
        else:
            img_index.add(np.ascontiguousarray(proxies, dtype=np.float32))
    cap_index = old.caption_faiss if old else None
    if cap_index is None and captions:
        cap_index = build_caption_faiss(caption_emb, params)
    elif cap_index is not None and captions:
        cap_index.add(np.ascontiguousarray(caption_emb, dtype=np.float32))
    now = timestamp()
    entry = {"dir": seg_rel, "pictures": len(pictures), "captions": len(captions), **segment, "added": now}
    counts = {
        "pictures": (old.n_pictures if old else 0) + len(pictures),
        "captions": (old.n_captions if old else 0) + len(captions),
    }
    return commit_generation(
        out_dir,
        old,
        fingerprint=fingerprint,
        params=params,
        roots=roots,
        emb_shape=emb_shape,
        segments=(old.meta["segments"] if old else []) + [entry],
        image_index=img_index,
        caption_index=cap_index,
        counts=counts,
        now=now,
    )
