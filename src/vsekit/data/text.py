"""Caption tokenisation for the two text encoders, with VSE∞'s text size augmentation, and the rules a
caption line must follow (`caption_problem`), which the dataset builders and `vse data check` share.

A caption is read up to MAX_CAPTION_CHARS characters and gives at most MAX_CAPTION_TOKENS words to the
BiGRU / bag-of-words vocabulary (the transformer's own `max_tokens` is smaller): one runaway caption (a 10 MB
line) costs what a long one does, never a padded batch of millions of tokens.

Augmentation (training only, VSE∞ `process_caption`): each word is picked with probability 0.2; a picked
word is masked (50%), replaced by a random token (10%) or deleted (40%).
"""

from __future__ import annotations

import re
import warnings
from array import array
from collections import Counter
from functools import lru_cache
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from vsekit.errors import MissingPackageError, VseInputError
from vsekit.utils.safe_json import JsonBoundsError, read_json_file

PAD, START, END, UNK, MASK = "<pad>", "<start>", "<end>", "<unk>", "<mask>"
SPECIALS = (PAD, START, END, UNK, MASK)
_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?|[^\sa-z0-9]")


TOKENIZERS = ("regex", "nltk")

MAX_CAPTION_CHARS = (
    10_000  # characters of a caption read; the builders skip and `vse data check` reports longer
)
MAX_CAPTION_TOKENS = 256  # words and punctuation of a caption given to a vocabulary (without <start> / <end>)

# A vocabulary JSON (a run's vocab.json, a recipe's vocab_path, a released model's SCAN vocabulary) may come from
# elsewhere. COCO's SCAN vocabulary is ~0.5 MB and 11,000 words; a word-piece vocabulary ~30,000.
MAX_VOCAB_BYTES = 64 << 20  # 64 MiB
MAX_VOCAB_WORDS = 1 << 22  # 4,194,304 words: 100x the largest vocabulary in use

# kinds of `caption_problem`
CONTROL_CHARACTER = "control character"
OVER_LONG = "over-long caption"
# C0 and C1 control characters and DEL, but not TAB: binary data or terminal escapes (`vse search` prints
# captions); a newline cannot occur inside a caption line
_CONTROL_RE = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def caption_problem(caption: str) -> tuple[str, str] | None:
    """(kind, what is wrong) of a caption line that cannot be used as it is, else None; the one rule of the
    builders (`vse data folder | table | webdataset` skip such a caption) and `vse data check` (a control
    character is an error, an over-long caption a warning: it is read up to MAX_CAPTION_CHARS characters)."""
    bad = _CONTROL_RE.search(caption)
    if bad is not None:
        return CONTROL_CHARACTER, (
            f"U+{ord(bad.group()):04X} at character {bad.start() + 1} (binary data or a terminal escape)"
        )
    if len(caption) > MAX_CAPTION_CHARS:
        return OVER_LONG, f"{len(caption):,} characters (the limit is {MAX_CAPTION_CHARS:,})"
    return None


# Abbreviations after which a period does not end a sentence (checked on the lower-cased caption). nltk's
# English punkt model, which the released `word_tokenize` call loads, learned a longer list from news text;
# these are the ones a caption plausibly holds. Only captions with a period *inside* them are affected.
_ABBREVIATIONS = frozenset(
    {"mr", "mrs", "ms", "dr", "st", "jr", "sr", "vs", "etc", "mt", "ft", "a.m", "p.m", "u.s", "e.g", "i.e"}
)


@lru_cache(maxsize=1)
def _nltk_tokenizers():
    """(sentence splitter, word tokenizer) of `nltk.word_tokenize`, built offline: nltk's punkt algorithm
    with `_ABBREVIATIONS` instead of the downloaded English model (punkt data is often not installed),
    then the Treebank word tokenizer `word_tokenize` runs on each sentence."""
    try:
        from nltk.tokenize import NLTKWordTokenizer
        from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    except ImportError as e:
        raise MissingPackageError("model.text.tokenizer=nltk needs the nltk package: pip install nltk") from e
    params = PunktParameters()
    params.abbrev_types = set(_ABBREVIATIONS)
    return PunktSentenceTokenizer(params), NLTKWordTokenizer()


