"""Building an index: `vse index RUN SOURCE --out INDEX` embeds SOURCE's pictures (or a split's stored
features) with a trained run and adds them to the index as one segment; `vse index --from-embeddings DIR` takes
the vectors of a `vse embed` folder instead. Pictures already in the index are skipped, an interrupted run
resumes from its finished chunks (`search.chunks`), and everything on disk is written by `search.store`'s
protocol, so a crash at any point leaves a readable index."""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from vsekit.data.manifest import read_manifest_extractor
from vsekit.data.precomp import DataFormatError
from vsekit.data.untrusted import UntrustedFileError, resolve_inside
from vsekit.errors import VseInputError
from vsekit.models.image_parts import reads_pixels
from vsekit.runs import load_run, weights_path
from vsekit.search.chunks import encode_resumable
from vsekit.search.encode import (
    ImageEmbedder,
    TextEmbedder,
    embed_features,
    needs_rerank,
    pad_set_width,
    proxy_vectors,
    run_extractor_spec,
    same_extractor,
    scores_sets,
)
from vsekit.search.faiss_index import FaissParams, check_trainable
from vsekit.search.proxies import picture_proxies, view_width
from vsekit.search.sources import Source, hash_pictures, read_extra_captions, resolve_source
from vsekit.search.store import (
    IndexFormatError,
    SearchIndex,
    append_segment,
    check_new_out,
    check_same_model,
    writing,
)
from vsekit.utils.io import sha256_file
from vsekit.utils.printable import printable


def build_index(
    run_dir: str | Path,
    source: str,
    out_dir: str | Path,
    *,
    checkpoint: str = "best",
    params: FaissParams | None = None,
    device: str | torch.device = "cpu",
    batch_size: int = 16,
    chunk_size: int = 256,
    pixels: bool = False,
    strict: bool = False,
    captions_file: str | Path | None = None,
    progress: bool = True,
    log: Callable[[str], None] = print,
    trust_links: bool = False,
) -> dict:
    """Embed the pictures of `source` with a trained run and write (or extend) the index in `out_dir`.

    Pictures already in the index are skipped, so rerunning after new files arrive only adds those. A run
    that is interrupted resumes from its last finished chunk. Returns the new index.json contents.
    `trust_links`: a folder's files with several names (hard links) are indexed, not refused.
    """
    with writing(Path(out_dir), log):
        return build_under_lock(
            run_dir,
            source,
            out_dir,
            checkpoint=checkpoint,
            params=params,
            device=device,
            batch_size=batch_size,
            chunk_size=chunk_size,
            pixels=pixels,
            strict=strict,
            captions_file=captions_file,
            progress=progress,
            log=log,
            trust_links=trust_links,
        )


