"""The text-only baseline of every probe: a caption plausibility model that never sees a picture.

A word trigram model with interpolated Kneser-Ney smoothing (Chen & Goodman 1998, one discount D per order),
trained on the run's own training captions. Its score of a caption is the caption's total log-probability,
start and end of sentence included. Scored on the same probe items as the model, it shows how much of a
probe score grammar and caption style alone explain: an order probe that this baseline passes can be
passed without looking at the picture (SugarCrepe's authors' point about ARO).

    P3(w | u v) = max(c(u v w) - D, 0) / c(u v .) + D N1+(u v .) / c(u v .) * P2(w | v)
    P2(w | v)   = max(N1+(. v w) - D, 0) / N1+(. v .) + D N1+(v .) / N1+(. v .) * P1(w)
    P1(w)       = max(N1+(. w) - D, 0) / N1+(. .) + D |words| / N1+(. .) / V

c counts occurrences, N1+ counts distinct words on the dotted side (continuation counts); a context never
seen gives all its mass to the lower order; V is the vocabulary plus the unknown word `<unk>`, so every
word, seen or not, gets a probability above zero and each distribution sums to one.
"""

from __future__ import annotations

import logging
import math
from collections import Counter
from collections.abc import Iterable

import numpy as np

from vsekit.data.text import tokenize_words

log = logging.getLogger(__name__)

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
DISCOUNT = 0.75  # Kneser & Ney's usual absolute discount, the same for every order


def words_of(caption: str) -> list[str]:
    """The tokens a caption gives the baseline: lower-cased regex words and punctuation (bounded as every
    caption is, `vsekit.data.text.tokenize_words`)."""
    return tokenize_words(caption, "regex")


class KneserNeyTrigram:
    """An interpolated Kneser-Ney word trigram model of captions (module docstring)."""

    def __init__(self, captions: Iterable[str], discount: float = DISCOUNT) -> None:
        if not 0 < discount < 1:
            raise ValueError(f"discount {discount} outside (0, 1)")
        self.d = discount
        tri: Counter = Counter()
        n_captions = 0
        for caption in captions:
            w = [BOS, BOS, *words_of(caption), EOS]
            tri.update(zip(w, w[1:], w[2:]))
            n_captions += 1
        self.n_captions = n_captions
        self.tri = tri
        self.ctx2: Counter = Counter()  # c(u v .)
        self.follow2: Counter = Counter()  # N1+(u v .)
        self.cont2: Counter = Counter()  # N1+(. v w)
        for (u, v, _w), c in tri.items():
            self.ctx2[(u, v)] += c
            self.follow2[(u, v)] += 1
        for _u, v, w in tri:
            self.cont2[(v, w)] += 1  # distinct u before (v, w)
        self.cont2_ctx: Counter = Counter()  # N1+(. v .) = sum over w of N1+(. v w)
        self.follow1: Counter = Counter()  # N1+(v .) among the bigram types (v, w)
        self.cont1: Counter = Counter()  # N1+(. w): distinct v before w
        for (v, w), c in self.cont2.items():
            self.cont2_ctx[v] += c
            self.follow1[v] += 1
            self.cont1[w] += 1
        self.cont1_total = sum(self.cont1.values())  # N1+(. .)
        self.vocab = set(self.cont1) | {UNK}
        log.info("text-only baseline: trigram model of %d captions, %d words", n_captions, len(self.vocab))

    def p_unigram(self, w: str) -> float:
        d, total = self.d, self.cont1_total
        if total == 0:
            return 1.0 / len(self.vocab)
        return max(self.cont1.get(w, 0) - d, 0.0) / total + d * len(self.cont1) / total / len(self.vocab)

    def p_bigram(self, v: str, w: str) -> float:
        ctx = self.cont2_ctx.get(v, 0)
        if ctx == 0:
            return self.p_unigram(w)
        d = self.d
        return max(self.cont2.get((v, w), 0) - d, 0.0) / ctx + d * self.follow1[v] / ctx * self.p_unigram(w)

    def p_trigram(self, u: str, v: str, w: str) -> float:
        ctx = self.ctx2.get((u, v), 0)
        if ctx == 0:
            return self.p_bigram(v, w)
        d = self.d
        return max(self.tri.get((u, v, w), 0) - d, 0.0) / ctx + d * self.follow2[
            (u, v)
        ] / ctx * self.p_bigram(v, w)

    def log_prob(self, caption: str) -> float:
        """Natural-log probability of the whole caption, `<s> <s>` before it and `</s>` after; a word never
        seen in training is `<unk>`."""
        w = [BOS, BOS, *(t if t in self.vocab else UNK for t in words_of(caption)), EOS]
        return float(sum(math.log(self.p_trigram(a, b, c)) for a, b, c in zip(w, w[1:], w[2:])))

    def scores(self, captions: Iterable[str]) -> np.ndarray:
        """`log_prob` of each caption (the baseline's similarity to any picture: it ignores the picture)."""
        return np.array([self.log_prob(c) for c in captions], dtype=np.float64)
