"""The error types that mean "bad input" (printed as one line by the CLI) rather than a bug."""

from __future__ import annotations

from vsekit.config import ConfigError
from vsekit.data.precomp import DataFormatError
from vsekit.interop.checkpoint_reader import ReleasedCheckpointError
from vsekit.metrics import MetricsInputError
from vsekit.training.checkpoint import CheckpointError

EXPECTED_ERRORS: tuple[type[BaseException], ...] = (
    ConfigError,
    DataFormatError,
    MetricsInputError,
    CheckpointError,
    ReleasedCheckpointError,
    FileNotFoundError,
    PermissionError,
    RuntimeError,
    ValueError,
)
