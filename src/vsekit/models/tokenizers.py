"""The tokeniser a model was trained with: its BiGRU vocabulary, or its transformer's tokenizer (with the
recipe's token limit). Lives with the models so that a model encodes strings without evaluation code."""

from __future__ import annotations

from torch import nn

from vsekit.data.text import HFTextProcessor, Vocabulary
from vsekit.models.text import load_tokenizer
from vsekit.registry import has_fact


def text_processor_for(model: nn.Module):
    """The tokeniser a model was trained with (BiGRU vocabulary or the transformer's tokenizer)."""
    if has_fact("text_encoder", model.recipe.model.text.kind, "word_vocabulary"):
        return Vocabulary(model.spec.vocab_words, model.recipe.model.text.tokenizer)
    return HFTextProcessor(load_tokenizer(model.spec.text_model_path), model.recipe.model.text.max_tokens)


def pad_id_for(text) -> int:
    return getattr(text, "pad_id", 0)
