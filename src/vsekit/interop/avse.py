"""The released AVSE checkpoint's image keys -> `ViTMultiViewImageEncoder`'s (`vsekit.models.vit_views`): used by
`vse import avse` (`vsekit.interop.released`), beside every other importer's key mapping.

`released_vit_key` / `convert_released_image_state` map the released `img_enc.visual_encoder.*` (transformers
4.x ViT names) and `img_enc.image_encoder.{fc,gpool}.*` keys to the encoder's `vit.*`, `fc.*`, `pool.*` keys,
following whichever ViT layout the installed transformers uses (read from the module's own state-dict keys, not
from version strings).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Collection, Mapping

import torch

RELEASED_VIT_PREFIX = "img_enc.visual_encoder."
RELEASED_AGGR_PREFIX = "img_enc.image_encoder."
# released (transformers 4.x) ViT block names -> the candidates other transformers layouts use, tried in order
_BLOCK_RENAMES: dict[str, tuple[str, ...]] = {
    "attention.attention.query": (
        "attention.attention.query",
        "attention.q_proj",
        "attention.attention.q_proj",
    ),
    "attention.attention.key": ("attention.attention.key", "attention.k_proj", "attention.attention.k_proj"),
    "attention.attention.value": (
        "attention.attention.value",
        "attention.v_proj",
        "attention.attention.v_proj",
    ),
    "attention.output.dense": ("attention.output.dense", "attention.o_proj", "attention.out_proj"),
    "intermediate.dense": ("intermediate.dense", "mlp.fc1"),
    "output.dense": ("output.dense", "mlp.fc2"),
    "layernorm_before": ("layernorm_before",),
    "layernorm_after": ("layernorm_after",),
}
_LAYER_CONTAINERS = ("encoder.layer.{i}.", "layers.{i}.", "encoder.layers.{i}.")
_BLOCK_RE = re.compile(r"^encoder\.layer\.(\d+)\.(.+)\.(weight|bias)$")


@functools.lru_cache(maxsize=1)
def _installed_vit_keys() -> frozenset[str]:
    """Module keys for the installed transformers' ViT, read off a throwaway tiny instance."""
    from transformers import ViTConfig, ViTModel

    tiny = ViTModel(
        ViTConfig(
            hidden_size=8,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=8,
            image_size=4,
            patch_size=2,
        ),
        add_pooling_layer=True,
    )
    return frozenset("vit." + k for k in tiny.state_dict())


def released_vit_key(name: str, own_keys: Collection[str] | None = None) -> str:
    """Map one released AVSE image key to this module's key; `own_keys` = the target state-dict keys.

    `img_enc.visual_encoder.X` -> `vit.X'` (X' = X renamed to the ViT layout found in `own_keys`),
    `img_enc.image_encoder.fc.*` -> `fc.*`, `img_enc.image_encoder.gpool.*` -> `pool.*`. A leading
    `module.` (DataParallel) is dropped. Without `own_keys` the layout of the installed transformers'
    ViT is used (read off a tiny one-block instance). Raises KeyError for keys outside the image part or
    with no counterpart.
    """
    probe = own_keys is None
    if own_keys is None:
        keys: Collection[str] = _installed_vit_keys()
    else:
        keys = own_keys if isinstance(own_keys, (set, frozenset)) else set(own_keys)
    name = name.removeprefix("module.")
    if name.startswith(RELEASED_AGGR_PREFIX):
        rest = name[len(RELEASED_AGGR_PREFIX) :]
        if rest.startswith("fc."):
            new = rest
        elif rest.startswith("gpool."):
            new = "pool." + rest[len("gpool.") :]
        else:
            raise KeyError(f"unknown released image-aggregator key {name!r}")
        if not probe and new not in keys:
            raise KeyError(f"no counterpart for released key {name!r} (expected {new!r})")
        return new
    if not name.startswith(RELEASED_VIT_PREFIX):
        raise KeyError(f"{name!r} is not part of the released image encoder")
    rest = name[len(RELEASED_VIT_PREFIX) :]
    m = _BLOCK_RE.match(rest)
    if m is None:  # embeddings, final layernorm, pooler: the same names in every layout
        templates = ["vit." + rest]
        i = "0"
    else:
        i, sub, leaf = m.groups()
        if sub not in _BLOCK_RENAMES:
            raise KeyError(f"unknown released ViT block key {name!r}")
        templates = ["vit." + c + new + "." + leaf for c in _LAYER_CONTAINERS for new in _BLOCK_RENAMES[sub]]
    for t in templates:
        # the probe has a single block: match its layout on block 0, answer with the real index
        if (t.format(i="0") if probe else t.format(i=i)) in keys:
            return t.format(i=i)
    tried = [t.format(i=i) for t in templates[:3]]
    raise KeyError(f"no counterpart for released key {name!r} among this module's keys (tried {tried}...)")


def convert_released_image_state(
    state: Mapping[str, torch.Tensor], own_keys: Collection[str] | None = None
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """(image part renamed to this module's keys, remaining released keys) from a released `model` dict."""
    keys = None if own_keys is None else set(own_keys)
    mapped: dict[str, torch.Tensor] = {}
    rest: list[str] = []
    for k, v in state.items():
        bare = k.removeprefix("module.")
        if bare.startswith((RELEASED_VIT_PREFIX, RELEASED_AGGR_PREFIX)):
            new = released_vit_key(bare, keys)
            if new in mapped:
                raise KeyError(f"two released keys map to {new!r}")
            mapped[new] = v
        else:
            rest.append(k)
    return mapped, rest
