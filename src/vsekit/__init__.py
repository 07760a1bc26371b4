"""vsekit: visual-semantic embedding toolkit (VSE++, VSE∞/GPO, VSE+2AD, ladder loss, AVSE).

import vsekit
model = vsekit.load("runs/x")   # trained or imported (`vse import`) run -> encode_image / encode_text / similarity
"""

from __future__ import annotations

from typing import Any

from vsekit import registry as _registry

__version__ = "0.1.0"
__all__ = ["load"]


def _load_builtin_parts() -> None:
    """The parts that ship with vsekit register the first time the registry is asked (see vsekit.registry): the
    package root is above every layer, so `vsekit.config` validates recipes against them without importing them."""
    import vsekit.parts  # noqa: F401


_registry.add_loader(_load_builtin_parts)


def load(run: Any, device: Any = "cpu", checkpoint: str = "best") -> Any:
    """Load a run directory as a model in eval mode (see `vsekit.api`); torch is imported only here."""
    from vsekit.api import load as load_run_model

    return load_run_model(run, device, checkpoint)
