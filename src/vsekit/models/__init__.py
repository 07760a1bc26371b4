"""Encoders and the assembled VSE model.

The names below are imported when first used, so `vsekit.models.image_parts` / `text_parts` (the encoders a
recipe may name, their settings) load without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vsekit.models.vse import DataSpec, VSEModel

__all__ = ["DataSpec", "VSEModel"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from vsekit.models import vse

        return getattr(vse, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
