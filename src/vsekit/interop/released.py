"""Importers for the checkpoints the released VSE∞, VSE+2AD and AVSE code publishes.

Each importer reads the options the training script pickled with the weights, builds the vsekit recipe that
computes the same function (released-code modes included: `add_eps` L2 normalisation, ADPOOL's softmax over
padding, AEOM's block max-sum, …), renames every released key to its vsekit home and loads strictly: a
missing, unexpected or mis-shaped key is an error naming it. The only keys without a home are the ones the
released forward pass never reads (listed per kind in rules with no vsekit home); they are recorded in the
run's config.json, never dropped silently.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from vsekit.config import PoolingConfig, Recipe, load_recipe
from vsekit.errors import VseInputError
from vsekit.interop.checkpoint_reader import (
    ReleasedCheckpointError,
    check_finite_weights,
    flag_option,
    float_option,
    int_option,
    json_safe,
    options_dict,
    read_released_checkpoint,
)
from vsekit.interop.text_models import bert_model_files, vit_config_from_checkpoint
from vsekit.models.vse import DataSpec, VSEModel

KINDS = ("vse_infty", "vse_2ad", "avse")

# Released keys the released forward pass never reads have `None` as their vsekit home in the rules below:
# only the region MLP's second BatchNorm (built, stored, never applied). The ViT's final LayerNorm and pooler
# and BERT's pooler, also unused, load into the transformers modules that hold them.

REGION_IMAGE_RULES = [
    ("fc.", "image_encoder.fc."),
    ("mlp.layers.0.", "image_encoder.mlp.fc1."),
    ("mlp.bns.0.", "image_encoder.mlp.bn."),
    ("mlp.layers.1.", "image_encoder.mlp.fc2."),
    ("mlp.bns.1.", None),
    ("gpool.", "image_encoder.pool."),
]
BIGRU_TEXT_RULES = [
    ("embed.", "text_encoder.embed."),
    ("rnn.", "text_encoder.gru."),
    ("gpool.", "text_encoder.pool."),
]
BERT_TEXT_RULES = [
    ("bert.", "text_encoder.body."),
    ("linear.", "text_encoder.proj."),
    ("gpool.", "text_encoder.pool."),
]


@dataclass
class ImportedModel:
    """What `vse import` writes: a recipe, the data spec, weights under vsekit's names, and the record."""

    kind: str
    recipe: Recipe
    spec: DataSpec
    state: dict[str, torch.Tensor]
    options: dict[str, Any]
    unused_keys: list[str] = field(default_factory=list)  # released keys its forward pass never reads
    unknown_keys: list[str] = field(default_factory=list)  # keys no rule knows: an error when building
    text_files: dict[str, bytes] = field(default_factory=dict)  # files of the run's text_model/ directory
    notes: list[str] = field(default_factory=list)
    inverse_rules: list[tuple[str, str]] = field(default_factory=list)  # (vsekit prefix, released prefix)

    def released_name(self, key: str) -> str:
        """The released key a vsekit key comes from (for error messages), when the rules say."""
        for dst, src in self.inverse_rules:
            if key.startswith(dst):
                return src + key[len(dst) :]
        return key


# ---------------------------------------------------------------------------------------------- key mapping


