"""`vse import hrem`: the checkpoint CrossmodalGroup/HREM's training script writes, as a vsekit run.

The file is `{'model': [image state, text state], 'opt', 'epoch', 'best_rsum', 'Eiters'}` (no `module.` prefix
unless trained with multi_gpu). The image side is VSE∞'s region encoder (`fc.fc`, `fc.mlp`) and HREM's
aggregating transformer layer (`aggr.layers.0`); the text side a BERT (`bert.*`, hub configuration not stored:
`--text-config`), `linear` and its own `aggr`. Both map onto vsekit's precomp / transformer encoders with the
`hrem` pooling. The loss's own weights (graph layer, relation MLPs) are not in the release's checkpoint: an
imported run evaluates, indexes and searches; `criterion_state` maps such weights, where someone has them (the
parity fixtures do), onto vsekit's `hrem` loss.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from vsekit.config import PoolingConfig
from vsekit.interop.checkpoint_reader import (
    ReleasedCheckpointError,
    check_finite_weights,
    float_option,
    int_option,
    json_safe,
    options_dict,
    read_released_checkpoint,
)
from vsekit.interop.released import (
    ImportedModel,
    base_recipe,
    bert_positions,
    check_embed_size,
    check_norms,
    inverse,
    rename,
    strip_prefix,
    tensor,
)
from vsekit.interop.text_models import bert_model_files
from vsekit.models.vse import DataSpec

IMAGE_RULES = [
    ("fc.fc.", "image_encoder.fc."),
    ("fc.mlp.layers.0.", "image_encoder.mlp.fc1."),
    ("fc.mlp.bns.0.", "image_encoder.mlp.bn."),
    ("fc.mlp.layers.1.", "image_encoder.mlp.fc2."),
    ("fc.mlp.bns.1.", None),  # built and stored, never applied (VSE∞'s MLP)
    ("aggr.", "image_encoder.pool.aggr."),
]
TEXT_RULES = [
    ("bert.", "text_encoder.body."),
    ("linear.", "text_encoder.proj."),
    ("aggr.", "text_encoder.pool.aggr."),
]
CRITERION_RULES = [
    ("gnn.", "gnn."),
    ("adj_model.adj_learning.mlp_t2i.", "mlp_t2i."),
    ("adj_model.adj_learning.mlp_i2t.", "mlp_i2t."),
]
CUTOFF = {"coco": 1.9}  # the release's distance cut-off of the sampled negatives; every other dataset: 1.7
DEFAULT_CUTOFF = 1.7
RELEASE_MAX_K = 2  # the encoders' max-k pooling: k = 2, hard-wired in the release


def import_hrem(checkpoint: str | Path, text_config: str | None = None) -> ImportedModel:
    """Read and map an HREM checkpoint (nothing written); any misfit is a ReleasedCheckpointError."""
    path = Path(checkpoint)
    ckpt = read_released_checkpoint(path)
    options = options_dict(ckpt, "opt", path)
    model = ckpt.get("model")
    if not (isinstance(model, (list, tuple)) and len(model) == 2 and all(isinstance(m, dict) for m in model)):
        raise ReleasedCheckpointError(
            f"{path}: 'model' is not the list of two state dicts HREM's train.py saves"
        )
    img, txt = strip_prefix(model[0], "module."), strip_prefix(model[1], "module.")
    if not any(k.startswith("aggr.") for k in img) or not any(k.startswith("bert.") for k in txt):
        raise ReleasedCheckpointError(
            f"{path}: no aggr.* image keys or no bert.* text keys: not an HREM checkpoint "
            "(VSE∞'s: `vse import vse_infty`)"
        )
    check_norms(options, path)
    for name in ("base_loss", "gnn_loss"):
        if options.get(name, "trip") != "trip":
            raise ReleasedCheckpointError(
                f"{path}: {name}={options[name]!r}; vsekit's hrem loss is the release's "
                "default 'trip' (distance-weighted triplet)"
            )
    if int_option(options, "norm_input", path, 1) != 1:
        raise ReleasedCheckpointError(
            f"{path}: norm_input=0; vsekit's hrem loss feeds the graph the normalised "
            "embeddings (the release's default)"
        )
    recipe = base_recipe("hrem", {"name": "imported_hrem"})
    fc = tensor(img, "fc.fc.weight", path)
    embed, img_dim = int(fc.shape[0]), int(fc.shape[1])
    check_embed_size(options, "embed_size", embed, path)
    given_dim = int_option(options, "img_dim", path, None)
    if given_dim is not None and given_dim != img_dim:
        raise ReleasedCheckpointError(f"{path}: img_dim={given_dim} but fc.fc.weight takes {img_dim} inputs")
    heads = int_option(options, "nhead", path)
    if heads < 1 or embed % heads:
        raise ReleasedCheckpointError(f"{path}: nhead={heads} does not divide the embed size {embed}")
    residual = float_option(options, "residual_weight", path, 0.8)
    m = recipe.model
    m.embed_dim = embed
    m.image.kind, m.image.feature_type, m.image.views = "precomp", "region", 1
    m.image.mlp_hidden = int(tensor(img, "fc.mlp.layers.0.weight", path).shape[0])
    m.image.mlp_on_padding = True
    dropout = float_option(options, "dropout", path, 0.1)
    pool = PoolingConfig(
        name="hrem", k=RELEASE_MAX_K, hrem_heads=heads, hrem_residual_weight=residual, hrem_dropout=dropout
    )
    m.image.pooling, m.text.pooling = pool, dataclasses.replace(pool)
    m.text.kind, m.text.head, m.text.freeze = "transformer", "linear", False
    text_files, notes = bert_model_files(txt, "bert.", text_config, path)
    m.text.max_tokens = bert_positions(text_files)
    loss = recipe.loss
    loss.name = "hrem"
    loss.margin = float_option(options, "margin", path, loss.margin)
    loss.hrem_embed_dim, loss.hrem_heads, loss.hrem_dropout = embed, heads, dropout
    loss.hrem_cutoff = CUTOFF.get(str(options.get("dataset", "")), DEFAULT_CUTOFF)
    loss.hrem_threshold = float_option(options, "threshold", path, loss.hrem_threshold)
    loss.hrem_topk = int_option(options, "topk", path, loss.hrem_topk)
    loss.hrem_mask_weight = float_option(options, "mask_weight", path, loss.hrem_mask_weight)
    loss.hrem_reg_weight = float_option(options, "reg_loss_weight", path, loss.hrem_reg_weight)
    loss.hrem_warmup_iters = int_option(options, "warmup", path, loss.hrem_warmup_iters)
    loss.hrem_cross_terms = bool(int_option(options, "cross_loss", path, 1))
    state_i, unused_i, unknown_i = rename(img, IMAGE_RULES, "model[0].")
    state_t, unused_t, unknown_t = rename(txt, TEXT_RULES, "model[1].")
    notes.append(
        "the loss's graph layer and relation MLPs are not in the release's checkpoint: the run evaluates "
        "as released; training it further starts them afresh"
    )
    imported = ImportedModel(
        "hrem",
        recipe,
        DataSpec(img_dim=img_dim),
        {**state_i, **state_t},
        json_safe(options),
        unused_i + unused_t,
        unknown_i + unknown_t,
        text_files,
        notes,
        inverse(IMAGE_RULES, "model[0].") + inverse(TEXT_RULES, "model[1]."),
    )
    check_finite_weights(ckpt, path)
    return imported


def criterion_state(path: str | Path) -> dict[str, torch.Tensor]:
    """The release's `GraphLoss.state_dict()` file (read without unpickling objects) under vsekit's `hrem` loss
    names; a key no rule knows is an error naming it."""
    path = Path(path)
    if not path.is_file():
        raise ReleasedCheckpointError(f"{path}: no such file")
    try:  # torch's weights-only unpickler: tensors and containers, never an arbitrary object
        state: Any = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 (any unreadable file is one line naming it)
        raise ReleasedCheckpointError(
            f"{path}: not a readable PyTorch state dict ({type(e).__name__})"
        ) from None
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise ReleasedCheckpointError(f"{path}: not a state dict of tensors (HREM's GraphLoss.state_dict())")
    out, _, unknown = rename(strip_prefix(state, "module."), CRITERION_RULES, "")
    if unknown:
        raise ReleasedCheckpointError(
            f"{path}: {len(unknown)} key(s) HREM's loss does not have (e.g. {unknown[0]})"
        )
    return out
