"""Importer of the checkpoints the released ESA code writes (KevinLight831/ESA, `ESA_BIGRU/`): `vse import esa`.

`model_best.pth` is VSE∞'s layout: `{'epoch', 'model', 'best_rsum', 'opt', 'Eiters'}` with `model` = [image
state, caption state], no prefix; the image encoder is VSE∞'s region MLP plus `linear1` (the aggregator's
scores), the caption encoder VSE∞'s BiGRU plus `linear1`. The recipe is `esa` with the released forward pass:
the image aggregator's softmax and BatchNorm over the padded batch (`esa_mask_padding: false`), `add_eps` L2
normalisation, and the SEL loss's options from the pickled `opt`.
"""

from __future__ import annotations

from pathlib import Path

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
    BIGRU_TEXT_RULES,
    REGION_IMAGE_RULES,
    ImportedModel,
    base_recipe,
    bigru_settings,
    check_embed_size,
    check_norms,
    inverse,
    read_vocab,
    region_image_settings,
    rename,
    strip_prefix,
    tensor,
)
from vsekit.models.esa import TRAIN_VIEWS
from vsekit.models.vse import DataSpec

# VSE∞'s rules without GPO (ESA has none), plus the aggregators' score layers
IMAGE_RULES = [r for r in REGION_IMAGE_RULES if r[0] != "gpool."] + [
    ("linear1.", "image_encoder.pool.linear1.")
]
TEXT_RULES = [r for r in BIGRU_TEXT_RULES if r[0] != "gpool."] + [("linear1.", "text_encoder.pool.linear1.")]


def import_esa(checkpoint: str | Path, vocab: str | None) -> ImportedModel:
    """Read and map a released ESA (BiGRU) checkpoint; nothing is written. `vocab`: the SCAN vocabulary JSON it
    was trained with. Raises ReleasedCheckpointError on any misfit (one line naming the file)."""
    path = Path(checkpoint)
    ckpt = read_released_checkpoint(path)
    options = options_dict(ckpt, "opt", path)
    model = ckpt.get("model")
    if not (isinstance(model, (list, tuple)) and len(model) == 2 and all(isinstance(m, dict) for m in model)):
        raise ReleasedCheckpointError(
            f"{path}: 'model' is not the list of two state dicts the ESA scripts save"
        )
    img, txt = strip_prefix(model[0], "module."), strip_prefix(model[1], "module.")
    if "linear1.weight" not in img or "linear1.weight" not in txt:
        raise ReleasedCheckpointError(
            f"{path}: no linear1.* (ESA's aggregator) in both encoders: not an ESA "
            "checkpoint (a VSE∞ one? use `vse import vse_infty`)"
        )
    hardnum = int_option(options, "hardnum", path, TRAIN_VIEWS)
    if hardnum != TRAIN_VIEWS:
        raise ReleasedCheckpointError(
            f"{path}: hardnum={hardnum}; the released encoders always make "
            f"{TRAIN_VIEWS} views, so only hardnum {TRAIN_VIEWS} trains"
        )
    check_norms(options, path)
    recipe = base_recipe("esa", {"name": "imported_esa"})
    img_dim = region_image_settings(recipe, img, options, path)
    embed = int(tensor(img, "fc.weight", path).shape[0])
    check_embed_size(options, "embed_size", embed, path)
    recipe.model.embed_dim = embed
    rows = bigru_settings(recipe, txt, options, path)
    recipe.model.image.pooling.esa_mask_padding = False  # the release: softmax and BatchNorm over the padding
    recipe.model.text.pooling.esa_mask_padding = True  # the release masks past each caption's length
    recipe.loss.name = "sel"
    recipe.loss.margin = float_option(options, "margin", path, recipe.loss.margin)
    recipe.loss.warmup_epochs = int_option(options, "vse_mean_warmup_epochs", path, recipe.loss.warmup_epochs)
    spec = DataSpec(img_dim=img_dim, vocab_words=read_vocab(vocab, rows, options, path))
    state_i, unused_i, unknown_i = rename(img, IMAGE_RULES, "model[0].")
    state_t, unused_t, unknown_t = rename(txt, TEXT_RULES, "model[1].")
    check_finite_weights(ckpt, path)
    return ImportedModel(
        "esa",
        recipe,
        spec,
        {**state_i, **state_t},
        json_safe(options),
        unused_i + unused_t,
        unknown_i + unknown_t,
        inverse_rules=inverse(IMAGE_RULES, "model[0].") + inverse(TEXT_RULES, "model[1]."),
    )
