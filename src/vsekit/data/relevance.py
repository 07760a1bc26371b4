"""Moved: the relevance computation (sentence embeddings, caching) is `vsekit.relevance`, and the image-level
combination of a relevance matrix is `vsekit.metrics.coherence.image_caption_relevance`. This name is kept
so that existing imports of the computation keep working; new code imports `vsekit.relevance`."""

from vsekit.relevance import (
    FORMAT,
    POOLING,
    cache_location,
    cached_relevance,
    model_fingerprint,
    relevance_from_embeddings,
    sentence_embeddings,
    split_caption_embeddings,
    split_relevance,
)

__all__ = [
    "FORMAT",
    "POOLING",
    "cache_location",
    "cached_relevance",
    "model_fingerprint",
    "relevance_from_embeddings",
    "sentence_embeddings",
    "split_caption_embeddings",
    "split_relevance",
]
