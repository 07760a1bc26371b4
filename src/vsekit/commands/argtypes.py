"""Range checks of numeric options, run while the command line is parsed (before anything is loaded): the one
checker every `vse` command uses, the lab's verbs (`vse bench …`, `vse demo`, `vse experiment …`) included.

`p.add_argument("--batch-size", type=int, action=at_least(1))`: a value out of range raises
`OptionValueError` from inside `parse_args`, which `vsekit.cli.main` prints as one line,
`vse eval: error: --batch-size must be at least 1, got 0`, and exit 2 (as every bad-input error), instead
of failing later in a library's words. `type=` still does the conversion (a word where a number belongs
is argparse's own usage error). The library functions keep their own checks for callers that do not go
through the command line. No torch, no numpy: command modules import this at start-up.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from vsekit.errors import VseInputError

INT32_MAX = 2**31 - 1  # FAISS and torch take many knobs as C ints; larger values overflow there


class OptionValueError(VseInputError):
    """A command-line option's value out of its range; `prog` is the parser's (`vse eval`, `vse data show`)."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog

    @property
    def command(self) -> str:
        """The top-level command (`vse data`, not `vse data show`), as the other errors name it."""
        return " ".join(self.prog.split()[:2])


def checked(problem: Callable[[float], str | None], name: str) -> type[argparse.Action]:
    """An argparse Action that stores the value(s) after `problem(value)` found nothing wrong with each (the
    message is "OPTION PROBLEM, got VALUE"); the helpers below are made of it, a rule of its own too."""

    class Checked(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:
            for value in values if isinstance(values, list) else [values]:
                said = problem(value)
                if said:
                    raise OptionValueError(parser.prog, f"{option_string or self.dest} {said}, got {value}")
            setattr(namespace, self.dest, values)

    Checked.__name__ = Checked.__qualname__ = name
    return Checked


def at_least(low: int) -> type[argparse.Action]:
    """Each value >= `low` (1: a count, a batch size, a K; 0: a seed)."""
    return checked(lambda v: None if v >= low else f"must be at least {low}", f"AtLeast{low}")


def between(low: int, high: int) -> type[argparse.Action]:
    """Each value in [`low`, `high`] (a size whose top end would exhaust memory: a picture side in pixels)."""
    return checked(
        lambda v: None if low <= v <= high else f"must lie in {low}..{high}", f"Between{low}And{high}"
    )


def finite() -> type[argparse.Action]:
    """Each value a finite number (no nan / inf)."""
    return checked(lambda v: None if math.isfinite(v) else "must be a finite number", "Finite")


def positive_number() -> type[argparse.Action]:
    """Each value a finite number above 0 (a learning rate, a duration in seconds)."""
    return checked(
        lambda v: None if math.isfinite(v) and v > 0 else "must be a finite number above 0", "PositiveNumber"
    )


def fraction() -> type[argparse.Action]:
    """Each value in (0, 1] (a share)."""
    return checked(lambda v: None if 0.0 < v <= 1.0 else "must lie in (0, 1]", "Fraction")


def in_range(
    low: float, high: float | None = INT32_MAX, note: str = "", finite: bool = False
) -> type[argparse.Action]:
    """Each value in [`low`, `high`] (`high=None`: no upper bound; the default keeps a C int from overflowing)
    and, with `finite`, a finite number (NaN and infinity would silently turn a limit off); `note` says what a
    special value means ("0 = automatic")."""
    extra = f" ({note})" if note else ""

    def problem(v: float) -> str | None:
        if finite and not math.isfinite(v):
            return f"must be a finite number{extra}"
        if v < low:
            return f"must be at least {low}{extra}"
        if high is not None and v > high:
            return f"must be at most {high}{extra}"
        return None

    return checked(problem, "InRange")


POSITIVE = in_range(1)  # a count: batch size, chunk size, k, FAISS knobs, repeats, dimensions
PORT = in_range(0, 65535, "a TCP port; 0 = any free port")