def build_under_lock(
    run_dir: str | Path,
    source: str,
    out_dir: str | Path,
    *,
    checkpoint: str,
    params: FaissParams | None,
    device: str | torch.device,
    batch_size: int,
    chunk_size: int,
    pixels: bool,
    strict: bool,
    captions_file: str | Path | None,
    progress: bool,
    log: Callable[[str], None],
    trust_links: bool = False,
) -> dict:
    """`build_index`'s work, for a caller that already holds `out_dir` (`store.writing`): `vse index --refresh`
    of a folder that holds no index yet."""
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    device = torch.device(device)
    model, run_cfg = load_run(run_dir, checkpoint, device)
    fingerprint = model_fingerprint(run_dir, checkpoint, model)
    meta_path = out_dir / "index.json"
    old = SearchIndex(out_dir) if meta_path.is_file() else None
    if old is not None:
        check_same_model(old.meta, fingerprint, out_dir)
        if params is not None and params.kind != old.params.kind:
            log(f"note: {out_dir} is a {old.params.kind} index; new pictures are added to it as such")
        params = old.params
    params = params or FaissParams()
    params.validate()
    if old is None:
        check_new_out(out_dir, log)

    src = resolve_source(source, model.recipe.data.captions_per_image, trust_links=trust_links)
    roots = [str(r) for r in (old.roots if old else [])]
    if str(src.root) not in roots:
        roots.append(str(src.root))
    root_id = roots.index(str(src.root))
    present = {(p["root"], p["path"]) for p in old.pictures} if old else set()
    todo = [i for i, p in enumerate(src.paths) if (root_id, p) not in present]
    if old is not None and len(todo) < len(src.paths):
        log(
            f"{len(src.paths) - len(todo)} of {len(src.paths)} pictures are already in the index; adding {len(todo)}"
        )
    # everything that can be checked before the pictures are embedded is checked here, so no work is wasted
    if strict and src.problems:
        raise DataFormatError(src.problems[0])
    extra = read_extra_captions(captions_file)
    if old is None and todo:
        check_trainable(params, len(todo))

    use_features = use_stored_features(src, model, pixels, run_cfg, run_dir, log)
    sha: dict[int, str] = {}  # picture files: the sha256 of their bytes, recorded for `vse index --refresh`
    unread: list[str] = []
    if use_features:
        from vsekit.data.validate import check_split_features

        check_split_features(src.split)  # NaN/inf rows: name the file and row before anything is embedded
        mode = {"mode": "features", "dataset": src.label}
        split = src.split

        def load(j: int):
            return split.image_features(todo[j])

        width = split.feature_shape[0] if scores_sets(model) else None

        def embed(items: list) -> torch.Tensor:
            out = embed_features(model, items, device)
            # sets of region vectors: every batch padded to the split's widest, so every picture is stored alike
            return out if width is None else pad_set_width(out, width)
    else:
        embedder = ImageEmbedder(model, run_cfg, device)
        mode = embedder.describe()
        hashes, unread = hash_pictures(src.root, [src.paths[i] for i in todo], progress)
        if strict and unread:
            raise DataFormatError(unread[0])
        sha = {i: h for i, h in zip(todo, hashes) if h is not None}
        todo = [i for i in todo if i in sha]

        def load(j: int):
            return embedder.load(src.root / src.paths[todo[j]])

        def embed(items: list) -> torch.Tensor:
            return embedder.embed(torch.stack(items))

    # the job names what is embedded (and, for picture files, their bytes: a picture changed between an interrupted
    # run and its rerun gets a new job, so no chunk embedded from its old bytes is stored under its new hash)
    items = [[src.paths[i], sha[i]] for i in todo] if sha else [src.paths[i] for i in todo]
    job = hashlib.sha256(
        json.dumps([fingerprint["weights_sha256"], mode, str(src.root), items], sort_keys=True).encode()
    ).hexdigest()[:16]
    work = out_dir / ".work" / job
    emb, kept_local, problems, shape = encode_resumable(
        work, len(todo), load, embed, chunk_size, batch_size, strict, progress, desc="embed pictures"
    )
    problems = src.problems + unread + problems
    for msg in problems[:10]:
        log(f"warning: skipped {printable(msg)}")
    if len(problems) > 10:
        log(f"warning: … and {len(problems) - 10} more unreadable pictures skipped")
    kept = [todo[j] for j in kept_local]
    if not kept:
        shutil.rmtree(work, ignore_errors=True)
        if old is None:
            raise DataFormatError(f"{source}: none of its {len(src.paths)} pictures could be embedded")
        log(f"nothing to add to {out_dir}")
        return old.meta
    if old is not None and old.meta.get("image_emb_shape") != shape:
        raise IndexFormatError(
            f"{meta_path}: pictures embed to shape {old.meta.get('image_emb_shape')}, the new ones to {shape}"
        )

    base = old.n_pictures if old else 0
    first = src.first_caption()
    pictures = [
        {
            "root": root_id,
            "path": src.paths[i],
            "caption": first[i],
            "id": src.ids[i],
            **({"sha256": sha[i]} if i in sha else {}),
        }
        for i in kept
    ]
    new_id = {i: base + n for n, i in enumerate(kept)}
    captions = [{"text": t, "image": new_id[i]} for t, i in src.captions if i in new_id]
    if extra:
        known = {c["text"] for c in (old.captions if old else [])} | {c["text"] for c in captions}
        captions += [{"text": s, "image": None} for s in dict.fromkeys(extra) if s not in known]
    cap_emb = TextEmbedder(model, device).embed_keys([c["text"] for c in captions])

    img_proxy = proxy_vectors(model, torch.from_numpy(emb)).numpy()
    segment = {"source": src.label, "embedded_from": mode, "skipped": problems}
    meta = append_segment(
        out_dir,
        old,
        fingerprint=fingerprint,
        params=params,
        roots=roots,
        pictures=pictures,
        image_emb=emb,
        emb_shape=shape,
        proxies=img_proxy,
        captions=captions,
        caption_emb=cap_emb,
        segment=segment,
    )
    shutil.rmtree(work, ignore_errors=True)
    if (out_dir / ".work").is_dir() and not any((out_dir / ".work").iterdir()):
        (out_dir / ".work").rmdir()
    return meta


