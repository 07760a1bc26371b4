"""Range checks of numeric options, run while the command line is parsed (before anything is loaded).

`p.add_argument("--batch-size", type=int, action=at_least(1))`: a value out of range raises
`OptionValueError` from inside `parse_args`, which `vsekit.cli.main` prints as one line,
`vse eval: error: --batch-size must be at least 1, got 0`, and exit 2 (as every bad-input error), instead
of failing later in a library's words. `type=` still does the conversion (a word where a number belongs
is argparse's own usage error). No torch, no numpy.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable

from vsekit.errors import VseInputError


class OptionValueError(VseInputError):
    """A command-line option's value out of its range; `prog` is the parser's (`vse eval`, `vse data show`)."""

    def __init__(self, prog: str, message: str) -> None:
        super().__init__(message)
        self.prog = prog

    @property
    def command(self) -> str:
        """The top-level command (`vse data`, not `vse data show`), as the other errors name it."""
        return " ".join(self.prog.split()[:2])


def _checked(problem: Callable[[float], str | None], name: str) -> type[argparse.Action]:
    """An argparse Action that stores the value(s) after `problem(value)` found nothing wrong with each."""

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
    return _checked(lambda v: None if v >= low else f"must be at least {low}", f"AtLeast{low}")


def finite() -> type[argparse.Action]:
    """Each value a finite number (no nan / inf)."""
    return _checked(lambda v: None if math.isfinite(v) else "must be a finite number", "Finite")


def fraction() -> type[argparse.Action]:
    """Each value in (0, 1] (a share)."""
    return _checked(lambda v: None if 0.0 < v <= 1.0 else "must lie in (0, 1]", "Fraction")