def strip_prefix(state: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    """Remove `prefix` (e.g. nn.DataParallel's `module.`) when every key has it."""
    if state and all(k.startswith(prefix) for k in state):
        return {k[len(prefix) :]: v for k, v in state.items()}
    return state


def rename(
    state: dict[str, torch.Tensor], rules: list[tuple[str, str | None]], where: str
) -> tuple[dict, list[str], list[str]]:
    """(renamed, unused, unknown): each key goes to the first rule whose released prefix it starts with."""
    out: dict[str, torch.Tensor] = {}
    unused: list[str] = []
    unknown: list[str] = []
    for key, value in state.items():
        for src, dst in rules:
            if key.startswith(src):
                if dst is None:
                    unused.append(f"{where}{key}")
                else:
                    out[dst + key[len(src) :]] = value
                break
        else:
            unknown.append(f"{where}{key}")
    return out, unused, unknown


def inverse(rules: list[tuple[str, str | None]], where: str) -> list[tuple[str, str]]:
    return [(dst, where + src) for src, dst in rules if dst is not None]


def check_fit(model: torch.nn.Module, imported: ImportedModel, path: Path) -> None:
    """Every model key present with its shape and no released key left over, or one line naming them
    (by their released names)."""
    state, unknown, name = imported.state, imported.unknown_keys, imported.released_name
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    wrong = sorted(k for k in set(own) & set(state) if tuple(own[k].shape) != tuple(state[k].shape))
    extra = sorted(set(state) - set(own))
    parts = []
    if missing:
        parts.append(f"missing {len(missing)} key(s) the model needs (e.g. {name(missing[0])})")
    if unknown or extra:
        names = sorted(unknown) + [name(k) for k in extra]
        parts.append(f"{len(names)} unexpected key(s) (e.g. {names[0]})")
    if wrong:
        k = wrong[0]
        parts.append(
            f"{len(wrong)} mis-shaped key(s) (e.g. {name(k)}: checkpoint {tuple(state[k].shape)} vs "
            f"expected {tuple(own[k].shape)})"
        )
    if parts:
        raise ReleasedCheckpointError(f"{path}: does not fit the released architecture: {'; '.join(parts)}")


def tensor(state: dict[str, torch.Tensor], key: str, path: Path) -> torch.Tensor:
    if key not in state:
        raise ReleasedCheckpointError(
            f"{path}: missing key {key!r}, which this kind of checkpoint always has"
        )
    return state[key]


# ---------------------------------------------------------------------------------------------- recipes


def gpo_config(state: dict[str, torch.Tensor], prefix: str, path: Path) -> PoolingConfig:
    """GPO sizes read from its weights (positional code = GRU input, hidden = GRU hidden)."""
    w_ih = tensor(state, f"{prefix}gru.weight_ih_l0", path)
    return PoolingConfig(name="gpo", d_pe=int(w_ih.shape[1]), d_hidden=int(w_ih.shape[0] // 3))


def region_image_settings(
    recipe: Recipe, img: dict[str, torch.Tensor], options: dict[str, Any], path: Path
) -> int:
    """Set the precomp region encoder from the weights; returns the feature size."""
    enc_type = options.get("precomp_enc_type", "basic")
    if enc_type != "basic":
        raise ReleasedCheckpointError(
            f"{path}: precomp_enc_type={enc_type!r}; vsekit imports the 'basic' "
            "region encoder (linear + residual MLP) the released models use"
        )
    fc = tensor(img, "fc.weight", path)
    recipe.model.image.kind = "precomp"
    recipe.model.image.feature_type = "region"
    recipe.model.image.views = 1
    recipe.model.image.mlp_hidden = int(tensor(img, "mlp.layers.0.weight", path).shape[0])
    img_dim = int_option(options, "img_dim", path, None)
    if img_dim is not None and img_dim != fc.shape[1]:
        raise ReleasedCheckpointError(f"{path}: img_dim={img_dim} but fc.weight takes {fc.shape[1]} inputs")
    return int(fc.shape[1])


def check_embed_size(options: dict[str, Any], name: str, embed: int, path: Path) -> None:
    given = int_option(options, name, path, None)
    if given is not None and given != embed:
        raise ReleasedCheckpointError(f"{path}: {name}={given} but the weights embed to {embed}")


def check_norms(options: dict[str, Any], path: Path) -> None:
    if flag_option(options, "no_imgnorm", path) or flag_option(options, "no_txtnorm", path):
        raise ReleasedCheckpointError(
            f"{path}: trained with no_imgnorm/no_txtnorm; vsekit imports models whose "
            "image and caption embeddings are both L2-normalised"
        )


def bigru_settings(recipe: Recipe, txt: dict[str, torch.Tensor], options: dict[str, Any], path: Path) -> int:
    """BiGRU text encoder from the weights; returns the vocabulary size the embedding table has."""
    emb = tensor(txt, "embed.weight", path)
    layers = sum(1 for k in txt if k.startswith("rnn.weight_ih_l") and not k.endswith("_reverse"))
    if not any(k.endswith("_reverse") for k in txt if k.startswith("rnn.")):
        raise ReleasedCheckpointError(
            f"{path}: the caption GRU is unidirectional; vsekit imports the bidirectional one"
        )
    num_layers = int_option(options, "num_layers", path, None)
    if num_layers is not None and num_layers != layers:
        raise ReleasedCheckpointError(
            f"{path}: num_layers={num_layers} but the weights hold {layers} GRU layers"
        )
    recipe.model.text.kind = "bigru"
    recipe.model.text.tokenizer = "nltk"  # SCAN vocabularies hold nltk's Treebank tokens
    recipe.model.text.word_dim = int(emb.shape[1])
    recipe.model.text.num_layers = layers
    return int(emb.shape[0])


def read_vocab(vocab_path: str | None, rows: int, options: dict[str, Any], path: Path) -> list[str]:
    """The SCAN vocabulary the model was trained with, ids kept, <mask> appended (as the released code does)."""
    from vsekit.data.text import Vocabulary

    if not vocab_path:
        name = options.get("data_name", "DATA")
        raise ReleasedCheckpointError(
            f"{path}: a BiGRU checkpoint needs its vocabulary: pass --vocab "
            f"{name}_vocab.json (the SCAN vocabulary JSON it was trained with)"
        )
    if not Path(vocab_path).is_file():
        raise ReleasedCheckpointError(f"{vocab_path}: vocabulary file does not exist")
    check_vocab_file(Path(vocab_path))
    try:
        words = Vocabulary.load(vocab_path).idx2word
    except VseInputError as e:
        message = str(e)
        raise ReleasedCheckpointError(
            message if message.startswith(str(vocab_path)) else f"{vocab_path}: {message}"
        ) from None
    if len(words) != rows:
        raise ReleasedCheckpointError(
            f"{vocab_path}: {len(words)} words with <mask> appended, but the checkpoint's "
            f"embedding table has {rows} rows (vocab_size): not this model's vocabulary"
        )
    return words


def check_vocab_file(path: Path) -> None:
    """A vocabulary JSON of the right shape (SCAN's `idx2word`: an object of id -> word or a list of words;
    vsekit's `words`: a list of words), or one line naming the file and the key that is wrong."""
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise ReleasedCheckpointError(f"{path}: cannot read the vocabulary ({e.strerror or e})") from None
    except UnicodeDecodeError:
        raise ReleasedCheckpointError(
            f"{path}: not a vocabulary JSON: a binary file (not UTF-8 text)"
        ) from None
    except json.JSONDecodeError as e:
        raise ReleasedCheckpointError(
            f"{path}: not a vocabulary JSON ({e.msg} at line {e.lineno} column {e.colno})"
        ) from None
    key = next((k for k in ("idx2word", "words") if isinstance(data, dict) and k in data), None)
    if key is None:
        found = (
            f"keys {sorted(map(str, data))[:5]}"
            if isinstance(data, dict)
            else f"a JSON {type(data).__name__}"
        )
        raise ReleasedCheckpointError(
            f"{path}: expected SCAN's {{'idx2word': {{...}}}} or {{'words': [...]}}, found {found}"
        )
    value = data[key]
    if isinstance(value, dict) and key == "idx2word":
        entries = list(value.items())
    elif isinstance(value, list):
        entries = list(enumerate(value))
    else:
        want = "an object of id -> word (or a list of words)" if key == "idx2word" else "a list of words"
        raise ReleasedCheckpointError(f"{path}: {key!r} must be {want}, got a JSON {type(value).__name__}")
    for k, word in entries:
        if not isinstance(word, str):
            raise ReleasedCheckpointError(
                f"{path}: {key!r} entry {k!r} is {word!r} (a JSON {type(word).__name__}), not a word"
            )


def bert_positions(text_files: dict[str, bytes]) -> int:
    """Captions are cut only where BERT's position table ends (the releases never truncate shorter)."""
    return int(json.loads(text_files["config.json"])["max_position_embeddings"])


def base_recipe(name: str, overrides: dict[str, Any]) -> Recipe:
    recipe = load_recipe(name)
    recipe.name = overrides.get("name", f"imported_{name}")
    recipe.model.l2_form = "add_eps"
    recipe.loss.mask_same_image = False  # the released losses treat only the batch diagonal as positive
    return recipe


def import_vse_infty(ckpt: dict, path: Path, vocab: str | None, text_config: str | None) -> ImportedModel:
    """woodfrog/vse_infty: `model` = [image state, text state]; BiGRU (branch bigru) or BERT (master)."""
    options = options_dict(ckpt, "opt", path)
    model = ckpt["model"]
    if not (isinstance(model, (list, tuple)) and len(model) == 2 and all(isinstance(m, dict) for m in model)):
        raise ReleasedCheckpointError(
            f"{path}: 'model' is not the list of two state dicts the VSE∞ scripts save "
            "(is this a VSE+2AD or AVSE checkpoint? use `vse import vse_2ad|avse`)"
        )
    img = strip_prefix(model[0], "module.")
    txt = strip_prefix(model[1], "module.")
    check_norms(options, path)
    bert = any(k.startswith("bert.") for k in txt)
    recipe = base_recipe("vse_infty", {"name": "imported_vse_infty_" + ("bert" if bert else "bigru")})
    img_dim = region_image_settings(recipe, img, options, path)
    embed = int(tensor(img, "fc.weight", path).shape[0])
    check_embed_size(options, "embed_size", embed, path)
    recipe.model.embed_dim = embed
    recipe.model.image.pooling = gpo_config(img, "gpool.", path)
    recipe.model.text.pooling = gpo_config(txt, "gpool.", path)
    recipe.loss.name = "triplet"
    recipe.loss.margin = float_option(options, "margin", path, recipe.loss.margin)
    recipe.loss.warmup_epochs = int_option(options, "vse_mean_warmup_epochs", path, recipe.loss.warmup_epochs)
    spec = DataSpec(img_dim=img_dim)
    text_files: dict[str, bytes] = {}
    notes: list[str] = []
    if bert:
        recipe.model.text.kind = "transformer"
        recipe.model.text.head = "linear"
        recipe.model.text.freeze = False
        text_files, notes = bert_model_files(txt, "bert.", text_config, path)
        recipe.model.text.max_tokens = bert_positions(text_files)
        recipe.optim.weight_decay = (
            1e-4  # master's AdamW (the bigru branch: PyTorch's default 0.01, as the recipe)
        )
        rules_txt = BERT_TEXT_RULES
    else:
        rows = bigru_settings(recipe, txt, options, path)
        spec.vocab_words = read_vocab(vocab, rows, options, path)
        rules_txt = BIGRU_TEXT_RULES
    state_i, unused_i, unknown_i = rename(img, REGION_IMAGE_RULES, "model[0].")
    state_t, unused_t, unknown_t = rename(txt, rules_txt, "model[1].")
    return ImportedModel(
        "vse_infty_bert" if bert else "vse_infty_bigru",
        recipe,
        spec,
        {**state_i, **state_t},
        json_safe(options),
        unused_i + unused_t,
        unknown_i + unknown_t,
        text_files,
        notes,
        inverse(REGION_IMAGE_RULES, "model[0].") + inverse(rules_txt, "model[1]."),
    )


def import_vse_2ad(ckpt: dict, path: Path, vocab: str | None, text_config: str | None) -> ImportedModel:
    """96-Zachary/vse_2ad (bigru + project): one state dict with `img_enc.` / `txt_enc.` prefixes, `args`."""
    options = options_dict(ckpt, "args", path)
    state = ckpt["model"]
    if not isinstance(state, dict) or not any(k.startswith("img_enc.") for k in state):
        raise ReleasedCheckpointError(f"{path}: 'model' is not a VSE+2AD state dict (no img_enc.* keys)")
    state = strip_prefix(state, "module.")
    check_norms(options, path)
    for name, want in (("txt_enc_type", "rnn"), ("img_enc_type", "project")):
        if options.get(name, want) != want:
            raise ReleasedCheckpointError(
                f"{path}: {name}={options[name]!r}; vsekit imports the {want!r} "
                "configuration (the README's bigru + project model)"
            )
    img = {k[len("img_enc.") :]: v for k, v in state.items() if k.startswith("img_enc.")}
    txt = {k[len("txt_enc.") :]: v for k, v in state.items() if k.startswith("txt_enc.")}
    other = [k for k in state if not k.startswith(("img_enc.", "txt_enc."))]
    recipe = base_recipe("vse_2ad", {"name": "imported_vse_2ad"})
    img_dim = region_image_settings(recipe, img, options, path)
    embed = int(tensor(img, "fc.weight", path).shape[0])
    check_embed_size(options, "emb_size", embed, path)
    recipe.model.embed_dim = embed
    released_pool = PoolingConfig(
        name="adpool",
        token_level=True,
        embedding_level=True,
        adpool_variant="reference",
        adpool_mask_padding=False,
    )
    recipe.model.image.pooling = dataclasses.replace(released_pool)
    recipe.model.text.pooling = dataclasses.replace(released_pool)
    rows = bigru_settings(recipe, txt, options, path)
    spec = DataSpec(img_dim=img_dim, vocab_words=read_vocab(vocab, rows, options, path))
    recipe.loss.name = "adopt"
    recipe.loss.adopt_variant = "reference"
    recipe.loss.adopt_zero_fill_negatives = True
    recipe.loss.temperature = float_option(options, "tau", path)
    recipe.loss.adopt_scale = float_option(options, "scale", path, recipe.loss.adopt_scale)
    recipe.loss.margin = float_option(options, "margin", path, recipe.loss.margin)
    pool_rules = [("pool.linear.", "{side}.pool.token_scorer."), ("pool.balance.", "{side}.pool.balance.")]
    rules_i = REGION_IMAGE_RULES[:-1] + [(s, d.format(side="image_encoder")) for s, d in pool_rules]
    rules_t = BIGRU_TEXT_RULES[:-1] + [(s, d.format(side="text_encoder")) for s, d in pool_rules]
    state_i, unused_i, unknown_i = rename(img, rules_i, "model.img_enc.")
    state_t, unused_t, unknown_t = rename(txt, rules_t, "model.txt_enc.")
    return ImportedModel(
        "vse_2ad",
        recipe,
        spec,
        {**state_i, **state_t},
        json_safe(options),
        unused_i + unused_t,
        unknown_i + unknown_t + [f"model.{k}" for k in other],
        inverse_rules=inverse(rules_i, "model.img_enc.") + inverse(rules_t, "model.txt_enc."),
    )


def import_avse(
    ckpt: dict,
    path: Path,
    vocab: str | None,
    text_config: str | None,
    vision_config: str | None,
    block_dim: int | None,
) -> ImportedModel:
    """liuyyy111/AVSE: ViT (2 views) + BERT with a residual-MLP head and LayerNorm, AEOM similarity."""
    from vsekit.interop.avse import convert_released_image_state

    options = options_dict(ckpt, "opt", path)
    state = ckpt["model"]
    if not isinstance(state, dict) or not any(k.startswith("img_enc.visual_encoder.") for k in state):
        raise ReleasedCheckpointError(
            f"{path}: 'model' is not an AVSE state dict (no img_enc.visual_encoder.* keys)"
        )
    state = strip_prefix(state, "module.")
    img = {k[len("img_enc.") :]: v for k, v in state.items() if k.startswith("img_enc.")}
    txt = {k[len("txt_enc.") :]: v for k, v in state.items() if k.startswith("txt_enc.")}
    other = {k: v for k, v in state.items() if not k.startswith(("img_enc.", "txt_enc."))}
    embed = int(tensor(img, "image_encoder.fc.weight", path).shape[0])
    check_embed_size(options, "embed_size", embed, path)
    recipe = base_recipe("avse", {"name": "imported_avse"})
    recipe.model.embed_dim = embed
    recipe.model.image.kind = "vit"
    recipe.model.image.views = 2
    recipe.model.image.view_keep_train = 0.8  # the released code's training views (the paper says 75 %)
    recipe.model.image.view_keep_test = 0.9
    recipe.model.image.image_size = int_option(options, "img_res", path, 224)
    recipe.model.image.pooling = gpo_config(img, "image_encoder.gpool.", path)
    vit_cfg, vit_notes = vit_config_from_checkpoint(img, "visual_encoder.", vision_config, path)
    recipe.model.text.kind = "transformer"
    recipe.model.text.head = "residual_mlp"
    recipe.model.text.head_mlp_hidden = int(tensor(txt, "mlp.layers.0.weight", path).shape[0])
    recipe.model.text.final_layernorm = True
    recipe.model.text.freeze = False
    recipe.model.text.pooling = gpo_config(txt, "gpool.", path)
    text_files, notes = bert_model_files(txt, "bert.", text_config, path)
    recipe.model.text.max_tokens = bert_positions(text_files)
    recipe.model.similarity.name = "aeom"
    recipe.model.similarity.use_sinkhorn = False  # the released code's Sinkhorn call is commented out
    recipe.model.similarity.readout = "maxsum"  # the same: block max-sum of the cosines
    if block_dim is not None and int(block_dim) < 1:
        raise ReleasedCheckpointError(
            f"--block-dim {block_dim}: the AEOM block size must be a positive divisor of "
            f"the embed size {embed}"
        )
    recipe.model.similarity.block_dim = int(block_dim or embed // 4)  # released: 256 with embed_size 1024
    if embed % recipe.model.similarity.block_dim:
        raise ReleasedCheckpointError(
            f"{path}: embed size {embed} is not a multiple of --block-dim {block_dim}"
        )
    recipe.loss.name = "triplet"
    recipe.loss.margin = float_option(options, "margin", path, recipe.loss.margin)
    recipe.loss.warmup_epochs = int_option(options, "vse_mean_warmup_epochs", path, recipe.loss.warmup_epochs)
    recipe.loss.view_reg_weight = 1.0
    recipe.loss.view_reg_variant = "reference"
    recipe.optim.weight_decay = 1e-4  # the released AVSE code's AdamW (ViT + BERT)
    spec = DataSpec(vision_config=vit_cfg)
    try:  # the ViT keys follow the installed transformers' layout (renamed in transformers 5)
        mapped_i, _ = convert_released_image_state({f"img_enc.{k}": v for k, v in img.items()})
    except KeyError as e:
        raise ReleasedCheckpointError(f"{path}: {e.args[0]}") from None
    rules_t = [
        ("bert.", "text_encoder.body."),
        ("fc.", "text_encoder.proj."),
        ("mlp.layers.0.", "text_encoder.mlp.fc1."),
        ("mlp.bns.0.", "text_encoder.mlp.bn."),
        ("mlp.layers.1.", "text_encoder.mlp.fc2."),
        ("mlp.bns.1.", None),
        ("ln.", "text_encoder.final_norm."),
        ("gpool.", "text_encoder.pool."),
    ]
    state_i = {f"image_encoder.{k}": v for k, v in mapped_i.items()}
    state_t, unused_t, unknown_t = rename(txt, rules_t, "model.txt_enc.")
    state_o, _, unknown_o = rename(other, [("sim_enc.bin_score", "sim.dustbin")], "model.")
    return ImportedModel(
        "avse",
        recipe,
        spec,
        {**state_i, **state_t, **state_o},
        json_safe(options),
        unused_t,
        unknown_t + unknown_o,
        text_files,
        notes + vit_notes,
        inverse(rules_t, "model.txt_enc.") + [("sim.dustbin", "model.sim_enc.bin_score")],
    )


# ---------------------------------------------------------------------------------------------- build + write


def import_checkpoint(
    kind: str,
    checkpoint: str | Path,
    vocab: str | None = None,
    text_config: str | None = None,
    vision_config: str | None = None,
    block_dim: int | None = None,
) -> ImportedModel:
    """Read and map a released checkpoint (nothing written). Raises ReleasedCheckpointError on any misfit."""
    path = Path(checkpoint)
    if kind not in KINDS:
        raise ReleasedCheckpointError(f"unknown kind {kind!r}; choose one of {', '.join(KINDS)}")
    ckpt = read_released_checkpoint(path)
    if kind == "vse_infty":
        imported = import_vse_infty(ckpt, path, vocab, text_config)
    elif kind == "vse_2ad":
        imported = import_vse_2ad(ckpt, path, vocab, text_config)
    else:
        imported = import_avse(ckpt, path, vocab, text_config, vision_config, block_dim)
    check_finite_weights(ckpt, path)  # NaN / inf weights: every similarity of the run would be NaN
    return imported


def build_model(imported: ImportedModel, text_dir: Path | None, path: Path) -> VSEModel:
    """The vsekit model with the imported weights loaded strictly (checks every key first)."""
    spec = dataclasses.replace(imported.spec, text_model_path=str(text_dir) if text_dir else "")
    model = VSEModel(imported.recipe, spec)
    check_fit(model, imported, path)
    own = model.state_dict()
    state = {k: v.to(own[k].dtype) for k, v in imported.state.items()}
    model.load_state_dict(state, strict=True)
    return model.eval()


def check_out_dir(out: str | Path) -> Path:
    """`out` when a run folder can go there (new, or an empty folder, under folders rather than a file), else one
    line saying what is wrong with it. Writes nothing (`vse import` checks before reading the checkpoint)."""
    out = Path(out)
    if not out.name or out.name in (".", ".."):
        raise ReleasedCheckpointError(f"--out {out}: name a new run folder")
    above = out.parent
    while not above.exists() and above != above.parent:
        above = above.parent
    if above.exists() and not above.is_dir():
        raise ReleasedCheckpointError(
            f"--out {out}: {above} is a file, not a folder, so nothing can be created under it"
        )
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ReleasedCheckpointError(f"{out}: exists and is not an empty folder; choose a new --out")
    return out


def write_imported_run(imported: ImportedModel, checkpoint: str | Path, out: str | Path) -> Path:
    """Write the run directory atomically: built in a sibling temp folder, renamed into place when complete."""
    import shutil
    import tempfile

    from vsekit.runs import tensor_bytes, write_run_config
    from vsekit.utils.io import atomic_write_bytes, sha256_file

    out = check_out_dir(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    except OSError as e:
        raise ReleasedCheckpointError(
            f"--out {out}: cannot create the run folder in {out.parent} "
            f"({e.strerror or type(e).__name__}); choose a writable place"
        ) from None
    try:
        text_dir = None
        if imported.text_files:
            text_dir = tmp / "text_model"
            text_dir.mkdir()
            for name, data in imported.text_files.items():
                (text_dir / name).write_bytes(data)
        model = build_model(imported, text_dir, Path(checkpoint))
        spec = dataclasses.replace(model.spec, text_model_path="text_model" if text_dir else "")
        record = {
            "kind": imported.kind,
            "checkpoint": str(Path(checkpoint).resolve()),
            "sha256": sha256_file(Path(checkpoint)),
            "options": imported.options,
            "unused_keys": imported.unused_keys,
            "notes": imported.notes,
        }
        write_run_config(tmp, imported.recipe, spec, {"imported_from": record})
        atomic_write_bytes(tmp / "best.safetensors", tensor_bytes(model.state_dict()))
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
