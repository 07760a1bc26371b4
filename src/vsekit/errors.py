"""The base types of "bad input" errors: what the user gave (a file, an option, a value) or the machine lacks.

`vse` prints these as one line naming the cause and exits 2 (vsekit.checks.EXPECTED_ERRORS); any other
exception is a bug in vsekit and is reported as an internal error. Every module-specific error type
(ConfigError, DataFormatError, MetricsInputError, CheckpointError, ReleasedCheckpointError, IndexFormatError)
derives from `VseInputError`, which is a ValueError so that `except ValueError` keeps catching them.

This module imports nothing heavy (no numpy, no torch): the CLI imports it before it knows the command.
"""

from __future__ import annotations


class VseInputError(ValueError):
    """Input that vsekit cannot use (a file, an option, a value), with a message naming the cause."""


class SetupError(VseInputError, RuntimeError):
    """The machine or installation cannot do what was asked (no CUDA, a missing optional package, a failed
    install step); also a RuntimeError, as these were before they had their own type."""


class MissingPackageError(SetupError, ImportError):
    """An optional package a feature needs is not installed (the message says what to pip install); also an
    ImportError, as these were before."""


DEVICE_CHOICES = "cpu, cuda, cuda:N, mps, auto"


def check_device_name(name: str, key: str = "--device", error: type[VseInputError] = VseInputError) -> str:
    """`name` when it is a device vsekit accepts (cpu, cuda, cuda:N, mps, auto), else `error` naming `key` and
    the valid choices (torch's own message lists twenty device types nobody means)."""
    value = str(name).strip()
    kind, sep, index = value.partition(":")
    ok = value == "auto" or (kind in ("cpu", "cuda", "mps") and (not sep or index.isdigit()))
    if not ok:
        raise error(f"{key} {name!r} is not a device; choose one of {DEVICE_CHOICES}")
    return value
