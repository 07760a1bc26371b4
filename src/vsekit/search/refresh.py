"""`vse index RUN DIR --out INDEX --refresh`: bring an index up to date with a folder whose pictures changed.

A picture is known by its content: pictures.jsonl records the sha256 of each picture file's bytes (`vse index`
writes it for every picture it embeds from a file). A refresh hashes DIR's pictures and then
- keeps the stored embedding of every picture whose path and sha256 are unchanged (no model forward),
- embeds the changed and the new ones (resumable chunks in `.work/`, batched like `vse index`),
- drops the pictures that are gone from DIR (or can no longer be read, as a fresh build would skip them),
- re-reads the captions beside the pictures (`x.txt`), re-embedding only caption texts the index does not hold.

DIR's pictures are then written as one segment in DIR's order, the order a fresh `vse index DIR` gives, so a
refreshed index holds what a fresh build would hold: the same pictures, embeddings, captions and search results.
Pictures of the index's other roots are kept as they are (their segment files hard-linked, or left in place when
nothing before them moved), with their captions' picture ids renumbered. The FAISS indexes are rebuilt over the
result (IVF lists re-trained on it, HNSW graphs rebuilt: FAISS cannot remove vectors from every kind), so they
are the ones a fresh build makes. A refresh that finds nothing changed embeds and writes nothing.

Pictures recorded without a sha256 (indexed by an older vsekit, from a dataset split's stored features, or from
an embeddings folder) cannot be known unchanged: they are re-embedded once, with a note, and hashed from then on.

Crash safety is `vse index`'s: the writer lock, new files under new names, index.json switched last in one
rename, the old files deleted after it, and everything new removed when the refresh fails before the switch
(Ctrl-C keeps the finished chunks, which the rerun reuses).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from vsekit.data.precomp import DataFormatError
from vsekit.errors import VseInputError
from vsekit.runs import load_run
from vsekit.search.build import build_under_lock, model_fingerprint
from vsekit.search.chunks import encode_resumable
from vsekit.search.encode import ImageEmbedder, TextEmbedder, proxy_vectors
from vsekit.search.faiss_index import FaissParams, build_caption_faiss, build_faiss, check_trainable
from vsekit.search.sources import (
    Source,
    display_path,
    hash_pictures,
    is_dataset_dir,
    path_kind,
    read_extra_captions,
    resolve_source,
)
from vsekit.search.store import (
    IndexFormatError,
    SearchIndex,
    check_same_model,
    commit_generation,
    next_segment_number,
    timestamp,
    write_segment,
    writing,
)
from vsekit.utils.printable import printable


def refresh_index(
    run_dir: str | Path,
    source: str,
    out_dir: str | Path,
    *,
    checkpoint: str = "best",
    params: FaissParams | None = None,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    chunk_size: int = 256,
    strict: bool = False,
    captions_file: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    trust_links: bool = False,
) -> dict:
    """Make the index in `out_dir` hold what a fresh `vse index run_dir source` would: re-embed the pictures of
    the folder `source` whose bytes changed, add the new ones, drop the deleted ones, keep the rest
    (`trust_links`: the folder's hard links are read, as `vse index --trust-links` reads them).

    Without an index in `out_dir` yet, this is a first build. Returns the new index.json contents (the old ones
    when nothing changed: then nothing is embedded or written)."""
    out_dir = Path(out_dir)
    check_refresh_source(source)  # before the lock: a wrong SOURCE leaves no --out folder behind
    with writing(out_dir, log):
        if not (out_dir / "index.json").is_file():
            log(f"note: {out_dir} holds no index yet; building it")
            return build_under_lock(
                run_dir,
                source,
                out_dir,
                checkpoint=checkpoint,
                params=params,
                device=device,
                batch_size=batch_size,
                chunk_size=chunk_size,
                pixels=False,
                strict=strict,
                captions_file=captions_file,
                progress=progress,
                log=log,
                trust_links=trust_links,
            )
        return _refresh(
            Path(run_dir),
            source,
            out_dir,
            checkpoint,
            params,
            torch.device(device),
            batch_size,
            chunk_size,
            strict,
            captions_file,
            progress,
            log,
            trust_links=trust_links,
        )


def check_refresh_source(source: str | Path) -> None:
    """A refresh re-reads a folder of pictures. A single picture or a dataset split is refused: a refresh drops
    what is gone from its source, and neither names everything under its root (a split's pictures share their
    folder with the other splits')."""
    path = Path(source)
    if not path.is_dir():
        raise VseInputError(
            f"--refresh: {display_path(source)}: {path_kind(path)}; --refresh re-reads a folder of "
            "pictures (add a single picture or a DATASET_DIR:SPLIT without --refresh)"
        )
    if is_dataset_dir(path):
        raise VseInputError(
            f"--refresh: {display_path(source)} is a dataset directory, whose splits' "
            "{split}_images.txt fix their pictures; index its splits without --refresh"
        )


def refresh_source(source: str, captions_per_image: int, *, trust_links: bool = False) -> Source:
    """The folder a refresh re-reads, as `vse index` reads it (`check_refresh_source` says what is refused)."""
    check_refresh_source(source)
    return resolve_source(source, captions_per_image, trust_links=trust_links)


def _refresh(
    run_dir: Path,
    source: str,
    out_dir: Path,
    checkpoint: str,
    params: FaissParams | None,
    device: torch.device,
    batch_size: int,
    chunk_size: int,
    strict: bool,
    captions_file: str | Path | None,
    progress: bool,
    log: Callable[[str], None],
    trust_links: bool = False,
) -> dict:
    model, run_cfg = load_run(run_dir, checkpoint, device)
    fingerprint = model_fingerprint(run_dir, checkpoint, model)
    old = SearchIndex(out_dir)
    check_same_model(old.meta, fingerprint, out_dir)
    if params is not None and params.kind != old.params.kind:
        log(f"note: {out_dir} is a {old.params.kind} index; it is refreshed as such")
    params = replace(old.params)
    src = refresh_source(source, model.recipe.data.captions_per_image, trust_links=trust_links)
    if strict and src.problems:
        raise DataFormatError(src.problems[0])
    extra = read_extra_captions(captions_file)
    embedder = ImageEmbedder(
        model, run_cfg, device
    )  # before any hashing: a run that cannot embed pictures says so

    roots = [str(r) for r in old.roots]
    if str(src.root) not in roots:
        roots.append(str(src.root))
    rid = roots.index(str(src.root))
    stored = {p["path"]: (pid, p.get("sha256")) for pid, p in enumerate(old.pictures) if p["root"] == rid}
    sha, unread = hash_pictures(src.root, src.paths, progress)
    if strict and unread:
        raise DataFormatError(unread[0])
    readable = [i for i, h in enumerate(sha) if h is not None]
    unchanged = [i for i in readable if stored.get(src.paths[i], (None, None))[1] == sha[i]]
    same = set(unchanged)
    todo = [i for i in readable if i not in same]
    n_changed = sum(src.paths[i] in stored for i in todo)
    present = {src.paths[i] for i in readable}
    deleted = [path for path in stored if path not in present]
    unhashed = sum(h is None for _, h in stored.values())
    if unhashed:
        log(
            f"note: {unhashed} of the {len(stored)} pictures of {src.root} in {out_dir} were indexed without a content "
            "hash (by an older vsekit, from a dataset's features or from an embeddings folder); they are re-embedded "
            "once and hashed from now on"
        )
    log(
        f"refresh {out_dir} from {display_path(source)}: {len(unchanged)} unchanged, {n_changed} changed, "
        f"{len(todo) - n_changed} new, {len(deleted)} deleted"
    )
    problems = src.problems + unread
    _warn(problems, log)

    # captions beside the pictures, as a fresh build reads them (x.txt may change without its picture)
    first = src.first_caption()
    texts_of: dict[int, list[str]] = {}
    for text, i in src.captions:
        texts_of.setdefault(i, []).append(text)
    old_texts: dict[int, list[str]] = {}
    for c in old.captions:
        if c.get("image") is not None:
            old_texts.setdefault(int(c["image"]), []).append(c["text"])
    known = {c["text"] for c in old.captions}
    new_extra = [s for s in dict.fromkeys(extra) if s not in known and s not in {t for t, _ in src.captions}]
    captions_same = all(
        old.pictures[stored[src.paths[i]][0]].get("caption") == first[i]
        and old_texts.get(stored[src.paths[i]][0], []) == texts_of.get(i, [])
        for i in unchanged
    )
    if not todo and not deleted and not new_extra and captions_same:
        log(f"{out_dir} is up to date with {display_path(source)}: nothing to embed")
        return old.meta

    shape = list(old.meta.get("image_emb_shape") or [])
    # an IVF index left with fewer pictures than its lists fails now, before any embedding
    check_trainable(
        params, len(old.pictures) - len(stored) + len(unchanged) + len(todo), shape[-1] if shape else None
    )
    new_row: dict[int, int] = {}
    work = None
    if todo:
        mode = embedder.describe()
        job = hashlib.sha256(
            json.dumps(
                [
                    "refresh",
                    fingerprint["weights_sha256"],
                    mode,
                    str(src.root),
                    [[src.paths[i], sha[i]] for i in todo],
                ],
                sort_keys=True,
            ).encode()
        ).hexdigest()[:16]
        work = out_dir / ".work" / job
        emb, kept_local, emb_problems, new_shape = encode_resumable(
            work,
            len(todo),
            lambda j: embedder.load(src.root / src.paths[todo[j]]),
            lambda items: embedder.embed(torch.stack(items)),
            chunk_size,
            batch_size,
            strict,
            progress,
            desc="embed pictures",
        )
        _warn(emb_problems, log)
        problems += emb_problems
        new_row = {todo[j]: r for r, j in enumerate(kept_local)}
        if new_row and new_shape != shape:
            raise IndexFormatError(
                f"{out_dir / 'index.json'}: pictures embed to shape {shape}, the changed ones to {new_shape}"
            )

    # DIR's pictures in DIR's order, unchanged ones with their stored embeddings
    block = [i for i in range(len(src.paths)) if i in same or i in new_row]
    width = int(np.prod(shape)) if shape else (emb.shape[1] if new_row else 0)
    block_emb = np.zeros((len(block), width), dtype=np.float32)
    reuse = [r for r, i in enumerate(block) if i in same]
    if reuse:
        block_emb[reuse] = old.image_emb(np.array([stored[src.paths[block[r]]][0] for r in reuse]))
    fresh = [r for r, i in enumerate(block) if i in new_row]
    if fresh:
        block_emb[fresh] = emb[[new_row[block[r]] for r in fresh]]
    block_pics = [
        {"root": rid, "path": src.paths[i], "caption": first[i], "id": src.ids[i], "sha256": sha[i]}
        for i in block
    ]
    meta = _write_refreshed(
        out_dir,
        old,
        rid,
        block,
        block_pics,
        block_emb,
        texts_of,
        extra=new_extra,
        model=model,
        device=device,
        params=params,
        fingerprint=fingerprint,
        roots=roots,
        shape=shape,
        segment={
            "source": src.label,
            "embedded_from": embedder.describe(),
            "skipped": problems,
            "refresh": {
                "unchanged": len(unchanged),
                "changed": n_changed,
                "new": len(todo) - n_changed,
                "deleted": len(deleted),
            },
        },
    )
    if work is not None:
        shutil.rmtree(work, ignore_errors=True)
        if (out_dir / ".work").is_dir() and not any((out_dir / ".work").iterdir()):
            (out_dir / ".work").rmdir()
    return meta


def _warn(problems: list[str], log: Callable[[str], None]) -> None:
    """One warning per skipped file (ten at most, then a count), as `vse index` says them."""
    for msg in problems[:10]:
        log(f"warning: skipped {printable(msg)}")
    if len(problems) > 10:
        log(f"warning: … and {len(problems) - 10} more unreadable pictures skipped")


def _write_refreshed(
    out_dir: Path,
    old: SearchIndex,
    rid: int,
    block: list[int],
    block_pics: list[dict],
    block_emb: np.ndarray,
    texts_of: dict[int, list[str]],
    *,
    extra: list[str],
    model,
    device: torch.device,
    params: FaissParams,
    fingerprint: dict,
    roots: list[str],
    shape: list[int],
    segment: dict,
) -> dict:
    """Write the refreshed index: the other roots' segments (kept, or re-listed with renumbered captions), the
    refreshed folder's one new segment where its first picture was, rebuilt FAISS indexes, then index.json
    (`store.commit_generation`)."""
    now = timestamp()
    number = next_segment_number(old.meta)
    out_segments: list[dict] = []
    img_parts: list[np.ndarray] = []
    cap_parts: list[np.ndarray] = []
    pid_map: dict[int, int] = {}  # old picture id -> new one (other roots)
    moved_extra: list[tuple[str, int]] = []  # captions without a picture from the refreshed folder's segments
    placed = False
    n_pics = 0

    def place_block() -> None:
        nonlocal placed, n_pics
        placed = True
        out_segments.append({"block": True, "first": n_pics})
        n_pics += len(block)

    spans = old.segment_spans()
    plans = []
    for s, seg in enumerate(old.meta["segments"]):
        pics, caps = spans[s]
        rows = [p for p in pics if old.pictures[p]["root"] != rid]
        if len(rows) < len(pics) and not placed:
            place_block()
        for p in rows:
            pid_map[p] = n_pics
            n_pics += 1
        keep_caps = []
        for c in caps:
            image = old.captions[c].get("image")
            if image is None and rows:
                keep_caps.append(c)
            elif (
                image is None
            ):  # a caption without a picture, added with the refreshed folder: it moves along
                moved_extra.append((old.captions[c]["text"], c))
            elif int(image) in pid_map:
                keep_caps.append(c)
        if rows:
            plans.append((s, seg, rows, keep_caps))
            out_segments.append({"plan": len(plans) - 1})
    if not placed:
        place_block()
    if n_pics == 0:
        raise DataFormatError(
            f"{out_dir}: after this refresh the index would hold no pictures (none of the folder's "
            "pictures could be embedded); nothing was changed"
        )

    # the block's captions: the folder's own (re-read), then kept and new captions without a picture
    first_id = next(o["first"] for o in out_segments if o.get("block"))
    block_caps = [
        {"text": t, "image": first_id + r} for r, i in enumerate(block) for t in texts_of.get(i, [])
    ]
    block_caps += [{"text": t, "image": None} for t, _ in moved_extra]
    block_caps += [{"text": t, "image": None} for t in extra]
    by_text = {}
    for c, cap in enumerate(old.captions):
        by_text.setdefault(cap["text"], c)
    need = [t for t in dict.fromkeys(c["text"] for c in block_caps) if t not in by_text]
    embedded = dict(zip(need, TextEmbedder(model, device).embed_keys(need))) if need else {}
    dim = fingerprint.get("embed_dim") or model.recipe.model.embed_dim
    block_cap_emb = np.zeros((len(block_caps), dim), dtype=np.float32)
    reuse = [(r, by_text[c["text"]]) for r, c in enumerate(block_caps) if c["text"] in by_text]
    if reuse:
        block_cap_emb[[r for r, _ in reuse]] = old.caption_emb(np.array([c for _, c in reuse]))
    for r, c in enumerate(block_caps):
        if c["text"] in embedded:
            block_cap_emb[r] = embedded[c["text"]]

    for o in out_segments:
        if o.get("block"):
            seg_rel = write_segment(out_dir, number, block_pics, block_emb, block_caps, block_cap_emb)
            number += 1
            o.clear()
            o.update(
                {
                    "dir": seg_rel,
                    "pictures": len(block_pics),
                    "captions": len(block_caps),
                    **segment,
                    "added": now,
                }
            )
            img_parts.append(block_emb)
            cap_parts.append(block_cap_emb)
            continue
        s, seg, rows, keep_caps = plans[o.pop("plan")]
        pics, caps = spans[s]
        img, cap = old.segment_arrays(s)
        captions = [
            {
                **old.captions[c],
                **(
                    {"image": pid_map[int(old.captions[c]["image"])]}
                    if old.captions[c].get("image") is not None
                    else {}
                ),
            }
            for c in keep_caps
        ]
        if len(rows) == len(pics) and captions == [
            old.captions[c] for c in caps
        ]:  # nothing moved: kept as it is
            o.update({**seg})
        else:  # a file that keeps all its rows is linked, not rewritten
            old_dir, all_rows = old.dir / seg["dir"], len(rows) == len(pics)
            if len(keep_caps) == len(caps):
                cap_emb: np.ndarray | Path = old_dir / "caption_emb.npy"
            else:
                cap_emb = (
                    np.asarray(cap[[c - caps.start for c in keep_caps]])
                    if cap is not None
                    else np.zeros((0, dim))
                )
            seg_rel = write_segment(
                out_dir,
                number,
                old_dir / "pictures.jsonl" if all_rows else [old.pictures[p] for p in rows],
                old_dir / "image_emb.npy" if all_rows else np.asarray(img[[p - pics.start for p in rows]]),
                captions,
                cap_emb,
            )
            number += 1
            o.update({**seg, "dir": seg_rel, "pictures": len(rows), "captions": len(captions)})
        img_parts.append(np.asarray(img[[p - pics.start for p in rows]]))
        if keep_caps:
            cap_parts.append(np.asarray(cap[[c - caps.start for c in keep_caps]]))

    # FAISS over the result, built as a first build builds it (IVF lists trained on these vectors, the proxies
    # of `proxy_vectors`, as a first build takes them)
    all_emb = np.concatenate(img_parts)
    all_cap = np.concatenate(cap_parts) if cap_parts else np.zeros((0, dim), np.float32)
    built = replace(params)
    img_index = build_faiss(proxy_vectors(model, torch.from_numpy(all_emb)).numpy(), built)
    cap_index = build_caption_faiss(all_cap, built) if len(all_cap) else None
    return commit_generation(
        out_dir,
        old,
        fingerprint=fingerprint,
        params=built,
        roots=roots,
        emb_shape=shape,
        segments=out_segments,
        image_index=img_index,
        caption_index=cap_index,
        counts={"pictures": len(all_emb), "captions": len(all_cap)},
        now=now,
    )
