"""`vse embed`: a trained run's embeddings of many pictures / captions, in clip-retrieval's folder layout.

    OUT/
      img_emb/img_emb_N.npy           float32 [rows, F]: image embeddings of chunk N (F = D, or views*D for AVSE)
      text_emb/text_emb_N.npy         float32 [rows, D]: the caption of each row (when every row has one)
      metadata/metadata_N.parquet     one row per embedding: image_path, caption, id (clip-retrieval's columns)
      embed.json                      written last: model fingerprint, input, chunks, dims (vsekit's addition)
      .manifest/job.json              the plan (model, input, rows, chunk size); a restart must match it
      .manifest/chunk_N.json          written after chunk N's three files: the chunk is finished

N is zero-padded to the width of the last chunk number (as clip-retrieval's writer does), so the files sort
in row order. autofaiss / embedding-reader / clip-retrieval's `clip_index` read `img_emb/` + `metadata/`
directly, and `vse index --from-embeddings OUT` builds vsekit's own index from it with no model forward.

Chunks are the unit of resumption and of data parallelism: a chunk whose manifest entry exists is never
recomputed (a killed run restarts at the first unfinished chunk; a half-written chunk has no entry and is
redone, its files overwritten atomically), and under `torchrun` rank r embeds chunks r, r+W, r+2W, … — each
chunk is computed exactly as a single process would (same rows, same batches), so the folder is the same.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from vsekit.errors import VseInputError
from vsekit.search.embedding_folder import (  # noqa: F401  (the reading side, public here too)
    EMBED_FORMAT,
    MANIFEST_DIR,
    EmbeddingFolder,
    open_embedding_folder,
    pyarrow_modules,
)
from vsekit.utils.io import atomic_path, atomic_save_npy, atomic_write_json

log = logging.getLogger(__name__)


def chunk_name(c: int, n_chunks: int) -> str:
    """Chunk number zero-padded like clip-retrieval (`int(log10(count)) + 1` digits), so files sort in order."""
    return str(c).zfill(int(math.log10(max(1, n_chunks))) + 1)


def chunk_files(out: Path, name: str) -> dict[str, Path]:
    return {
        "img": out / "img_emb" / f"img_emb_{name}.npy",
        "text": out / "text_emb" / f"text_emb_{name}.npy",
        "meta": out / "metadata" / f"metadata_{name}.parquet",
    }


def write_chunk(
    out: Path,
    name: str,
    img: np.ndarray | None,
    text: np.ndarray | None,
    columns: dict[str, list],
    entry: dict,
) -> None:
    """Write one chunk's files, each atomically, then its manifest entry (which marks the chunk finished)."""
    pa, pq = pyarrow_modules()
    files = chunk_files(out, name)
    if img is not None:
        files["img"].parent.mkdir(parents=True, exist_ok=True)
        atomic_save_npy(files["img"], np.ascontiguousarray(img, dtype=np.float32))
    if text is not None:
        files["text"].parent.mkdir(parents=True, exist_ok=True)
        atomic_save_npy(files["text"], np.ascontiguousarray(text, dtype=np.float32))
    files["meta"].parent.mkdir(parents=True, exist_ok=True)
    table = pa.table({k: pa.array(v, type=pa.string()) for k, v in columns.items()})
    with atomic_path(files["meta"]) as tmp:
        pq.write_table(table, str(tmp))
    (out / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / MANIFEST_DIR / f"chunk_{name}.json", entry)


# ------------------------------------------------------------------------------------------- inputs


@dataclass
class EmbedInput:
    """What to embed, row by row: pictures (a folder / a dataset split) or captions (a text file)."""

    kind: str  # "pictures" or "captions"
    label: str
    root: str | None
    keys: list[
        str
    ]  # image_path per row (absolute path, or SPLIT:ROW for a features-only split), or the caption
    ids: list[str]
    captions: list[str | None]
    source: Any = None  # the index.Source of a picture input
    extra: dict = field(default_factory=dict)


def resolve_input(spec: str, captions_per_image: int = 5) -> EmbedInput:
    """INPUT of `vse embed`: a `.txt` file of captions (one per line), else what `vse index` takes (a folder of
    pictures, DATASET_DIR:SPLIT, a dataset directory, one picture)."""
    from vsekit.data.precomp import read_lines
    from vsekit.search.sources import resolve_source

    path = Path(spec)
    if path.is_file() and path.suffix.lower() == ".txt":
        lines = [s.strip() for s in read_lines(path) if s.strip()]
        if not lines:
            raise VseInputError(f"{path}: no captions (one per line expected)")
        return EmbedInput(
            "captions", str(path), None, lines, [str(i) for i in range(len(lines))], list(lines)
        )
    src = resolve_source(spec, captions_per_image)
    keys = [p if src.features_only else str(src.root / p) for p in src.paths]
    return EmbedInput("pictures", src.label, str(src.root), keys, list(src.ids), src.first_caption(), src)


# ------------------------------------------------------------------------------------------ the job


def _collate(batch: list) -> list:
    return batch