def tokenize_words(caption: str, tokenizer: str = "regex") -> list[str]:
    """Lower-cased words and punctuation.

    `nltk` (the BiGRU recipes' default): the Treebank-style tokens the released VSE++/SCAN/VSE∞/VSE+2AD
    code gets from `nltk.tokenize.word_tokenize(caption.lower())` ("man" "'s", "does" "n't",
    "black-and-white" whole), which SCAN vocabularies were built with. Like that call it splits the caption
    into sentences with punkt, then runs the Treebank tokenizer on each, so "bike. he" gives "bike" "." "he";
    it needs no punkt data (see `_nltk_tokenizers`), and differs from the released call only where nltk's
    English model knows an abbreviation that `_ABBREVIATIONS` lacks. `regex`: dependency-free, keeps "man's"
    and "doesn't" whole and splits "black" "-" "and" "-" "white".

    Bounded: the first MAX_CAPTION_CHARS characters are read and the first MAX_CAPTION_TOKENS tokens kept.
    """
    text = caption[:MAX_CAPTION_CHARS].lower()
    if tokenizer == "regex":
        return [m.group() for m in islice(_WORD_RE.finditer(text), MAX_CAPTION_TOKENS)]
    if tokenizer == "nltk":
        sentences, words = _nltk_tokenizers()
        tokens = (w for sent in sentences.tokenize(text) for w in words.tokenize(sent))
        return list(islice(tokens, MAX_CAPTION_TOKENS))
    raise VseInputError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")


# a picked word (probability p) is masked when u/p < MASKED_BELOW, replaced by a random word when u/p <
# RANDOM_BELOW, else deleted (u: the word's uniform draw); `augment_words` and the batched form
# `vsekit.data.datasets.augment_token_batch` share these
MASKED_BELOW, RANDOM_BELOW = 0.5, 0.6


def augment_words(
    words: list, rng: np.random.Generator, prob: float, mask_token: object, random_token
) -> list:
    """VSE∞ size augmentation on a list of word units (each unit a token or a list of word-pieces)."""
    out = []
    for w in words:
        r = rng.random()
        if r < prob:
            r /= prob
            if r < MASKED_BELOW:
                out.append(mask_token(w) if callable(mask_token) else mask_token)
            elif r < RANDOM_BELOW:
                out.append(random_token(w))
            # else: deleted
        else:
            out.append(w)
    return out


def read_vocab_json(path: str | Path) -> Any:
    """The JSON of a vocabulary file, read within `MAX_VOCAB_BYTES` and JSON's bounds (`loads_bounded`): a
    problem is one VseInputError naming the file, never a RecursionError or a read of gigabytes."""
    try:
        return read_json_file(path, MAX_VOCAB_BYTES, "a vocabulary JSON")
    except JsonBoundsError as e:
        raise VseInputError(f"cannot read vocabulary JSON: {e}") from None


def vocab_words(words: Any, path: str | Path, key: str = "words") -> list[str]:
    """`words` when it is a list of at most `MAX_VOCAB_WORDS` strings, else one VseInputError naming the file."""
    if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
        raise VseInputError(f"{path}: {key!r} must be a list of words (strings)")
    if len(words) > MAX_VOCAB_WORDS:
        raise VseInputError(
            f"{path}: {len(words):,} words, more than a vocabulary may hold ({MAX_VOCAB_WORDS:,})"
        )
    return words


