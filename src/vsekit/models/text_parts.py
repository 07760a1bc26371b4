"""The caption encoders a recipe names (`model.text.kind`): each one's settings and builder, registered in
`vsekit.registry`. Torch-free (the builders import their module when called). A builder is given the recipe and
the run's `DataSpec` (vocabulary, transformer directory) and returns the encoder: tokens -> a set of vectors ->
the recipe's pooling -> one embedding."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vsekit.registry import (
    MAX_BATCH,
    MAX_CACHE_MB,
    MAX_COUNT,
    MAX_WIDTH,
    Settings,
    pooling_encoder,
    register,
    setting,
)


@dataclass
class WordSettings(Settings):
    word_dim: int = setting(300, "size of the learned word embeddings", rule=">= 1", max=MAX_WIDTH)
    vocab_min_count: int = setting(
        1,
        "words seen fewer times in the train captions are <unk> (the BiGRU "
        "recipes set 4, SCAN's vocabularies)",
        rule=">= 0",
    )
    tokenizer: str = setting(
        "regex",
        "regex (dependency-free) | nltk (the released code's Treebank "
        "tokens; the BiGRU recipes set it, and a SCAN vocab_path is always read with it)",
        choices=("regex", "nltk"),
    )
    vocab_path: str = setting("", "a vocabulary JSON; empty = built from the train split's captions")


@dataclass
class BiGRUSettings(WordSettings):
    num_layers: int = setting(1, "number of GRU layers", rule=">= 1", max=MAX_COUNT)
    word_dropout: float = setting(
        0.0,
        "dropout on the word vectors in training, from the step's generator (IN2R's encoders: 0.3; two "
        "forward passes of one batch then differ)",
        rule="in [0, 1)",
    )


@dataclass
class TransformerSettings(Settings):
    model_path: str = setting(
        "", "a local Hugging Face model directory; empty = the packaged all-MiniLM-L6-v2"
    )
    lr_mult: float = setting(0.1, "learning-rate multiplier of the body", rule=">= 0 and finite")
    freeze: bool = setting(
        False,
        "the body frozen, a fixed feature extractor in eval mode (no dropout); projection and pooling train",
    )
    frozen_cache_mb: int = setting(
        1024,
        "frozen body only: keep each distinct caption's token states (they never "
        "change) up to this many MB, so every epoch after the first skips the body "
        "for captions it has seen; 0 = run the body every step",
        rule=">= 0",
        max=MAX_CACHE_MB,
    )
    max_tokens: int = setting(64, "captions are cut to this many tokens", rule=">= 1", max=MAX_WIDTH)
    length_sorted_chunk: int = setting(
        32,
        "run the body on length-sorted chunks of this many captions, "
        "each padded only to its own longest (same states up to float rounding; "
        "2-3x faster on short captions); 0 = one padded batch",
        rule=">= 0",
        max=MAX_BATCH,
    )
    head: str = setting(
        "linear",
        "linear (hidden -> embed) | residual_mlp (linear + the region encoder's residual MLP, AVSE)",
        choices=("linear", "residual_mlp"),
    )
    head_mlp_hidden: int = setting(
        512, "residual_mlp head: hidden size of the MLP", rule=">= 1", max=MAX_WIDTH
    )
    final_layernorm: bool = setting(
        False, "LayerNorm on the pooled caption instead of L2 normalisation (AVSE's released text encoder)"
    )
    word_bag: bool = setting(
        False,
        "add a learned bag of the tokenizer's word pieces (mean of trainable "
        "embeddings of the same token ids) to the caption embedding: the bag-of-words "
        "floor's fit to the data beside the pretrained body's knowledge (the small_data "
        "recipe)",
    )


def _vocabulary_size(kind: str, spec: Any) -> int:
    if not spec.vocab_words:
        raise ValueError(f"a {kind} text encoder needs a vocabulary (DataSpec.vocab_words)")
    return len(spec.vocab_words)


def _bigru(recipe: Any, spec: Any) -> Any:
    from vsekit.models.text import BiGRUTextEncoder

    m = recipe.model
    _vocabulary_size("bigru", spec)
    own = pooling_encoder("text", "bigru", recipe, spec)
    if own is not None:
        return own
    return BiGRUTextEncoder(_vocabulary_size("bigru", spec), m.embed_dim, m.text)


def _bow(recipe: Any, spec: Any) -> Any:
    from vsekit.models.text import BagOfWordsTextEncoder

    m = recipe.model
    return BagOfWordsTextEncoder(_vocabulary_size("bow", spec), m.embed_dim, m.text)


def _transformer(recipe: Any, spec: Any) -> Any:
    from vsekit.models.text import TransformerTextEncoder

    m = recipe.model
    encoder = TransformerTextEncoder(m.embed_dim, m.text, spec.text_model_path)
    spec.text_model_path = encoder.model_path  # the directory actually used, saved with the run
    return encoder


register(
    "text_encoder",
    "bigru",
    BiGRUSettings,
    build=_bigru,
    help="a bidirectional GRU over learned word embeddings (directions averaged)",
    facts={"word_vocabulary": True, "cuda_graph": True},
)
register(
    "text_encoder",
    "bow",
    WordSettings,
    build=_bow,
    help="the mean of learned word embeddings: the linear floor every results table carries",
    facts={"word_vocabulary": True, "cuda_graph": True},
)
register(
    "text_encoder",
    "transformer",
    TransformerSettings,
    build=_transformer,
    help="a Hugging Face transformer body (all-MiniLM-L6-v2 by default) + a projection",
)
