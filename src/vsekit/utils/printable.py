"""Text from elsewhere made safe to show on a terminal: the one owner of that rule (docs/security.md).

A file name, a table cell, a shard member or a caption can hold `ESC ] 0 ; … BEL` (retitles the terminal) or
`ESC [ 2K CR FAKE: dataset ready` (erases the line and forges another). Every warning, problem report and
error that carries such a string passes it through `printable`, which shows each control character as an
escape instead of sending it: C0 (tab, newline and carriage return included: inside a name they are not
layout), DEL, C1 (0x80-0x9f), the Unicode line and paragraph separators and bidirectional overrides (they
reorder what is shown), and lone surrogates. A surrogate escape (a byte of a file name that is not UTF-8,
as Python carries it) is shown as the byte, `\\xNN`; another lone surrogate as `\\udNNN`.
The result is valid UTF-8 and `printable(printable(s)) == printable(s)`.
"""

from __future__ import annotations

import re

# C0, DEL, C1; U+2028 / U+2029; the bidi embeddings, overrides and isolates; every surrogate
_UNSAFE_RE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(m: re.Match) -> str:
    code = ord(m.group())
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape of an undecodable byte: show the byte
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"


def printable(text: object) -> str:
    """`text` (any object: its `str`) with every control character, line separator, bidi override and lone
    surrogate shown as `\\xNN` / `\\uNNNN`, so it can be printed or logged without the terminal obeying it."""
    s = text if isinstance(text, str) else str(text)
    return _UNSAFE_RE.sub(_escape, s)


def printable_lines(text: object) -> str:
    """`printable` of each line of a message made of several lines (a `--strict` list of problems): the
    newlines between them are kept, every other control character is escaped."""
    s = text if isinstance(text, str) else str(text)
    return "\n".join(printable(line) for line in s.split("\n"))


__all__ = ["printable", "printable_lines"]
