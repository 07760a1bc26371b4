"""Image–text similarity functions: `sim(image_emb[Ni, ...], text_emb[Nt, D]) -> [Ni, Nt]`.

Evaluation and search call them through `all_pairs`, in shards, so memory stays bounded. The names below are
imported when first used, so `vsekit.similarity.parts` (the similarities a recipe may name) loads without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vsekit import registry

if TYPE_CHECKING:
    from torch import nn

    from vsekit.config import SimilarityConfig
    from vsekit.similarity.cosine import CosineSimilarity
    from vsekit.similarity.pairs import all_pairs

__all__ = ["CosineSimilarity", "all_pairs", "create_similarity"]


def create_similarity(cfg: SimilarityConfig, embed_dim: int, views: int = 1) -> nn.Module:
    """The similarity `cfg.name` names (a registered one) for `views` image embeddings of `embed_dim` each."""
    return registry.get("similarity", cfg.name).build(cfg, embed_dim, views)


def __getattr__(name: str) -> Any:
    if name == "CosineSimilarity":
        from vsekit.similarity import cosine as module
    elif name == "all_pairs":
        from vsekit.similarity import pairs as module
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(module, name)