class Vocabulary:
    """Word <-> index map for the BiGRU encoder; specials <pad>=0 <start>=1 <end>=2 <unk>=3, and <mask>
    (4 in vocabularies vsekit builds; after the last word in SCAN vocabularies, as the released code adds it)."""

    def __init__(self, words: list[str], tokenizer: str = "regex") -> None:
        if list(words[:4]) != list(SPECIALS[:4]) or MASK not in words:
            raise VseInputError(f"vocabulary must start with {SPECIALS[:4]} and contain {MASK}")
        if tokenizer not in TOKENIZERS:
            raise VseInputError(f"unknown tokenizer {tokenizer!r}; choose one of {', '.join(TOKENIZERS)}")
        self.tokenizer = tokenizer
        self.idx2word = list(words)
        self.word2idx = {w: i for i, w in enumerate(self.idx2word)}
        # word ids of each caption seen, for the nltk tokenizer (~100 µs a caption; regex takes ~2 µs), so a
        # training epoch after the first does not tokenise again
        self._ids: dict[str, array] = {}

    @classmethod
    def build(cls, captions: list[str], min_count: int = 1, tokenizer: str = "regex") -> Vocabulary:
        """From training captions only (never dev/test: vsepp#29 built its vocabulary with test captions)."""
        counts = Counter(w for c in captions for w in tokenize_words(c, tokenizer))
        words = sorted(w for w, n in counts.items() if n >= min_count and w not in SPECIALS)
        return cls(list(SPECIALS) + words, tokenizer)

    @classmethod
    def load(cls, path: str | Path, tokenizer: str | None = None) -> Vocabulary:
        """vsekit's `{"words": [...]}` (tokenised with `tokenizer`, default regex) or SCAN's vocabulary JSON.

        A SCAN vocabulary holds nltk's Treebank tokens ("'s", "n't"), so it is always read with the `nltk`
        tokenizer: with `regex`, "man's" would be looked up whole and become <unk>. Asking for another
        tokenizer with one is a warning, and the returned vocabulary's `tokenizer` says what is used.
        """
        path = Path(path)
        data = read_vocab_json(path)
        if isinstance(data, dict) and "idx2word" in data:  # SCAN's vocab JSON
            i2w = data["idx2word"]
            if not isinstance(i2w, (dict, list)):
                raise VseInputError(f"{path}: 'idx2word' must be an object of id -> word or a list of words")
            try:
                words = [i2w[str(i)] for i in range(len(i2w))] if isinstance(i2w, dict) else list(i2w)
            except KeyError as e:
                raise VseInputError(
                    f"{path}: idx2word has no entry for id {e}; ids must be 0..{len(i2w) - 1}"
                ) from e
            words = vocab_words(words, path, "idx2word")
            # SCAN ids are kept as they are (a released model's embedding rows follow them); the released
            # training and evaluation code append <mask> after the last word, and so do we
            if MASK not in words:
                words.append(MASK)
            if tokenizer not in (None, "nltk"):
                warnings.warn(
                    f"{path}: a SCAN vocabulary holds nltk's Treebank tokens; tokenizer={tokenizer!r} "
                    'would turn words like "man\'s" into <unk>, so nltk is used',
                    stacklevel=2,
                )
            return cls(words, "nltk")
        if isinstance(data, dict) and "words" in data:
            return cls(vocab_words(data["words"], path), tokenizer or "regex")
        raise VseInputError(f"{path}: expected {{'words': [...]}} or SCAN's {{'idx2word': ...}}")

    def __len__(self) -> int:
        return len(self.idx2word)

    def word_ids(self, caption: str) -> list[int]:
        """Ids of the caption's words (no <start>/<end>), unknown words as <unk>."""
        ids = self._ids.get(caption)
        if ids is None:
            unk = self.word2idx[UNK]
            ids = array("l", [self.word2idx.get(w, unk) for w in tokenize_words(caption, self.tokenizer)])
            if self.tokenizer != "regex":
                self._ids[caption] = ids
        return ids.tolist()

    def random_word_range(self) -> tuple[int, int]:
        """[low, high) of the ids the augmentation's "random word" draws from (the words, not the specials)."""
        return len(SPECIALS), max(len(self), len(SPECIALS) + 1)

    def encode(
        self, caption: str, rng: np.random.Generator | None = None, augment_prob: float = 0.0
    ) -> list[int]:
        ids = [self.word2idx[START]] + self.word_ids(caption) + [self.word2idx[END]]
        if rng is not None and augment_prob > 0:
            lo, hi = self.random_word_range()
            ids = augment_words(
                ids,
                rng,
                augment_prob,
                self.word2idx[MASK],
                lambda _w: int(rng.integers(lo, hi)),
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

    def encode(
        self, caption: str, rng: np.random.Generator | None = None, augment_prob: float = 0.0
    ) -> list[int]:
        words = caption[:MAX_CAPTION_CHARS].split()  # a runaway caption: its first characters only
        pieces = [self.tok.encode(w, add_special_tokens=False) for w in words]
        pieces = [p for p in pieces if p]
        if rng is not None and augment_prob > 0:
            pieces = augment_words(
                pieces,
                rng,
                augment_prob,
                lambda w: [self.mask_id] * len(w),
                lambda w: [int(x) for x in rng.integers(1000, self.vocab_size, size=len(w))],
            )
        flat = [i for p in pieces for i in p][: self.max_tokens - 2]
        return [self.cls_id] + flat + [self.sep_id]
