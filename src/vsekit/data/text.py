"""Caption tokenisation for the two text encoders, with VSE∞'s text size augmentation.

Augmentation (training only, VSE∞ `process_caption`): each word is picked with probability 0.2; a picked
word is masked (50%), replaced by a random token (10%) or deleted (40%).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np

PAD, START, END, UNK, MASK = "<pad>", "<start>", "<end>", "<unk>", "<mask>"
SPECIALS = (PAD, START, END, UNK, MASK)
_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


TOKENIZERS = ("regex", "nltk")


def tokenize_words(caption: str, tokenizer: str = "regex") -> list[str]:
    """Lower-cased words and punctuation.

    `regex`: dependency-free (keeps "man's" whole, splits "t-shirt"). `nltk`: the Treebank-style tokens the
    released VSE++/SCAN/VSE∞/VSE+2AD code gets from `nltk.word_tokenize` ("man" "'s", "t-shirt" whole), which
    SCAN vocabularies were built with; run on the caption as one line (`preserve_line`), so no punkt data is
    needed — it differs from the released call only on a period inside a multi-sentence caption.
    """
    if tokenizer == "regex":
        return _WORD_RE.findall(caption.lower())
    if tokenizer == "nltk":
        try:
            from nltk.tokenize import word_tokenize
        except ImportError as e:
            raise RuntimeError("model.text.tokenizer=nltk needs the nltk package: pip install nltk") from e
        return word_tokenize(caption.lower(), preserve_line=True)
    raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")


def augment_words(
    words: list, rng: np.random.Generator, prob: float, mask_token: object, random_token
) -> list:
    """VSE∞ size augmentation on a list of word units (each unit a token or a list of word-pieces)."""
    out = []
    for w in words:
        r = rng.random()
        if r < prob:
            r /= prob
            if r < 0.5:
                out.append(mask_token(w) if callable(mask_token) else mask_token)
            elif r < 0.6:
                out.append(random_token(w))
            # else: deleted
        else:
            out.append(w)
    return out


class Vocabulary:
    """Word <-> index map for the BiGRU encoder; specials <pad>=0 <start>=1 <end>=2 <unk>=3, and <mask>
    (4 in vocabularies vsekit builds; after the last word in SCAN vocabularies, as the released code adds it)."""

    def __init__(self, words: list[str], tokenizer: str = "regex") -> None:
        if list(words[:4]) != list(SPECIALS[:4]) or MASK not in words:
            raise ValueError(f"vocabulary must start with {SPECIALS[:4]} and contain {MASK}")
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
        self.tokenizer = tokenizer
        self.idx2word = list(words)
        self.word2idx = {w: i for i, w in enumerate(self.idx2word)}

    @classmethod
    def build(cls, captions: list[str], min_count: int = 1, tokenizer: str = "regex") -> Vocabulary:
        """From training captions only (never dev/test: vsepp#29 built its vocabulary with test captions)."""
        counts = Counter(w for c in captions for w in tokenize_words(c, tokenizer))
        words = sorted(w for w, n in counts.items() if n >= min_count and w not in SPECIALS)
        return cls(list(SPECIALS) + words, tokenizer)

    @classmethod
    def load(cls, path: str | Path, tokenizer: str = "regex") -> Vocabulary:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise ValueError(f"{path}: cannot read vocabulary JSON ({e})") from e
        if isinstance(data, dict) and "idx2word" in data:  # SCAN's vocab JSON
            i2w = data["idx2word"]
            try:
                words = [i2w[str(i)] for i in range(len(i2w))] if isinstance(i2w, dict) else list(i2w)
            except KeyError as e:
                raise ValueError(f"{path}: idx2word has no entry for id {e}; ids must be 0..{len(i2w) - 1}") from e
            # SCAN ids are kept as they are (a released model's embedding rows follow them); the released
            # training and evaluation code append <mask> after the last word, and so do we
            if MASK not in words:
                words.append(MASK)
            return cls(words, tokenizer)
        if isinstance(data, dict) and "words" in data:
            return cls(data["words"], tokenizer)
        raise ValueError(f"{path}: expected {{'words': [...]}} or SCAN's {{'idx2word': ...}}")

    def to_json(self) -> dict:
        return {"words": self.idx2word}

    def __len__(self) -> int:
        return len(self.idx2word)

    def encode(self, caption: str, rng: np.random.Generator | None = None, augment_prob: float = 0.0) -> list[int]:
        ids = [self.word2idx.get(w, self.word2idx[UNK]) for w in tokenize_words(caption, self.tokenizer)]
        ids = [self.word2idx[START]] + ids + [self.word2idx[END]]
        if rng is not None and augment_prob > 0:
            n = len(self)
            ids = augment_words(
                ids, rng, augment_prob, self.word2idx[MASK], lambda _w: int(rng.integers(len(SPECIALS), max(n, len(SPECIALS) + 1)))
            )
            if not ids:
                ids = [self.word2idx[START], self.word2idx[END]]
        return ids


class HFTextProcessor:
    """Word-piece ids for a local HuggingFace tokenizer, augmenting whole words as VSE∞ does for BERT."""

    def __init__(self, tokenizer, max_tokens: int = 64) -> None:
        self.tok = tokenizer
        self.max_tokens = max_tokens
        self.cls_id = tokenizer.cls_token_id
        self.sep_id = tokenizer.sep_token_id
        self.mask_id = tokenizer.mask_token_id
        self.pad_id = tokenizer.pad_token_id or 0
        self.vocab_size = len(tokenizer)

    def encode(self, caption: str, rng: np.random.Generator | None = None, augment_prob: float = 0.0) -> list[int]:
        words = caption.split()
        pieces = [self.tok.encode(w, add_special_tokens=False) for w in words]
        pieces = [p for p in pieces if p]
        if rng is not None and augment_prob > 0:
            pieces = augment_words(
                pieces, rng, augment_prob,
                lambda w: [self.mask_id] * len(w),
                lambda w: [int(x) for x in rng.integers(1000, self.vocab_size, size=len(w))],
            )  # fmt: skip
        flat = [i for p in pieces for i in p][: self.max_tokens - 2]
        return [self.cls_id] + flat + [self.sep_id]