def model_fingerprint(run_dir: Path, checkpoint: str, model) -> dict:
    """What identifies the model of an index or an embeddings folder (its weights' sha256 above all)."""
    weights = weights_path(run_dir, checkpoint)
    return {
        "run_dir": str(Path(run_dir).resolve()),
        "checkpoint": checkpoint,
        "weights": weights.name,
        "weights_sha256": sha256_file(weights),
        "recipe": model.recipe.name,
        "similarity": model.recipe.model.similarity.name,
        "embed_dim": model.recipe.model.embed_dim,
        "rerank": needs_rerank(model),
    }


def build_index_from_embeddings(
    emb_dir: str | Path,
    out_dir: str | Path,
    *,
    params: FaissParams | None = None,
    run_dir: str | Path | None = None,
    checkpoint: str = "best",
    log: Callable[[str], None] = print,
    images_root: str | Path | None = None,
) -> dict:
    """`vse index --from-embeddings DIR`: an index from a `vse embed` folder, with no model forward.

    The vectors are taken as they are (img_emb rows -> pictures, text_emb rows -> their captions); the
    model fingerprint comes from DIR/embed.json, so `vse search` later embeds queries with the same run. A
    folder written by another tool (clip-retrieval's layout, no embed.json) needs `run_dir`: the run whose
    embeddings these are (only the dimension can be checked; that they come from it is the caller's word).
    Adding to an existing index follows `vse index`: same model, same dimension, pictures already present skipped.
    The pictures' root the folder records must lie inside DIR or inside `images_root` (`--images-root`, the
    caller's word for where the pictures may be read from), else the build is refused
    (`embeddings_picture_root`).
    """
    with writing(Path(out_dir), log):
        return _build_from_embeddings(
            Path(emb_dir), Path(out_dir), params, run_dir, checkpoint, log, images_root
        )


def embeddings_picture_root(info: dict, emb_dir: Path, images_root: str | Path | None = None) -> str:
    """The pictures' root of an embeddings folder: embed.json's `root`, which the folder's author wrote, so
    it is taken only when it resolves inside the folder the user named (`images_root`, else the embeddings
    folder itself) by the rule every root follows (`untrusted.resolve_inside`); a relative one is read from
    there. Without a recorded root: that folder. `vse serve` then reads thumbnails only under it."""
    named = Path(images_root) if images_root is not None else emb_dir
    label = "--images-root" if images_root is not None else "the embeddings folder"
    if images_root is not None and not named.is_dir():
        what = "no such folder" if not named.exists() else "is not a folder"
        raise VseInputError(f"--images-root {images_root}: {what}")
    recorded = info.get("root")
    if recorded is None or recorded == "":
        return str(named.resolve())
    where = f"{emb_dir / 'embed.json'}"
    if not isinstance(recorded, str):
        raise VseInputError(f"{where}: root is a JSON {type(recorded).__name__}, expected a folder path")
    try:
        return str(resolve_inside(named, recorded, label=label, absolute_ok=True))
    except UntrustedFileError as e:
        hint = (
            "name a folder that holds it with --images-root DIR"
            if images_root is None
            else "give an --images-root that holds it"
        )
        raise VseInputError(
            f"{where}: the pictures' root {e.detail}; an embeddings folder may name a root only inside the "
            f"folder you named: {hint}"
        ) from None


