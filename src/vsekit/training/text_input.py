"""The text processor of a run's model: a word vocabulary (built from the training captions, or read from
`model.text.vocab_path`) for encoders that declare `word_vocabulary`, else the transformer's tokenizer. The
spec records what was used, so a resumed run and its evaluation read captions the same way."""

from __future__ import annotations

from vsekit.config import Recipe
from vsekit.data.text import HFTextProcessor, Vocabulary
from vsekit.models.text import default_transformer_path, load_tokenizer
from vsekit.models.vse import DataSpec
from vsekit.registry import has_fact


def load_text_processor(
    recipe: Recipe, train_captions: list[str], spec: DataSpec
) -> Vocabulary | HFTextProcessor:
    """The processor for `recipe`'s text encoder; fills `spec.vocab_words` or `spec.text_model_path`."""
    t = recipe.model.text
    if has_fact("text_encoder", t.kind, "word_vocabulary"):
        if t.vocab_path:
            vocab = Vocabulary.load(t.vocab_path, t.tokenizer)
            t.tokenizer = vocab.tokenizer  # a SCAN vocabulary is read with nltk: the run records what it used
        else:
            vocab = Vocabulary.build(train_captions, t.vocab_min_count, t.tokenizer)
        spec.vocab_words = vocab.idx2word
        return vocab
    path = spec.text_model_path or t.model_path or default_transformer_path()
    spec.text_model_path = path
    return HFTextProcessor(load_tokenizer(path), t.max_tokens)
