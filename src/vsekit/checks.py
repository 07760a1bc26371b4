"""The error types that mean "bad input" (printed as one line by the CLI, exit 2) rather than a bug.

Only dedicated types: every vsekit input error derives from `vsekit.errors.VseInputError` (ConfigError,
DataFormatError, MetricsInputError, CheckpointError, ReleasedCheckpointError, IndexFormatError, SetupError,
MissingPackageError), plus the OS's own "this path cannot be used" errors. A bare ValueError or RuntimeError
is not here: raised from inside vsekit or a library it is a bug, and the CLI says so. Nothing heavy is
imported (no torch).
"""

from __future__ import annotations

from vsekit.errors import VseInputError

EXPECTED_ERRORS: tuple[type[BaseException], ...] = (
    VseInputError,
    FileNotFoundError,
    FileExistsError,
    IsADirectoryError,
    NotADirectoryError,
    PermissionError,
)
