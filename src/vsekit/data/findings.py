"""Where the dataset layout rules report what they find, so that each rule is written once for two uses:
loading a split stops at the first error (`Findings`, the default: it raises), `vse data check` lists every
problem with its file and line or row (`vsekit.data.validate` collects them)."""

from __future__ import annotations

from pathlib import Path

from vsekit.errors import VseInputError


class Findings:
    """Raise `error` naming the file (and `where`: `:LINE`, ` row R`) at the first error; ignore warnings.

    A collecting subclass sets `collecting` and records instead; a rule then goes on where it can (a rule
    returns None for a value it could not read, and the caller skips what depends on it)."""

    collecting = False

    def __init__(self, error: type[Exception] = VseInputError) -> None:
        self.error_type = error

    def error(self, path: Path | str, where: str, message: str, kind: str | None = None) -> None:
        """A problem that stops a load; `kind` groups like problems of one file (for the collector's counts)."""
        raise self.error_type(f"{path}{where}: {message}")

    def warning(self, path: Path | str, where: str, message: str, kind: str | None = None) -> None:
        """A problem that does not stop a load (a load says nothing about it)."""
