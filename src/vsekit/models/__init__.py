"""Encoders and the assembled VSE model."""

from vsekit.models.vse import DataSpec, VSEModel

__all__ = ["DataSpec", "VSEModel"]