class _Rows:
    """A map-style dataset over row numbers: (row, loaded input or None, error message or None). Decoding runs
    in DataLoader workers; an unreadable picture becomes an error message instead of killing the worker."""

    def __init__(self, rows: list[int], load: Callable[[int], Any]) -> None:
        self.rows, self.load = rows, load

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        from vsekit.data.precomp import DataFormatError

        row = self.rows[i]
        try:
            return row, self.load(row), None
        except DataFormatError as e:
            return row, None, str(e)


def embed_to_folder(
    run_dir: str | Path,
    spec: str,
    out_dir: str | Path,
    *,
    checkpoint: str = "best",
    device: Any = "cpu",
    batch_size: int = 64,
    chunk_size: int = 10_000,
    workers: int = 0,
    pixels: bool = False,
    strict: bool = False,
    progress: bool = True,
    rank: int = 0,
    world_size: int = 1,
    barrier: Callable[[], None] | None = None,
) -> dict | None:
    """Embed INPUT with a trained run into OUT (clip-retrieval layout), chunk by chunk, resumably.

    `rank`/`world_size`: this process embeds chunks c with c % world_size == rank; `barrier` (a collective)
    separates planning, embedding and the final embed.json, which rank 0 writes. Returns embed.json's
    contents on rank 0 (None elsewhere).
    """
    import torch

    from vsekit.data.precomp import DataFormatError
    from vsekit.runs import load_run
    from vsekit.search.build import model_fingerprint, use_stored_features
    from vsekit.search.chunks import chunk_batches
    from vsekit.search.encode import (
        ImageEmbedder,
        TextEmbedder,
        embed_features,
    )
    from vsekit.utils.progress import progress_bar

    if chunk_size < 1 or batch_size < 1 or workers < 0:
        raise VseInputError("--chunk-size and --batch-size must be >= 1 and --workers >= 0")
    barrier = barrier or (lambda: None)
    run_dir, out = Path(run_dir), Path(out_dir)
    device = torch.device(device)
    model, run_cfg = load_run(run_dir, checkpoint, device)
    model.eval()
    fingerprint = model_fingerprint(run_dir, checkpoint, model)
    inp = resolve_input(spec, model.recipe.data.captions_per_image)
    # files left out before any embedding (names that are not UTF-8, caption files that are not UTF-8 text)
    input_skipped = list(inp.source.problems) if inp.source is not None else []
    if strict and input_skipped:
        raise DataFormatError(input_skipped[0])

    load: Callable[[int], Any]
    embed: Callable[[list], Any] | None = None
    mode: dict = {"mode": "captions"}
    if inp.kind == "pictures":
        src = inp.source
        use_features = use_stored_features(src, model, pixels, run_cfg, run_dir)
        if use_features:
            from vsekit.data.validate import check_split_features

            check_split_features(src.split)
            split = src.split
            mode = {"mode": "features", "dataset": src.label}

            def load(i: int):
                return split.image_features(i)

            def embed(items: list):
                return embed_features(model, items, device)
        else:
            embedder = ImageEmbedder(model, run_cfg, device)
            mode = embedder.describe()
            root = src.root
            paths = src.paths

            def load(i: int):
                return embedder.load(root / paths[i])

            def embed(items: list):
                return embedder.embed(torch.stack(items))
    else:

        def load(i: int):
            return None

    n = len(inp.keys)
    n_chunks = (n + chunk_size - 1) // chunk_size
    with_text = all(c is not None for c in inp.captions)
    with_image = inp.kind == "pictures"
    job = {
        "format": EMBED_FORMAT,
        "model": fingerprint,
        "input": inp.label,
        "kind": inp.kind,
        "root": inp.root,
        "embedded_from": mode,
        "rows": n,
        "chunk_size": chunk_size,
        "chunks": n_chunks,
        "with_image": with_image,
        "with_text": with_text,
        "rows_sha256": hashlib.sha256(json.dumps(inp.keys).encode()).hexdigest(),
        "input_skipped": input_skipped,
    }
    _check_out(out, job)
    barrier()  # every rank has checked the folder before rank 0 writes the plan into it
    if rank == 0 and not (out / MANIFEST_DIR / "job.json").is_file():
        (out / MANIFEST_DIR).mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / MANIFEST_DIR / "job.json", job)
    barrier()

    names = [chunk_name(c, n_chunks) for c in range(n_chunks)]
    mine = [c for c in range(n_chunks) if c % world_size == rank]
    todo = [c for c in mine if not _finished(out, names[c], with_image, with_text)]
    done_rows = sum(min(chunk_size, n - c * chunk_size) for c in mine if c not in todo)
    if len(todo) < len(mine):
        log.info(
            "%s: %d of %d chunks already finished; embedding %d",
            out,
            len(mine) - len(todo),
            len(mine),
            len(todo),
        )
    text_embedder = TextEmbedder(model, device) if with_text else None
    unit = "img" if with_image else "caption"
    bar = progress_bar(
        total=sum(min(chunk_size, n - c * chunk_size) for c in mine),
        initial=done_rows,
        desc=f"embed{f' (rank {rank})' if world_size > 1 else ''}",
        unit=unit,
        enabled=progress and rank == 0,
    )
    # each chunk in its own batches, starting at its first row (chunk_batches): a resumed run, or a rank of
    # torchrun, encodes a chunk exactly as an uninterrupted single process does, so its files are bit-identical
    plan = {c: chunk_batches(c * chunk_size, min(n, (c + 1) * chunk_size), batch_size) for c in todo}
    batches = [list(b) for c in todo for b in plan[c]]
    loader: Any = []
    if with_image and batches:
        from torch.utils.data import DataLoader

        loader = DataLoader(
            _Rows(list(range(n)), load), batch_sampler=batches, collate_fn=_collate, num_workers=workers
        )
    batch_iter = iter(loader)
    for c in todo:
        lo, hi = c * chunk_size, min(n, (c + 1) * chunk_size)
        rows: list[int] = []
        embs, problems = [], []
        if with_image:
            for _ in plan[c]:
                items = []
                got = next(batch_iter)
                for row, item, err in got:
                    if err is not None:
                        if strict:
                            raise DataFormatError(err)
                        problems.append(err)
                        continue
                    rows.append(row)
                    items.append(item)
                if items:
                    e = embed(items)
                    embs.append(e.reshape(e.shape[0], -1).float().cpu().numpy())
                bar.update(len(got))
        else:
            rows = list(range(lo, hi))
        img = np.concatenate(embs) if embs else (np.zeros((0, 0), np.float32) if with_image else None)
        text = None
        if with_text:
            text = text_embedder.embed([inp.captions[r] for r in rows]).numpy()
            if not with_image:
                bar.update(len(rows))
        columns: dict[str, list] = {}
        if with_image:
            columns["image_path"] = [inp.keys[r] for r in rows]
        columns["caption"] = [inp.captions[r] for r in rows]
        columns["id"] = [inp.ids[r] for r in rows]
        shape = list(e.shape[1:]) if with_image and embs else None
        entry = {
            "chunk": c,
            "first_row": lo,
            "rows": len(rows),
            "skipped": problems,
            "image_emb_shape": shape,
        }
        write_chunk(out, names[c], img, text, columns, entry)
    bar.close()
    barrier()  # all chunks are written
    if rank != 0:
        return None
    return _finish(out, job, names)


