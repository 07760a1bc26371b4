"""Two-stage search of a late-interaction (CHAN) index against exhaustive scoring (`vse bench late-interaction`).

A CHAN index answers a text query in two stages (`vsekit.search.engine`): FAISS ranks the pictures by one vector
each (the normalised mean of the regions against the normalised mean of the query's words), and the model's own
late interaction re-scores the shortlist. This measures what the first stage loses: for each query the exhaustive
top-k (the model's similarity over every stored set) against the two-stage top-k at several shortlist sizes —
recall of the exhaustive top-k, and the latency of both. Without an index of your own, it builds one: a synthetic
precomp set (`vsekit_lab.datasets.synthetic`), a CHAN model trained on it for a few epochs, its test split indexed.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

logger = logging.getLogger(__name__)

DEFAULT_SHORTLISTS = (10, 20, 50, 100, 200, 500)


def build_synthetic_chan_index(
    work: str | Path,
    *,
    pictures: int = 5000,
    train_images: int = 2000,
    regions: int = 12,
    feature_dim: int = 64,
    embed_dim: int = 64,
    epochs: int = 3,
    seed: int = 0,
) -> Path:
    """A synthetic precomp set (test split of `pictures` images), a CHAN model trained on it for `epochs`, and an
    index of its test split, under `work` (reused when already built); returns the index folder."""
    from vsekit.config import load_recipe
    from vsekit.search.build import build_index
    from vsekit.training.trainer import Trainer
    from vsekit_lab.datasets.synthetic import make_synthetic_precomp

    work = Path(work)
    data, run, index = work / "data", work / "run", work / "index"
    if not (data / "test_caps.txt").is_file():
        make_synthetic_precomp(
            data,
            n_train=train_images,
            n_dev=200,
            n_test=pictures,
            regions=regions,
            dim=feature_dim,
            seed=seed,
            noise=0.8,
        )
    if not (run / "best.safetensors").is_file():
        recipe = load_recipe(
            "chan",
            [
                f"model.embed_dim={embed_dim}",
                "model.text.word_dim=32",
                "model.image.selfattn_heads=4",
                "model.text.vocab_min_count=1",
                "model.text.tokenizer=regex",
                "train.batch_size=128",
                "train.log_every=0",
                f"train.epochs={epochs}",
                f"train.seed={seed}",
                "optim.lr=2.0e-3",
                "train.device=cpu",
            ],
        )
        Trainer(recipe, data, run, overwrite=True, progress=False, log=lambda *_: None).fit()
    if not (index / "index.json").is_file():
        build_index(run, f"{data}:test", index, device="cpu", batch_size=256, progress=False, log=logger.info)
    return index


def _topk(scores: np.ndarray, k: int) -> np.ndarray:
    """The ids of the k best scores, best first (ties: the lower id first, as a stable sort gives them)."""
    return np.argsort(-scores, kind="stable")[:k]


def bench_late_interaction(
    index_dir: str | Path,
    *,
    queries: int = 200,
    shortlists: Sequence[int] = DEFAULT_SHORTLISTS,
    k: int = 10,
    block: int = 2048,
    seed: int = 0,
    threads: int = 1,
) -> dict:
    """Recall of the exhaustive top-k and per-query latency of the two-stage search at each shortlist size
        (plus the default rule's), and the latency of exhaustive scoring, over `queries` captions of the index
        (drawn with `seed`). The query's embedding is computed once and shared: both latencies are scoring only, on
    `threads` torch and FAISS threads (one query at a time, as a server answers each request)."""
    from vsekit.search.faiss_index import import_faiss

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    import_faiss().omp_set_num_threads(threads)
    try:
        return _measure(index_dir, queries, shortlists, k, block, seed)
    finally:
        torch.set_num_threads(before)


def _measure(
    index_dir: str | Path, queries: int, shortlists: Sequence[int], k: int, block: int, seed: int
) -> dict:
    from vsekit.search.engine import SearchEngine

    engine = SearchEngine.open(index_dir)
    if not engine.rerank:
        raise ValueError(
            f"{index_dir}: its model's similarity is an inner product; there is nothing to re-score"
        )
    index, model = engine.index, engine.model
    n = index.n_pictures
    texts = list(dict.fromkeys(c["text"] for c in index.captions))
    if not texts:
        raise ValueError(f"{index_dir}: holds no captions to query with")
    rng = np.random.default_rng(seed)
    picked = [texts[i] for i in rng.permutation(len(texts))[: min(queries, len(texts))]]
    sets = torch.from_numpy(np.asarray(index.all_image_emb(), dtype=np.float32)).reshape(n, *engine.emb_shape)
    default_depth = engine.shortlist_size(k)
    depths = list(dict.fromkeys([*(engine.shortlist_size(k, s) for s in shortlists), default_depth]))
    truth, exact_ms = [], []
    q_embs = [engine.text.embed([t]) for t in picked]
    with torch.no_grad():
        for q in q_embs:
            t0 = time.perf_counter()
            scores = torch.cat([model.sim(sets[b : b + block], q)[:, 0] for b in range(0, n, block)])
            top = _topk(scores.float().numpy(), k)
            exact_ms.append((time.perf_counter() - t0) * 1e3)
            truth.append(top)
    rows = []
    for depth in depths:
        recalls, ms = [], []
        for q, want in zip(q_embs, truth):
            t0 = time.perf_counter()
            got = engine.search_text_vectors(q, k, shortlist=depth)[0]
            ms.append((time.perf_counter() - t0) * 1e3)
            recalls.append(len({i for i, _ in got} & set(want.tolist())) / len(want))
        rows.append(
            {
                "shortlist": depth,
                "default": depth == default_depth,
                "recall_at_k": float(np.mean(recalls)),
                "min_recall": float(np.min(recalls)),
                "p50_ms": float(np.percentile(ms, 50)),
                "p99_ms": float(np.percentile(ms, 99)),
            }
        )
    return {
        "setup": {
            "index": str(index_dir),
            "pictures": n,
            "set_shape": list(engine.emb_shape),
            "recipe": index.meta["model"].get("recipe"),
            "similarity": index.meta["model"].get("similarity"),
            "queries": len(picked),
            "k": k,
            "threads": torch.get_num_threads(),
        },
        "exhaustive": {
            "p50_ms": float(np.percentile(exact_ms, 50)),
            "p99_ms": float(np.percentile(exact_ms, 99)),
        },
        "rows": rows,
    }
