"""JSON read with bounds: the one owner of what a JSON document from elsewhere may hold.

`json.loads` lets a document decide our costs: nesting recurses once per level (a 100,000-deep list is a
RecursionError), an integer of thousands of digits is a quadratic conversion (Python refuses past 4,300
digits with a ValueError that names no file), and `"\\ud800"` decodes to a lone surrogate that fails later,
far from the file. `loads_bounded` checks depth before parsing, bounds every number's digits and refuses
lone surrogates, each as a `JsonBoundsError` (a `ValueError`) whose message names the document.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

MAX_JSON_DEPTH = 64  # arrays and objects inside each other: far above any config, vocabulary or caption file
MAX_NUMBER_CHARS = 40  # one number's characters: a float64 or an int64 needs at most ~25


class JsonBoundsError(ValueError):
    """A JSON document outside the bounds (too deep, an over-long number, a lone surrogate) or not JSON."""


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')  # a JSON string, escapes included
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_PAIR = re.compile(r"[\[{][\]}]")  # an innermost pair of brackets
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")  # only these can make a lone surrogate


def _too_deep(text: str, max_depth: int) -> bool:
    """Whether brackets outside strings nest deeper than `max_depth`, at the regex engine's speed (a Python loop
    over a 20 MB vocabulary takes seconds): strings dropped, then one level of innermost pairs removed a pass."""
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text))
    for _ in range(max_depth):
        reduced = _PAIR.sub("", brackets)
        if reduced == brackets:
            break
        brackets = reduced
    # what is left: pairs nested deeper than max_depth, or brackets never closed (each a level json recurses)
    unopened = len(brackets) - len(brackets.lstrip("]}"))
    return _PAIR.search(brackets) is not None or len(brackets) - unopened > max_depth


def _depth_problem(text: str, max_depth: int) -> str | None:
    """The first place where brackets nest deeper than `max_depth`, skipping brackets inside strings."""
    if not _too_deep(text, max_depth):
        return None
    depth = 0
    in_string = escaped = False
    for i, ch in enumerate(text):
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            if depth > max_depth:
                return f"nested more than {max_depth} levels deep (at character {i})"
        elif ch in "]}":
            depth -= 1
    return f"nested more than {max_depth} levels deep"


def _bounded_number(kind: type, limit: int, what: str):
    def parse(token: str):
        if len(token) > limit:
            raise JsonBoundsError(f"{what}: a number of {len(token):,} characters (at most {limit})")
        return kind(token)

    return parse


def _constant(what: str):
    def parse(token: str):  # NaN, Infinity, -Infinity: not JSON
        raise JsonBoundsError(f"{what}: {token} is not a JSON number")

    return parse


def _no_surrogates(value: Any, what: str, depth: int = 0) -> None:
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise JsonBoundsError(
                f"{what}: a lone surrogate \\u{ord(value[e.start]):04x} in a string (not valid Unicode)"
            ) from None
    elif isinstance(value, dict):
        for k, v in value.items():
            _no_surrogates(k, what, depth + 1)
            _no_surrogates(v, what, depth + 1)
    elif isinstance(value, list):
        for v in value:
            _no_surrogates(v, what, depth + 1)


def loads_bounded(
    text: str | bytes,
    what: str,
    max_depth: int = MAX_JSON_DEPTH,
    max_number_chars: int = MAX_NUMBER_CHARS,
) -> Any:
    """Parse `text` (bytes are read as UTF-8) as JSON within the bounds; `what` names the document (a file
    path, `shard.tar:x.json`) in every error."""
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise JsonBoundsError(f"{what}: not UTF-8 text (byte {e.start})") from None
    problem = _depth_problem(text, max_depth)
    if problem:
        raise JsonBoundsError(f"{what}: {problem}")
    try:
        value = json.loads(
            text,
            parse_int=_bounded_number(int, max_number_chars, what),
            parse_float=_bounded_number(float, max_number_chars, what),
            parse_constant=_constant(what),
        )
    except JsonBoundsError:
        raise
    except (json.JSONDecodeError, RecursionError, ValueError) as e:
        raise JsonBoundsError(f"{what}: not valid JSON ({e})") from None
    try:
        text.encode("utf-8")  # a str given with a surrogate character in it
    except UnicodeEncodeError as e:
        raise JsonBoundsError(
            f"{what}: a lone surrogate \\u{ord(text[e.start]):04x} (not valid Unicode)"
        ) from None
    if _SURROGATE_ESCAPE.search(text):  # the walk over every value only when an escape could pair badly
        _no_surrogates(value, what)
    return value


class JsonFileError(JsonBoundsError):
    """A JSON file that cannot be read or is larger than its bound; names the file."""


def read_json_file(path: str | Path, max_bytes: int, what: str = "a JSON file") -> Any:
    """The JSON of a file read within `max_bytes` (one byte more is read, never the whole of a larger file)
    and JSON's bounds (`loads_bounded`): the one reader of vsekit's own small JSON files (config.json, a
    vocabulary, a dataset manifest). A `JsonFileError` when it cannot be read or is too large (`what` names
    what it should have been), a `JsonBoundsError` when it is not bounded JSON; both name the file."""
    path = Path(path)
    try:
        with open(path, "rb") as f:
            raw = f.read(max_bytes + 1)
    except OSError as e:
        raise JsonFileError(f"{path}: cannot be read ({e.strerror or e})") from None
    if len(raw) > max_bytes:
        raise JsonFileError(f"{path}: larger than {max_bytes:,} bytes; not {what}")
    return loads_bounded(raw, str(path))
