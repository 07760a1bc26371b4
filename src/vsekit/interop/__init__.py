"""Interoperability with other code: importers for the released research checkpoints, and a run as the
(model, transform, tokenizer) of CLIP_benchmark / open_clip code (`load_for_clip_benchmark`, docs/interop.md)."""

from __future__ import annotations

from typing import Any

__all__ = ["load_for_clip_benchmark"]


def __getattr__(name: str) -> Any:
    """Lazy export: `import vsekit.interop` stays free of torch until the wrapper is asked for."""
    if name == "load_for_clip_benchmark":
        from vsekit.interop.clip_benchmark import load_for_clip_benchmark

        return load_for_clip_benchmark
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
