"""L2 normalisation in the two forms that exist in the field.

`clamp` is torch's `F.normalize` (x / max(|x|, 1e-12)); `add_eps` is x / (|x| + 1e-8), the form every
released VSE∞ / VSE+2AD / AVSE model was trained with. The two differ by ~1e-8 relative on unit-scale
vectors; imported runs use `add_eps` so they compute what the released code computes.
"""

from __future__ import annotations

import torch
from torch import nn

L2_FORMS = ("clamp", "add_eps")


def l2_normalize(x: torch.Tensor, form: str = "clamp", dim: int = -1) -> torch.Tensor:
    """Unit vectors along `dim` in the given form (see the module docstring)."""
    if form == "clamp":
        return nn.functional.normalize(x, dim=dim)
    if form == "add_eps":
        return x / (x.pow(2).sum(dim=dim, keepdim=True).sqrt() + 1e-8)
    raise ValueError(f"unknown L2 normalisation form {form!r}; choose one of {', '.join(L2_FORMS)}")