def _build_from_embeddings(
    emb_dir: Path,
    out_dir: Path,
    params: FaissParams | None,
    run_dir: str | Path | None,
    checkpoint: str,
    log: Callable[[str], None],
    images_root: str | Path | None = None,
) -> dict:
    from vsekit.search.embedding_folder import open_embedding_folder

    folder = open_embedding_folder(emb_dir)
    info = folder.info
    fingerprint = info.get("model")
    recorded = isinstance(fingerprint, dict) and bool(fingerprint.get("weights_sha256"))
    if run_dir is not None:
        model, _ = load_run(Path(run_dir), checkpoint, torch.device("cpu"))
        theirs = model_fingerprint(Path(run_dir), checkpoint, model)
        if recorded and theirs["weights_sha256"] != fingerprint["weights_sha256"]:
            raise VseInputError(
                f"{emb_dir / 'embed.json'}: embedded with {fingerprint.get('run_dir')}, not with "
                f"{run_dir} (weights differ); drop RUN_DIR or use the run that embedded them"
            )
        if not recorded and folder.dim != model.recipe.model.embed_dim:
            raise VseInputError(
                f"{folder.img[0]}: {folder.dim}-d vectors, but {run_dir} embeds to "
                f"{model.recipe.model.embed_dim} dimensions"
            )
        fingerprint = theirs
    elif not recorded:
        raise VseInputError(
            f"{emb_dir / 'embed.json'}: missing or without a model record (not written by `vse embed`); "
            "name the run whose embeddings these are: vse index RUN_DIR --from-embeddings DIR"
        )
    if _scores_sets(fingerprint.get("similarity")):
        raise VseInputError(
            f"{emb_dir / 'embed.json'}: embedded by a run that scores by {fingerprint.get('similarity')}, a late "
            "interaction of sets of region and word vectors, which an embeddings folder does not hold: index "
            "its pictures or a split with `vse index RUN_DIR SOURCE`"
        )
    shape = list(info.get("image_emb_shape") or [folder.dim])
    if int(np.prod(shape)) != folder.dim:
        raise VseInputError(
            f"{emb_dir / 'embed.json'}: image_emb_shape {shape} does not match the {folder.dim}-d "
            f"vectors of {folder.img[0]}"
        )
    meta_path = out_dir / "index.json"
    old = SearchIndex(out_dir) if meta_path.is_file() else None
    if old is not None:
        check_same_model(old.meta, fingerprint, out_dir)
        if old.meta.get("image_emb_shape") != shape:
            raise IndexFormatError(
                f"{folder.img[0]}: {shape} image embeddings, but the index {meta_path} holds "
                f"{old.meta.get('image_emb_shape')}"
            )
        params = old.params
    params = params or FaissParams()
    params.validate()
    if old is None:
        check_new_out(out_dir, log)
        check_trainable(params, folder.n, shape[-1])  # the proxies: the embedding, or the mean of its views

    root = embeddings_picture_root(info, emb_dir, images_root)
    roots = [str(r) for r in (old.roots if old else [])]
    if root not in roots:
        roots.append(root)
    root_id = roots.index(root)
    present = {(p["root"], p["path"]) for p in old.pictures} if old else set()
    base = old.n_pictures if old else 0
    pictures: list[dict] = []
    captions: list[dict] = []
    embs, caps = [], []
    outside = 0
    for i in range(len(folder.img)):
        cols = folder.metadata(i)
        n = folder.rows[i]
        paths = cols.get("image_path") or [f"{folder.img[i].stem}:{r}" for r in range(n)]
        texts = cols.get("caption") or [None] * n
        ids = cols.get("id") or [Path(str(p)).stem for p in paths]
        rel = [_relative(str(p), root) for p in paths]
        for r, q in enumerate(rel):  # a path outside the root is never stored: the row keeps a label
            if q.startswith("/") or ".." in Path(q).parts:
                rel[r] = f"{folder.img[i].stem}:{r}"
                outside += 1
        keep = [r for r in range(n) if (root_id, rel[r]) not in present]
        if not keep:
            continue
        x = folder.image_chunk(i)
        embs.append(x[keep])
        t = folder.text_chunk(i)
        for j, r in enumerate(keep):
            pid = base + len(pictures) + j
            if t is not None and texts[r] is not None:
                captions.append({"text": texts[r], "image": pid})
        if t is not None:
            caps.append(t[[r for r in keep if texts[r] is not None]])
        pictures += [{"root": root_id, "path": rel[r], "caption": texts[r], "id": str(ids[r])} for r in keep]
        present.update((root_id, rel[r]) for r in keep)
    if outside:
        log(
            f"warning: {outside} image_path value(s) of {emb_dir} lie outside the pictures' root {root}: "
            "stored as CHUNK:ROW labels, never as paths"
        )
    if not pictures:
        if old is None:
            raise VseInputError(f"{emb_dir}: no rows to index")
        log(f"nothing to add to {out_dir}: every row of {emb_dir} is already in it")
        return old.meta
    if old is not None and len(pictures) < folder.n:
        log(f"{folder.n - len(pictures)} of {folder.n} rows are already in the index; adding {len(pictures)}")
    emb = np.concatenate(embs)
    cap_emb = (
        np.concatenate(caps)
        if caps
        else np.zeros((0, fingerprint.get("embed_dim") or folder.dim), np.float32)
    )
    if (
        old is not None
        and old.caption_faiss is not None
        and len(cap_emb)
        and cap_emb.shape[1] != old.caption_faiss.d
    ):
        raise IndexFormatError(
            f"{folder.text[0]}: {cap_emb.shape[1]}-d caption embeddings, but the index holds "
            f"{old.caption_faiss.d}-d ones"
        )
    proxies = picture_proxies(
        emb, view_width(shape, fingerprint.get("embed_dim"), bool(fingerprint.get("rerank")))
    )
    segment = {
        "source": f"embeddings {emb_dir}",
        "embedded_from": {
            "mode": "embeddings",
            "folder": str(emb_dir.resolve()),
            **({"model_input": info["embedded_from"]} if info.get("embedded_from") else {}),
        },
        "skipped": [],
    }
    return append_segment(
        out_dir,
        old,
        fingerprint=fingerprint,
        params=params,
        roots=roots,
        pictures=pictures,
        image_emb=emb,
        emb_shape=shape,
        proxies=proxies,
        captions=captions,
        caption_emb=cap_emb,
        segment=segment,
    )


