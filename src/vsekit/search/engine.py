"""Queries against an index: text -> pictures, picture -> captions, picture -> pictures, with exact re-ranking
where needed.

For cosine models the FAISS inner product *is* the model's similarity, so a flat index is exact and an
IVF/HNSW index only risks missing items. AEOM (AVSE) scores an image's several views block by block, which
no inner-product index can do: the index ranks a shortlist by the views' mean, and the shortlist is
re-scored exactly with `model.similarity` (depth = max(factor*k, least) candidates, `VIEW_SHORTLIST` or for a
model of sets `SET_SHORTLIST`, or the `shortlist` an engine or a call is given). A late-interaction (CHAN) model is searched the same way: the index
holds each picture's set of region vectors (flattened, padding rows zero) and its proxy, the normalised mean of
the regions; a text query's proxy is the normalised mean of its word vectors (`vsekit.search.proxies`), and the
shortlist those two rank is re-scored with the model's late interaction. Picture -> captions re-scores its
shortlist the same way, re-encoding the shortlisted captions' texts (an index stores one vector per caption).

Picture -> pictures scores two pictures by the cosine of their *picture vectors*: the image embedding itself
for a cosine model, and for a multi-view (AVSE) model the L2-normalised mean of its views. The model's own
similarity compares a picture with a caption, not two pictures; AEOM matches a caption to the views as a set
(which view is which is not part of the score), so the picture-level summary that does not depend on the order
of the views is their mean. Both are what the image FAISS index holds (`proxy_vectors`), unit length whenever
the model L2-normalises its embeddings (or has several views), so the index answers this cosine directly: exactly
with `flat`, approximately with IVF / HNSW / IVF-PQ. Every picture scores 1 with itself, so a query picture
that is in the index comes first. For a model that does not normalise its embeddings the inner product is not a
cosine, and the stored embeddings are scored exactly instead (normalised, no FAISS).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vsekit.errors import VseInputError
from vsekit.models.image_parts import reads_pixels
from vsekit.search.encode import (
    SUPPORTED_EXTRACTORS,
    ImageEmbedder,
    TextEmbedder,
    needs_rerank,
    proxy_vectors,
    run_extractor_spec,
    scores_sets,
)
from vsekit.search.proxies import query_proxies
from vsekit.search.store import IndexFormatError, SearchIndex
from vsekit.utils.io import sha256_file

# The default shortlist, max(factor * k, least), by how well a model's one-vector proxy ranks for its
# similarity (docs/benchmarks.md, "Two-stage CHAN search"): the mean of AVSE's views; the mean of a set's region
# vectors, which on a CHAN model trained on real pictures keeps 80 % of the exhaustive top-10 at 100 and 96.5 %
# at 500 (2,506 pictures).
VIEW_SHORTLIST = (10, 100)
SET_SHORTLIST = (50, 500)


@dataclass
class Hit:
    """One result. For text -> image, `id` is a picture id; for image -> text, a caption id."""

    id: int
    score: float
    path: str | None  # picture path relative to its root (None for a caption without a picture)
    file: str | None  # absolute path of the picture (None when missing or outside its root)
    caption: str | None
    picture: int | None = None  # picture id

    def public(self) -> dict:
        """The `--json` / API shape: path, score, caption (best first in a list)."""
        return {"path": self.file or self.path, "score": round(self.score, 6), "caption": self.caption}


class SearchEngine:
    """A loaded index plus the model that built it; thread-safe for concurrent searches (no state changes)."""

    def __init__(
        self,
        index: SearchIndex,
        model,
        run_cfg: dict,
        device: str | torch.device = "cpu",
        rerank_factor: int | None = None,
        rerank_min: int | None = None,
        shortlist: int | None = None,
    ) -> None:
        self.index = index
        self.model = model.eval()
        self.run_cfg = run_cfg
        self.device = torch.device(device)
        self.text = TextEmbedder(model, device)
        self.rerank = needs_rerank(model)
        self.sets = scores_sets(model)  # late interaction: pictures and queries are sets of vectors

        # (factor, least) of the default shortlists: pictures for a text query; captions for a picture query
        # (a set model re-encodes each shortlisted caption, so that side keeps the one-vector rule)
        def rule(default: tuple[int, int]) -> tuple[int, int]:
            return (
                default[0] if rerank_factor is None else rerank_factor,
                default[1] if rerank_min is None else rerank_min,
            )

        self.picture_rule = rule(SET_SHORTLIST if self.sets else VIEW_SHORTLIST)
        self.caption_rule = rule(VIEW_SHORTLIST)
        self.shortlist = check_shortlist(shortlist)
        self.emb_shape = tuple(index.meta.get("image_emb_shape") or [])
        self._images: ImageEmbedder | None = None
        self._images_lock = threading.Lock()

    @classmethod
    def open(
        cls,
        index_dir: str | Path,
        device: str | torch.device = "cpu",
        run_dir: str | Path | None = None,
        **kwargs,
    ) -> SearchEngine:
        """Open an index and load its model, refusing a model whose weights differ from the indexed ones."""
        from vsekit.runs import load_run, weights_path

        index = SearchIndex(index_dir)
        m = index.meta["model"]
        run = Path(run_dir) if run_dir else Path(m["run_dir"])
        weights = weights_path(run, m["checkpoint"])
        if not weights.is_file():
            raise IndexFormatError(
                f"{index_dir}: its model {weights} is missing; pass the run with --run RUN_DIR"
            )
        if sha256_file(weights) != m["weights_sha256"]:
            raise IndexFormatError(
                f"{weights} differs from the weights this index was built with (sha256 {m['weights_sha256'][:12]}); "
                "queries would not match the stored embeddings — rebuild the index with `vse index`"
            )
        model, cfg = load_run(run, m["checkpoint"], device)
        return cls(index, model, cfg, device, **kwargs)

    # ---------------------------------------------------------------------------------- helpers
    def _hit_for_picture(self, pid: int, score: float) -> Hit:
        pic = self.index.pictures[pid]
        f = self.index.picture_file(pid)
        return Hit(pid, score, pic["path"], str(f) if f else None, pic.get("caption"), pid)

    def _hit_for_caption(self, cid: int, score: float) -> Hit:
        cap = self.index.captions[cid]
        pid = cap.get("image")
        if pid is None:
            return Hit(cid, score, None, None, cap["text"], None)
        h = self._hit_for_picture(int(pid), score)
        return Hit(cid, score, h.path, h.file, cap["text"], int(pid))

    def _depth(self, k: int, n: int, rule: tuple[int, int], shortlist: int | None = None) -> int:
        """How many candidates the first stage hands the exact re-scoring: the call's `shortlist`, else the
        engine's, else max(factor*k, least) of `rule`; never fewer than k nor more than n. A model whose
        similarity is the inner product needs no re-scoring: k."""
        if not self.rerank:
            return min(k, n)
        depth = check_shortlist(shortlist) or self.shortlist or max(k * rule[0], rule[1])
        return min(n, max(k, depth))

    def shortlist_size(self, k: int, shortlist: int | None = None) -> int:
        """How many pictures a text query for k hits re-scores exactly (k when nothing is re-scored)."""
        return self._depth(k, self.index.n_pictures, self.picture_rule, shortlist)

    # ---------------------------------------------------------------------------------- text -> image
    @torch.no_grad()
    def search_text_vectors(
        self, queries: torch.Tensor, k: int, shortlist: int | None = None
    ) -> list[list[tuple[int, float]]]:
        """Text embeddings [Q, D] (a model of sets: [Q, L, D]) -> per query [(picture id, score)] best first;
        `shortlist`: the candidates re-scored exactly (`_depth`)."""
        n = self.index.n_pictures
        if n == 0 or k < 1:
            return [[] for _ in range(len(queries))]
        q = query_proxies(queries, self.model.recipe.model.embed_dim, self.sets)
        scores, ids = self.index.image_faiss.search(q, self._depth(k, n, self.picture_rule, shortlist))
        out = []
        for qi in range(len(q)):
            valid = ids[qi] >= 0
            cand, sc = ids[qi][valid], scores[qi][valid]
            if self.rerank and len(cand):
                emb = (
                    torch.from_numpy(self.index.image_emb(cand))
                    .reshape(len(cand), *self.emb_shape)
                    .to(self.device)
                )
                sc = self.model.sim(emb, queries[qi : qi + 1].to(self.device))[:, 0].float().cpu().numpy()
                order = np.argsort(-sc, kind="stable")
                cand, sc = cand[order], sc[order]
            out.append([(int(i), float(s)) for i, s in zip(cand[:k], sc[:k])])
        return out

    def search_text(self, query: str, k: int = 10, shortlist: int | None = None) -> list[Hit]:
        """Pictures that best match a text query (`shortlist`: see `search_text_vectors`)."""
        q = self.text.embed([query])
        return [self._hit_for_picture(i, s) for i, s in self.search_text_vectors(q, k, shortlist)[0]]

    # ---------------------------------------------------------------------------------- image -> text
    @property
    def images(self) -> ImageEmbedder:
        """The picture pipeline, built on first use (it loads the feature extractor)."""
        with self._images_lock:
            if self._images is None:
                self._images = ImageEmbedder(self.model, self.run_cfg, self.device)
        return self._images

    def picture_query_problem(self) -> str | None:
        """Why this index's model cannot embed a query picture, or None when it can; known from the run's
        config alone, so it is said before any picture is read or any extractor is built."""
        if reads_pixels(self.model.recipe.model.image.kind):  # a backbone or ViT: pixels in
            return None
        spec = run_extractor_spec(self.run_cfg)
        if spec is None:
            return (
                "its model was trained on precomputed features and its run records no feature extractor (no "
                "'extractor' in its config.json nor in its dataset's manifest.json), so a picture cannot be "
                "turned into the features the model reads; only text queries work"
            )
        if spec.get("name") not in SUPPORTED_EXTRACTORS:
            return (
                f"its model was trained on features from {spec.get('name')!r}, an extractor vsekit cannot run on "
                f"pictures (it runs {', '.join(SUPPORTED_EXTRACTORS)}); only text queries work"
            )
        return None

    @torch.no_grad()
    def search_image_vectors(self, image_emb: torch.Tensor, k: int) -> list[list[tuple[int, float]]]:
        """Image embeddings [Q, ...] -> per query [(caption id, score)] best first."""
        idx = self.index.caption_faiss
        n = self.index.n_captions
        if idx is None or n == 0 or k < 1:
            return [[] for _ in range(len(image_emb))]
        proxy = np.ascontiguousarray(proxy_vectors(self.model, image_emb).cpu().numpy())
        scores, ids = idx.search(proxy, self._depth(k, n, self.caption_rule))
        out = []
        for qi in range(len(proxy)):
            valid = ids[qi] >= 0
            cand, sc = ids[qi][valid], scores[qi][valid]
            if self.rerank and len(cand):
                if self.sets:  # an index keeps one vector per caption: the shortlist's word sets are re-made
                    txt = self.text.embed([self.index.captions[int(c)]["text"] for c in cand])
                else:
                    txt = torch.from_numpy(self.index.caption_emb(cand))
                txt = txt.to(self.device)
                sc = self.model.sim(image_emb[qi : qi + 1].to(self.device), txt)[0].float().cpu().numpy()
                order = np.argsort(-sc, kind="stable")
                cand, sc = cand[order], sc[order]
            out.append([(int(i), float(s)) for i, s in zip(cand[:k], sc[:k])])
        return out

    def embed_picture(self, image: str | Path | Image.Image) -> torch.Tensor:
        """The model's image embedding [1, ...] of one picture (a file path or a PIL image), through the inputs it
        was trained on (its feature extractor, or its pixel transform); VseInputError when it cannot embed one."""
        if why := self.picture_query_problem():
            raise VseInputError(why)
        pixels = self.images.load(image) if isinstance(image, (str, Path)) else self.images.prepare(image)
        return self.images.embed(pixels.unsqueeze(0))

    def search_image(self, image: str | Path | Image.Image, k: int = 10, distinct: bool = True) -> list[Hit]:
        """Indexed captions that best describe a picture (a file path or a PIL image).

        With `distinct`, a caption text shared by several pictures ("a red circle") is listed once.
        """
        emb = self.embed_picture(image)
        wide = 4 * k + 20 if distinct else k
        hits, seen = [], set()
        for i, s in self.search_image_vectors(emb, wide)[0]:
            h = self._hit_for_caption(i, s)
            if distinct and h.caption in seen:
                continue
            seen.add(h.caption)
            hits.append(h)
        return hits[:k]

    # ---------------------------------------------------------------------------------- image -> image
    @property
    def unit_picture_vectors(self) -> bool:
        """Whether the image FAISS index holds unit vectors (so its inner product is the picture cosine): a model
        that L2-normalises its embeddings, or a multi-view one (the views' mean is normalised)."""
        return self.rerank or bool(self.model.recipe.model.normalize)

    def _picture_width(self) -> int:
        """Values in one picture's stored image embedding (views x D for AVSE runs)."""
        return int(np.prod(self.emb_shape)) if self.emb_shape else self.model.recipe.model.embed_dim

    def picture_vectors(self, image_emb: torch.Tensor) -> np.ndarray:
        """Image embeddings [Q, ...] (as the model's `encode_image` gives them) -> the unit picture vectors [Q, D]
        that picture -> picture search compares by cosine (module docstring: the embedding, or its views' mean)."""
        emb = torch.as_tensor(image_emb).detach().float().cpu()
        width = self._picture_width()
        if emb.numel() == 0 or emb.numel() % width:
            raise VseInputError(
                f"image embedding of shape {list(emb.shape)}: this index holds pictures embedded to "
                f"{list(self.emb_shape) or [width]} values each (what the model's encode_image gives)"
            )
        if not torch.isfinite(emb).all():
            raise VseInputError("image embedding: it holds NaN or infinite values")
        v = proxy_vectors(self.model, emb.reshape(-1, width))
        return np.ascontiguousarray(torch.nn.functional.normalize(v, dim=-1).numpy(), dtype=np.float32)

    @torch.no_grad()
    def search_image_vectors_to_images(
        self, image_emb: torch.Tensor, k: int
    ) -> list[list[tuple[int, float]]]:
        """Image embeddings [Q, ...] -> per query [(picture id, cosine of the picture vectors)] best first."""
        q = self.picture_vectors(image_emb)
        n = self.index.n_pictures
        if n == 0 or k < 1:
            return [[] for _ in range(len(q))]
        k = min(k, n)
        if self.unit_picture_vectors:
            scores, ids = self.index.image_faiss.search(q, k)
            return [[(int(i), float(s)) for i, s in zip(ids[r], scores[r]) if i >= 0] for r in range(len(q))]
        # embeddings that are not unit length: their inner product is no cosine, so score the stored ones exactly
        best_s = np.full((len(q), 0), -np.inf, dtype=np.float32)
        best_i = np.zeros((len(q), 0), dtype=np.int64)
        for s, (pics, _) in enumerate(self.index.segment_spans()):
            if not len(pics):
                continue
            x = self.index.proxies(np.asarray(self.index.segment_arrays(s)[0]))
            x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
            best_s = np.concatenate([best_s, q @ x.T], axis=1)
            best_i = np.concatenate(
                [best_i, np.broadcast_to(np.arange(pics.start, pics.stop), (len(q), len(pics)))], axis=1
            )
            top = np.argsort(-best_s, axis=1, kind="stable")[:, :k]
            best_s, best_i = np.take_along_axis(best_s, top, 1), np.take_along_axis(best_i, top, 1)
        return [[(int(i), float(s)) for i, s in zip(best_i[r], best_s[r])] for r in range(len(q))]

    def search_image_to_images(
        self, image: str | Path | Image.Image | torch.Tensor, k: int = 10
    ) -> list[Hit]:
        """Indexed pictures most like a picture, best first: a file path or a PIL image (embedded as the index's
        pictures were), or that picture's image embedding as a tensor (e.g. from `model.encode_image`)."""
        emb = image if isinstance(image, torch.Tensor) else self.embed_picture(image)
        if emb.numel() > self._picture_width():
            raise VseInputError(
                f"image embedding of shape {list(emb.shape)}: give one picture's "
                f"({list(self.emb_shape)}); search_image_vectors_to_images takes several"
            )
        return [self._hit_for_picture(i, s) for i, s in self.search_image_vectors_to_images(emb, k)[0]]

    def info(self) -> dict:
        m = self.index.meta
        return {
            "pictures": self.index.n_pictures,
            "captions": self.index.n_captions,
            "index": self.index.params.kind,
            "similarity": m["model"]["similarity"],
            "rerank": self.rerank,
            "shortlist": self.shortlist if self.rerank else None,
            "recipe": m["model"].get("recipe"),
        }


def check_shortlist(shortlist: int | None) -> int | None:
    """A shortlist size as given (None: the default rule), or a VseInputError naming it when it is below 1."""
    if shortlist is None:
        return None
    if isinstance(shortlist, bool) or not isinstance(shortlist, (int, np.integer)) or shortlist < 1:
        raise VseInputError(f"shortlist: must be an integer of at least 1, got {shortlist!r}")
    return int(shortlist)