def _check_out(out: Path, job: dict) -> None:
    """A new or empty folder, or one holding an unfinished/finished run of this same job."""
    if out.exists() and not out.is_dir():
        raise VseInputError(f"{out}: exists and is not a folder; choose another --out")
    plan = out / MANIFEST_DIR / "job.json"
    if plan.is_file():
        try:
            old = json.loads(plan.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise VseInputError(f"{plan}: not valid JSON ({e}); delete {out} and run again") from e
        keys = ("format", "input", "kind", "rows", "chunk_size", "rows_sha256", "embedded_from")
        diff = [k for k in keys if old.get(k) != job.get(k)]
        if old.get("model", {}).get("weights_sha256") != job["model"]["weights_sha256"]:
            diff.insert(0, "model weights")
        if diff:
            raise VseInputError(
                f"{plan}: {out} holds embeddings of another job (differs in {', '.join(diff)}); "
                "use a new --out, or the same run, input and --chunk-size to resume"
            )
    elif out.is_dir() and any(out.iterdir()):
        raise VseInputError(
            f"{out}: exists, is not empty and holds no {MANIFEST_DIR}/job.json; choose an empty or new --out"
        )


def _finished(out: Path, name: str, with_image: bool, with_text: bool) -> bool:
    files = chunk_files(out, name)
    need = [files["meta"]] + ([files["img"]] if with_image else []) + ([files["text"]] if with_text else [])
    return (out / MANIFEST_DIR / f"chunk_{name}.json").is_file() and all(p.is_file() for p in need)


def _finish(out: Path, job: dict, names: list[str]) -> dict:
    """embed.json: the plan plus what every chunk holds (rows kept, pictures skipped, embedding shape)."""
    chunks, skipped, shape = [], list(job.get("input_skipped") or []), None
    for name in names:
        path = out / MANIFEST_DIR / f"chunk_{name}.json"
        if not path.is_file():
            raise VseInputError(
                f"{path}: missing after every rank finished; run `vse embed` again to redo it"
            )
        e = json.loads(path.read_text(encoding="utf-8"))
        chunks.append({"name": name, "rows": e["rows"], "first_row": e["first_row"]})
        skipped += e["skipped"]
        shape = shape or e.get("image_emb_shape")
    plan = {k: v for k, v in job.items() if k != "input_skipped"}  # listed in "skipped", first
    meta = {
        **plan,
        "image_emb_shape": shape,
        "written_rows": sum(c["rows"] for c in chunks),
        "skipped": skipped,
        "chunk_files": chunks,
    }
    atomic_write_json(out / "embed.json", meta)
    for msg in skipped[:10]:
        log.warning("skipped %s", msg)
    if len(skipped) > 10:
        log.warning("… and %d more unreadable pictures skipped", len(skipped) - 10)
    return meta
