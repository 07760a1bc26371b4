"""Range checks of the numeric options of `vse index`, `vse embed`, `vse search` and `vse serve`.

They follow `vsekit.commands.argtypes`: `type=int` converts (a word where a number belongs is argparse's own
usage error) and the action checks the range while the command line is parsed, raising `OptionValueError`,
which `vsekit.cli.main` prints as one line — `vse index: error: --chunk-size must be at least 1, got 0` —
with exit 2, before any model is loaded or any file is written. The library functions keep their own checks
for callers that do not go through the CLI.

No torch or numpy here: command modules import this at start-up.
"""

from __future__ import annotations

import argparse
import math

from vsekit.commands.argtypes import OptionValueError

INT32_MAX = 2**31 - 1  # FAISS and torch take these knobs as C ints; larger values overflow there


def in_range(low: float, high: float | None = INT32_MAX, note: str = "", finite: bool = False) -> type[argparse.Action]:
    """An argparse Action: the value must lie in [low, high] (`high=None`: no upper bound) and, with
    `finite`, be a finite number (NaN and infinity would silently turn a limit off); `note` says what a
    special value means ("0 = automatic")."""
    extra = f" ({note})" if note else ""

    class InRange(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:
            value = values
            if finite and not math.isfinite(value):
                said = f"must be a finite number{extra}"
            elif value < low:
                said = f"must be at least {low}{extra}"
            elif high is not None and value > high:
                said = f"must be at most {high}{extra}"
            else:
                setattr(namespace, self.dest, value)
                return
            raise OptionValueError(parser.prog, f"{option_string or self.dest} {said}, got {value}")

    return InRange


POSITIVE = in_range(1)  # a count: batch size, chunk size, k, FAISS knobs
PORT = in_range(0, 65535, "a TCP port; 0 = any free port")