def _scores_sets(similarity: object) -> bool:
    """Whether the similarity an embeddings folder records scores sets (late interaction); an unknown name: no."""
    from vsekit.similarity.parts import scores_sets as similarity_scores_sets

    try:
        return isinstance(similarity, str) and similarity_scores_sets(similarity)
    except ValueError:
        return False


def _relative(path: str, root: str) -> str:
    """A picture path relative to its root (what pictures.jsonl stores); labels like SPLIT:ROW stay as they are."""
    p = Path(path)
    if p.is_absolute():
        try:
            return p.relative_to(root).as_posix()
        except ValueError:
            return p.as_posix()
    return path


def use_stored_features(
    src: Source, model, pixels: bool, run_cfg: dict, run_dir: Path, log: Callable[[str], None] | None = None
) -> bool:
    """Whether a split's stored features (not its pictures) are what the run embeds: the run takes features
    of that width and, where both sides record it, from the same extractor; `--pixels` says pictures. A split
    without pictures must pass (`_check_features_only`, which raises otherwise). `vse index` and `vse embed`
    decide alike."""
    if src.features_only:
        _check_features_only(src, model, pixels, run_cfg, run_dir)
    use = (
        src.split is not None
        and not pixels
        and not reads_pixels(model.recipe.model.image.kind)  # a feature encoder (precomp, selfattention)
        and src.split.feature_shape[1] == model.spec.img_dim
    )
    if use and not src.features_only:
        theirs, ours = read_manifest_extractor(src.root), run_extractor_spec(run_cfg)
        if theirs and ours and not same_extractor(theirs, ours):
            if log is not None:
                log(
                    f"note: {src.root}'s features come from another extractor ({theirs.get('name')}) than the "
                    f"run's ({ours.get('name')}); embedding its pictures instead"
                )
            return False
    return use


def _check_features_only(src: Source, model, pixels: bool, run_cfg: dict, run_dir: Path) -> None:
    """A split without pictures can only be indexed from its features, by a model trained on such features."""
    missing = src.root / f"{src.split.split}_images.txt"
    if pixels:
        raise DataFormatError(
            f"{missing}: missing, so --pixels has no pictures to read; drop --pixels to index "
            "the split's stored features"
        )
    if reads_pixels(model.recipe.model.image.kind):
        raise DataFormatError(
            f"{missing}: missing, and this run embeds pictures ({model.recipe.model.image.kind} "
            "image encoder), not stored features: the split has nothing it can index"
        )
    src.split.require_width(model.spec.img_dim, f"the run {run_dir}")
    theirs, ours = read_manifest_extractor(src.root), run_extractor_spec(run_cfg)
    if theirs and ours and not same_extractor(theirs, ours):
        raise DataFormatError(
            f"{src.root}: its features come from another extractor ({theirs.get('name')}) than the "
            f"run's ({ours.get('name')}), and {missing.name} is missing, so there are no pictures "
            "to embed instead"
        )
