"""Text repair for the SVG metadata: the two encoding accidents found in it, control characters and
whitespace, the word cap of a caption and the comparison key (case and punctuation ignored)."""

from __future__ import annotations

import html
import re
import unicodedata

MAX_WORDS = 40


def fix_text(text: str) -> str:
    """Undo the two encoding accidents found in the metadata: HTML entities ('Baden-W&uuml;rttemberg',
    sometimes twice) and UTF-8 read as Latin-1 ('LÃ©zard'). Repairs only; never changes real words."""
    for _ in range(2):
        if "&" not in text:
            break
        text = html.unescape(text)
    if "Ã" in text or "Â" in text:
        try:
            text = text.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass
    return text


def norm_text(text: str | None) -> str:
    """Repaired text, control characters removed and whitespace collapsed to one space."""
    text = fix_text(text or "")
    return " ".join("".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in text).split())


def cap_words(text: str, n: int = MAX_WORDS) -> str:
    """The first `n` words (every caption keeps at most MAX_WORDS)."""
    words = text.split()
    return " ".join(words[:n])


def text_key(text: str) -> str:
    """Comparison key: case and punctuation ignored."""
    return " ".join(re.findall(r"[^\W_]+", text.casefold()))
