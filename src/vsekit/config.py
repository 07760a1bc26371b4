"""Typed recipes: YAML files over dataclasses, with `key=value` overrides and strict key checking.

A recipe names every part of a model (encoders, pooling, similarity, loss) and the training schedule.
Unknown keys are errors, because a typo in a config silently running the default is the most
expensive bug in a multi-day training run.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from vsekit.errors import VseInputError


class ConfigError(VseInputError):
    """A recipe or override that does not fit the schema."""


@dataclass
class PoolingConfig:
    """How a set of vectors becomes one: avg | max | kmax | gpo | adpool | cls."""

    name: str = "gpo"
    k: int = 1  # kmax: number of largest values averaged per dimension
    d_pe: int = 32  # gpo: positional-encoding size
    d_hidden: int = 32  # gpo: BiGRU size
    temperature: float = 0.1  # gpo: softmax temperature
    token_level: bool = True  # adpool: use the token-level branch
    embedding_level: bool = True  # adpool: use the embedding-level branch
    # adpool: reference (default; the released code behind the paper's Table 1: a D x D scorer + ReLU, a weight per
    # rank and dimension) | paper (Eq. 3 as printed: one weight per rank). docs/vse_2ad.md
    adpool_variant: str = "reference"
    # adpool: False = the released code's token-level softmax, which also runs over the padded positions of the
    # batch (their features are 0, their weights are not), so a set's embedding depends on how far it is padded
    adpool_mask_padding: bool = True


@dataclass
class ImageEncoderConfig:
    # precomp: precomputed features from {split}_ims.npy; backbone: a CNN on raw pixels;
    # vit: a ViT patch encoder on raw pixels with AVSE's multi-view token sampling (imported AVSE runs)
    kind: str = "precomp"
    # region: linear + 2-layer residual MLP (BUTD regions); grid: one linear layer (VSE∞ supp.)
    feature_type: str = "region"
    mlp_hidden: int = 512
    backbone: str = "efficientnet_lite0"
    backbone_weights: str = ""  # local weights file; empty = the packaged EfficientNet-Lite0 weights
    image_size: int = 224
    # staged unfreezing: backbone frozen for this many epochs, then trainable from the top down
    backbone_frozen_epochs: int = 1
    backbone_trainable_blocks: int = -1  # -1 = every stage once unfrozen; N = only the last N stages (head included)
    backbone_lr_mult: float = 0.1
    # the first unfrozen epoch (after backbone_frozen_epochs > 0) ramps in linearly over its steps: loss (the
    # released VSE∞ code: loss x step/N) | lr (the paper's "learning-rate warm-up") | none. See docs/training.md
    backbone_warmup: str = "loss"
    # multi-view (AVSE): number of views; 1 = ordinary single embedding
    views: int = 1
    view_keep_train: float = 0.75
    view_keep_test: float = 0.9
    # multi-view precomp features: False (default, paper §4.2) = each view keeps view_keep_train/_test of the image's
    # *full* set, and data.size_augment drops no regions/cells of a multi-view image; True = the views are drawn
    # from the size-augmented set (vsekit before this option: ~0.8 x 0.75 = 60 % of the regions per view)
    view_size_augment: bool = False
    pooling: PoolingConfig = field(default_factory=PoolingConfig)


@dataclass
class TextEncoderConfig:
    # bigru | bow (mean of learned word embeddings: the linear floor every table carries) | transformer
    kind: str = "bigru"
    word_dim: int = 300
    num_layers: int = 1
    # words seen fewer times in the train captions are <unk>; the BiGRU recipes set 4 (SCAN's vocabularies)
    vocab_min_count: int = 1
    # bigru/bow: regex (dependency-free) | nltk (the released code's Treebank tokens; the BiGRU recipes set it,
    # and a SCAN vocab_path is always read with it)
    tokenizer: str = "regex"
    vocab_path: str = ""  # a vocab JSON; empty = built from the train split's captions
    model_path: str = ""  # transformer: a local HF directory; empty = packaged all-MiniLM-L6-v2
    lr_mult: float = 0.1  # transformer body learning-rate multiplier
    # transformer body frozen: a fixed feature extractor in eval mode (no dropout); projection and pooling train
    freeze: bool = False
    # frozen body only: keep each distinct caption's token states (they never change) up to this many MB, so
    # every epoch after the first skips the body for captions it has seen; 0 = run the body every step
    frozen_cache_mb: int = 1024
    max_tokens: int = 64
    # transformer: run the body on length-sorted chunks of this many captions, each padded only to its own
    # longest (same states up to float rounding; 2-3x faster on short captions); 0 = one padded batch
    length_sorted_chunk: int = 32
    # transformer: linear (hidden -> embed) | residual_mlp (linear + the region encoder's residual MLP, AVSE)
    head: str = "linear"
    head_mlp_hidden: int = 512  # residual_mlp head: hidden size of the MLP
    # transformer: LayerNorm on the pooled caption instead of L2 normalisation (AVSE's released text encoder)
    final_layernorm: bool = False
    # transformer: add a learned bag of the tokenizer's word pieces (mean of trainable embeddings of the same
    # token ids) to the caption embedding: the bag-of-words floor's fit to the data beside the pretrained
    # body's knowledge of words the training captions never use (the small_data recipe)
    word_bag: bool = False
    pooling: PoolingConfig = field(default_factory=PoolingConfig)


@dataclass
class SimilarityConfig:
    name: str = "cosine"  # cosine | aeom
    block_dim: int = 512  # aeom: d2
    sinkhorn_iters: int = 20  # aeom: c
    use_sinkhorn: bool = True  # aeom: False = the released code's block max-sum (same as readout: maxsum)
    dustbin_init: float = 1.0
    # aeom: how S = sum_j max_i A*_ij reads the Sinkhorn plan. log_plan (default) = the log plan, as the released
    # code's Sinkhorn line (log_optimal_transport(...)[:, :-1, :-1], then max/sum); plan = the plan's
    # probabilities exp(log plan) (Eq. 2 read literally; scores vary ~8x less); maxsum = no Sinkhorn, the block
    # max-sum of the cosines (the released code's active line). docs/avse.md
    readout: str = "log_plan"
    # aeom: entropic temperature: the Sinkhorn runs on A / temperature (the dustbin score z is in those units).
    # The paper names none and the released code divides by nothing: 1
    temperature: float = 1.0


@dataclass
class ModelConfig:
    embed_dim: int = 1024
    normalize: bool = True
    # clamp: x / max(|x|, 1e-12) (torch); add_eps: x / (|x| + 1e-8), the released VSE∞/2AD/AVSE code's form
    l2_form: str = "clamp"
    image: ImageEncoderConfig = field(default_factory=ImageEncoderConfig)
    text: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    similarity: SimilarityConfig = field(default_factory=SimilarityConfig)


@dataclass
class LossConfig:
    name: str = "triplet"  # triplet | adopt | ladder | ladder_auto | infonce
    margin: float = 0.2
    max_violation: bool = True  # hardest negative (VSE++) after the warm-up
    warmup_epochs: int = 1  # epochs that use the sum over all negatives (VSE0) first
    mask_same_image: bool = True  # captions of the same image are never negatives
    temperature: float = 0.05  # adopt / infonce
    # reference (default: the released K rule, whose K falls during training as in the paper's Fig. C-2) | paper (the
    # printed Eq. 6, whose K stays near |B|); docs/vse_2ad.md
    adopt_variant: str = "reference"
    adopt_scale: float = 1.25
    # adopt reference only: pick negatives as the released code does (non-negatives set to 0 first, so the
    # positive itself can be picked when few similarities are above 0); imported VSE+2AD runs set it
    adopt_zero_fill_negatives: bool = False
    view_reg_weight: float = 0.0  # avse: lambda for the dimension-wise view regulariser
    view_reg_offdiag: float = 0.0051  # avse: lambda_1
    # avse: reference (default: the released code's c = A^T B / B; at weight 1 its gradient is comparable to the ranking
    # loss's) | paper (Eq. 3 cosine without /B: ~B x larger, it dominates the ranking loss). docs/avse.md
    view_reg_variant: str = "reference"
    # θ: 0.40 for Sentence-BERT relevance (TMM paper Sec. IV-A; 0.63 was the AAAI "hybrid" CBoW+BERT value)
    ladder_thresholds: list[float] = field(default_factory=lambda: [0.40])
    ladder_margins: list[float] = field(default_factory=lambda: [0.2, 0.01])
    ladder_weights: list[float] = field(default_factory=lambda: [1.0, 0.25])
    ladder_cumulative: bool = False
    ladder_levels_min: int = 2
    ladder_levels_max: int = 4
    ladder_variant: str = "paper"  # paper | reference (released code's hard-contrastive sets, see losses/ladder.py)
    # auto-threshold ladder (released config.atl.py, e.g. 85): each query's one threshold is the given percentile
    # of its relevance row; replaces ladder_thresholds (2 levels). None: fixed thresholds. Checked in losses/ladder.py
    ladder_percentile: float | None = None
    # θ_1 from the data instead of ladder_thresholds: the value that this share of the train split's
    # different-image caption pairs reach (R >= θ_1), computed by the trainer from the relevance embeddings
    # (recipe cvsepp: 0.15, the share the released config.atl.py puts in level 1). None: ladder_thresholds.
    # Unused, like ladder_thresholds, by ladder_auto and with ladder_percentile
    ladder_threshold_share: float | None = None


@dataclass
class DataConfig:
    train_split: str = "train"
    val_split: str = "dev"
    val_max_images: int = 1000  # dev truncated to its first 1,000 images, as every reference does
    # train on this share of the training images (with all their captions), e.g. for a learning curve; the
    # subset is a fixed random draw from train_subset_seed (not train.seed), nested: 25 % is inside 50 %
    train_fraction: float = 1.0
    train_subset_seed: int = 0
    captions_per_image: int = 5  # SCAN layout without a cap2img file
    size_augment: bool = True
    region_keep_prob: float = 0.8
    grid_drop_max: float = 0.2
    text_augment_prob: float = 0.2
    num_workers: int = 0


@dataclass
class OptimConfig:
    lr: float = 5e-4
    weight_decay: float = 1e-4
    lr_decay_epochs: list[int] = field(default_factory=lambda: [15])
    lr_decay: float = 0.1
    grad_clip: float = 2.0


@dataclass
class TrainConfig:
    epochs: int = 25
    batch_size: int = 128
    eval_batch_size: int = 256
    seed: int = 0
    device: str = "auto"
    log_every: int = 50
    checkpoint_every: int = 0  # also checkpoint every N steps (0 = once per epoch)
    amp: str = "none"  # none | bf16 (autocast on the run's device, CPU or CUDA; loss in fp32)
    length_bucketing: bool = False
    tf32: bool = False  # CUDA: TF32 matmuls during the train step (fp32 storage, ~10-bit mantissa products)
    compile: bool = False  # torch.compile the two encoders for the train step
    # gradient caching (vsekit.training.grad_cache): encode the batch in chunks of this many pairs, score the full
    # batch, then re-encode each chunk to back-propagate: the full batch's gradients (all its in-batch negatives)
    # at about one chunk's activation memory, for ~2x the encoder work; 0 = off (one pass over the whole batch)
    grad_cache_chunk: int = 0
    # collapse alarm (vsekit.training.collapse): warn once when the loss stays within 1 % of its all-similarities-
    # equal value, or the embeddings' spread near 0, for this many consecutive steps; 0 = off
    collapse_steps: int = 200
    stop_on_collapse: bool = False  # and then stop the run (state saved, `vse train` exits non-zero)
    # where the training batches are made (vsekit.training.data_path): true = precomp features and tokenised
    # captions live on the device and each batch is gathered and augmented there; false = the DataLoader;
    # auto = on the device when the recipe allows it and the set fits in half the free device memory
    data_on_device: bool | str = "auto"
    # caption widths a batch is padded to (vsekit.training.data_path): N >= 1 fixed widths at the quantiles of the
    # training captions' token lengths, the last the longest caption (1: that one width); each batch takes the
    # smallest that holds its longest caption (with length_bucketing most batches fall in small ones), and the
    # DataLoader also pads feature sets to the set's largest: a small fixed set of shapes. 0: each batch its own
    # width (dynamic shapes). Transformer text (DataLoader only) pads each batch to its own longest caption
    caption_buckets: int = 4
    # CUDA: the whole step (forward, loss, backward, clipping, fused AdamW) captured as one CUDA graph per batch
    # shape and replayed (vsekit.training.cuda_graph); refused on other devices and for parts that cannot be captured
    cuda_graph: bool = False


@dataclass
class Recipe:
    name: str = "custom"
    model: ModelConfig = field(default_factory=ModelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# ---------------------------------------------------------------------------------------------
# dict <-> dataclass with strict checking


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, where: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{where}: expected a mapping, got {type(value).__name__} {value!r}")
        return from_dict(tp, value, where)
    if origin in (list, typing.List):  # noqa: UP006
        (item_tp,) = typing.get_args(tp)
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        return [_coerce(v, item_tp, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        for a in args:
            if a is type(None):
                continue
            try:
                return _coerce(value, a, where)
            except ConfigError:
                continue
        raise ConfigError(f"{where}: {value!r} does not fit {tp}")
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return value
    if tp is float:
        if isinstance(value, str):
            # YAML 1.1 reads `2e-4` and `1E-3` (no dot, or no sign in the exponent) as strings: a float field
            # takes every literal Python's float() reads (ints are numbers too; int fields stay strict)
            try:
                return float(value)
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from `data`, refusing unknown keys and wrong types."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys here: {', '.join(sorted(names))}"
        )
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _coerce(v, hints[k], f"{where}.{k}" if where else k)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def builtin_recipes() -> list[str]:
    return sorted(p.name[:-5] for p in resources.files("vsekit.recipes").iterdir() if p.name.endswith(".yaml"))


def _read_yaml(path: Path | Any, label: str) -> dict:
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{label}: not valid YAML: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{label}: the top level must be a mapping")
    return data


def _recipe_dict(name_or_path: str, seen: tuple[str, ...] = ()) -> dict:
    """Raw dict of a recipe, following `base:` (a recipe may start from another one)."""
    path = Path(name_or_path)
    if name_or_path.endswith((".yaml", ".yml")) or path.exists():
        if not path.is_file():
            raise ConfigError(f"recipe file {path} does not exist")
        data, label = _read_yaml(path, str(path)), str(path)
    else:
        res = resources.files("vsekit.recipes") / f"{name_or_path}.yaml"
        if not res.is_file():
            raise ConfigError(f"unknown recipe {name_or_path!r}; built-in recipes: {', '.join(builtin_recipes())}")
        data, label = _read_yaml(res, f"recipe {name_or_path}"), name_or_path
    if label in seen:
        raise ConfigError(f"recipe {label}: circular base: {' -> '.join(seen + (label,))}")
    base = data.pop("base", None)
    if base is not None:
        data = _merge(_recipe_dict(str(base), seen + (label,)), data)
    return data


def parse_override(item: str) -> tuple[list[str], Any]:
    """`model.image.pooling.name=gpo` -> (['model','image','pooling','name'], 'gpo'); values are YAML."""
    if "=" not in item:
        raise ConfigError(f"override {item!r} must look like key.path=value")
    key, raw = item.split("=", 1)
    keys = [k for k in key.strip().split(".") if k]
    if not keys:
        raise ConfigError(f"override {item!r} has an empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {item!r}: value is not valid YAML: {e}") from e
    return keys, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    data = dict(data)
    for item in overrides:
        keys, value = parse_override(item)
        node = data
        for k in keys[:-1]:
            child = node.get(k)
            child = dict(child) if isinstance(child, dict) else {}
            node[k] = child
            node = child
        node[keys[-1]] = value
    return data


def load_recipe(name_or_path: str, overrides: list[str] | None = None) -> Recipe:
    """Load a built-in recipe by name (`vsepp`, `vse_infty`, …) or a YAML file, then apply overrides."""
    data = _recipe_dict(name_or_path)
    data = apply_overrides(data, overrides or [])
    data.setdefault("name", Path(name_or_path).stem)
    recipe = from_dict(Recipe, data)
    validate_recipe(recipe)
    return recipe


# Keys added after runs were saved with their full recipe: a saved recipe without one was trained with the
# behaviour these values select (the new defaults differ), so reading it back keeps that behaviour.
SAVED_RUN_DEFAULTS: dict[tuple[str, ...], Any] = {
    ("model", "similarity", "readout"): "plan",  # AEOM read exp(plan) before `readout` existed
    ("model", "image", "view_size_augment"): True,  # views were drawn from the size-augmented set
}


def recipe_from_dict(data: dict) -> Recipe:
    """A recipe saved with a run (config.json); keys it predates get `SAVED_RUN_DEFAULTS`."""
    data = copy.deepcopy(data)
    for path, value in SAVED_RUN_DEFAULTS.items():
        node = data
        for k in path[:-1]:
            node = node.get(k) if isinstance(node, dict) else None
        if isinstance(node, dict) and path[-1] not in node:
            node[path[-1]] = value
    recipe = from_dict(Recipe, data)
    validate_recipe(recipe)
    return recipe


_CHOICES = {
    "model.image.kind": ("precomp", "backbone", "vit"),
    "model.image.backbone_warmup": ("loss", "lr", "none"),
    "model.l2_form": ("clamp", "add_eps"),
    "model.text.head": ("linear", "residual_mlp"),
    "model.text.tokenizer": ("regex", "nltk"),
    "model.image.feature_type": ("region", "grid"),
    "model.text.kind": ("bigru", "bow", "transformer"),
    "model.similarity.name": ("cosine", "aeom"),
    "loss.name": ("triplet", "adopt", "infonce", "ladder", "ladder_auto"),
    "loss.adopt_variant": ("paper", "reference"),
    "loss.view_reg_variant": ("paper", "reference"),
    "model.similarity.readout": ("log_plan", "plan", "maxsum"),
    "train.amp": ("none", "bf16"),
}
_POOLINGS = ("avg", "max", "kmax", "gpo", "adpool", "cls")


def validate_recipe(r: Recipe) -> None:
    flat = {
        "model.image.kind": r.model.image.kind,
        "model.image.backbone_warmup": r.model.image.backbone_warmup,
        "model.l2_form": r.model.l2_form,
        "model.text.head": r.model.text.head,
        "model.text.tokenizer": r.model.text.tokenizer,
        "model.image.feature_type": r.model.image.feature_type,
        "model.text.kind": r.model.text.kind,
        "model.similarity.name": r.model.similarity.name,
        "loss.name": r.loss.name,
        "loss.adopt_variant": r.loss.adopt_variant,
        "loss.view_reg_variant": r.loss.view_reg_variant,
        "model.similarity.readout": r.model.similarity.readout,
        "train.amp": r.train.amp,
    }
    for key, value in flat.items():
        if value not in _CHOICES[key]:
            raise ConfigError(f"{key}={value!r}; choose one of {', '.join(_CHOICES[key])}")
    for key, pool in (("model.image.pooling", r.model.image.pooling), ("model.text.pooling", r.model.text.pooling)):
        if pool.name not in _POOLINGS:
            raise ConfigError(f"{key}.name={pool.name!r}; choose one of {', '.join(_POOLINGS)}")
        if pool.k < 1:
            raise ConfigError(f"{key}.k must be >= 1")
    if r.model.embed_dim < 1:
        raise ConfigError("model.embed_dim must be positive")
    if r.train.batch_size < 2:
        raise ConfigError("train.batch_size must be at least 2 (in-batch negatives)")
    if r.train.epochs < 1:
        raise ConfigError(f"train.epochs (--epochs) must be at least 1, got {r.train.epochs}")
    if r.model.image.views < 1:
        raise ConfigError("model.image.views must be >= 1")
    if not 0.0 < r.data.train_fraction <= 1.0:
        raise ConfigError(f"data.train_fraction={r.data.train_fraction}; must lie in (0, 1]")
    if r.model.similarity.name == "aeom" and r.model.embed_dim % r.model.similarity.block_dim:
        raise ConfigError("model.embed_dim must be a multiple of model.similarity.block_dim")
    if not r.model.similarity.temperature > 0:
        raise ConfigError(f"model.similarity.temperature={r.model.similarity.temperature}; must be positive")
    if not (isinstance(r.train.data_on_device, bool) or r.train.data_on_device == "auto"):
        raise ConfigError(f"train.data_on_device={r.train.data_on_device!r}; choose one of auto, true, false")
    _validate_numbers(r)


def _validate_numbers(r: Recipe) -> None:
    """Values the model, loss and optimiser would otherwise refuse late, with torch's words or not at all."""
    if not 0 < r.optim.lr < math.inf:  # `not <` also refuses NaN; torch says only "Invalid learning rate"
        raise ConfigError(f"optim.lr={r.optim.lr}: the learning rate must be a positive finite number")
    if r.loss.name in ("adopt", "infonce") and not 0 < r.loss.temperature < math.inf:
        raise ConfigError(f"loss.temperature={r.loss.temperature}: must be positive")
    _validate_ranges(r)
    if r.loss.adopt_zero_fill_negatives and r.loss.adopt_variant != "reference":
        raise ConfigError("loss.adopt_zero_fill_negatives=true reproduces the released code: it needs "
                          "loss.adopt_variant=reference")  # fmt: skip
    if r.model.similarity.block_dim < 1 or r.model.similarity.sinkhorn_iters < 1:
        raise ConfigError("model.similarity.block_dim and model.similarity.sinkhorn_iters must be >= 1")
    for name in ("view_keep_train", "view_keep_test"):
        keep = getattr(r.model.image, name)
        if not 0.0 < keep <= 1.0:
            raise ConfigError(f"model.image.{name}={keep}; must lie in (0, 1]")
    if r.model.image.views > 1 and r.model.similarity.name != "aeom":
        raise ConfigError(f"model.image.views={r.model.image.views} (multi-view) needs model.similarity.name=aeom")
    for key, pool in (("model.image.pooling", r.model.image.pooling), ("model.text.pooling", r.model.text.pooling)):
        if pool.name == "gpo" and (pool.d_pe < 2 or pool.d_pe % 2 or pool.d_hidden < 1 or not pool.temperature > 0):
            raise ConfigError(f"{key}: gpo needs an even d_pe >= 2 (got {pool.d_pe}), d_hidden >= 1 (got "
                              f"{pool.d_hidden}) and a positive temperature (got {pool.temperature})")  # fmt: skip
        if pool.name == "adpool" and pool.adpool_variant not in ("paper", "reference"):
            raise ConfigError(f"{key}.adpool_variant={pool.adpool_variant!r}; choose one of paper, reference")
        if pool.name == "adpool" and not (pool.token_level or pool.embedding_level):
            raise ConfigError(f"{key}: adpool needs token_level or embedding_level (both are false)")
    if r.loss.view_reg_weight > 0 and r.model.image.views < 2:
        raise ConfigError("loss.view_reg_weight > 0 (the view regulariser) needs model.image.views >= 2")
    if r.train.grad_cache_chunk > 0 and (r.train.compile or r.train.cuda_graph):
        raise ConfigError("train.grad_cache_chunk (gradient caching) cannot be combined with train.compile or "
                          "train.cuda_graph: it re-enters the encoders chunk by chunk; set one of them off")  # fmt: skip
    from vsekit.errors import check_device_name

    check_device_name(r.train.device, "train.device (--device)", ConfigError)


# (rule, test) of `_validate_ranges`; every test is False for NaN
_RANGES = {
    ">= 0 and finite": lambda v: 0 <= v < math.inf,
    "a positive finite number": lambda v: 0 < v < math.inf,
    "a finite number": lambda v: -math.inf < v < math.inf,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    ">= -1 (-1: every stage)": lambda v: v >= -1,
    "in -2**63 .. 2**64-1 (torch's seed range)": lambda v: -(2**63) <= v < 2**64,
    "in 0 .. 2**64-1 (numpy's seed range)": lambda v: 0 <= v < 2**64,
}


def _validate_ranges(r: Recipe) -> None:
    """Numbers with an obvious range (margins, rates, probabilities, counts, sizes), checked when the recipe
    is built: `--set loss.margin=inf` is refused naming the key, not after an epoch of NaN losses."""
    m, img, txt, loss, d, o, t = r.model, r.model.image, r.model.text, r.loss, r.data, r.optim, r.train
    checks: list[tuple[str, Any, str]] = [
        ("loss.margin", loss.margin, ">= 0 and finite"),
        ("loss.warmup_epochs", loss.warmup_epochs, ">= 0"),
        ("loss.adopt_scale", loss.adopt_scale, "a positive finite number"),
        ("loss.view_reg_weight", loss.view_reg_weight, ">= 0 and finite"),
        ("loss.view_reg_offdiag", loss.view_reg_offdiag, ">= 0 and finite"),
        *((f"loss.ladder_margins[{i}]", v, ">= 0 and finite") for i, v in enumerate(loss.ladder_margins)),
        *((f"loss.ladder_weights[{i}]", v, ">= 0 and finite") for i, v in enumerate(loss.ladder_weights)),
        *((f"loss.ladder_thresholds[{i}]", v, "a finite number") for i, v in enumerate(loss.ladder_thresholds)),
        ("optim.weight_decay", o.weight_decay, ">= 0 and finite"),
        ("optim.lr_decay", o.lr_decay, "a positive finite number"),
        *((f"optim.lr_decay_epochs[{i}]", v, ">= 0") for i, v in enumerate(o.lr_decay_epochs)),
        ("optim.grad_clip", o.grad_clip, ">= 0 and finite"),
        ("train.eval_batch_size", t.eval_batch_size, ">= 1"),
        ("train.log_every", t.log_every, ">= 0"),
        ("train.checkpoint_every", t.checkpoint_every, ">= 0"),
        ("train.grad_cache_chunk", t.grad_cache_chunk, ">= 0"),
        ("train.collapse_steps", t.collapse_steps, ">= 0"),
        ("train.caption_buckets", t.caption_buckets, ">= 0"),
        ("train.seed", t.seed, "in -2**63 .. 2**64-1 (torch's seed range)"),
        ("data.val_max_images", d.val_max_images, ">= 0"),
        ("data.captions_per_image", d.captions_per_image, ">= 1"),
        ("data.region_keep_prob", d.region_keep_prob, "in (0, 1]"),
        ("data.grid_drop_max", d.grid_drop_max, "in [0, 1]"),
        ("data.text_augment_prob", d.text_augment_prob, "in [0, 1]"),
        ("data.num_workers", d.num_workers, ">= 0"),
        ("model.image.mlp_hidden", img.mlp_hidden, ">= 1"),
        ("model.image.image_size", img.image_size, ">= 1"),
        ("model.image.backbone_frozen_epochs", img.backbone_frozen_epochs, ">= 0"),
        ("model.image.backbone_trainable_blocks", img.backbone_trainable_blocks, ">= -1 (-1: every stage)"),
        ("model.image.backbone_lr_mult", img.backbone_lr_mult, ">= 0 and finite"),
        ("model.text.word_dim", txt.word_dim, ">= 1"),
        ("model.text.num_layers", txt.num_layers, ">= 1"),
        ("model.text.vocab_min_count", txt.vocab_min_count, ">= 0"),
        ("model.text.lr_mult", txt.lr_mult, ">= 0 and finite"),
        ("model.text.frozen_cache_mb", txt.frozen_cache_mb, ">= 0"),
        ("model.text.max_tokens", txt.max_tokens, ">= 1"),
        ("model.text.length_sorted_chunk", txt.length_sorted_chunk, ">= 0"),
        ("model.text.head_mlp_hidden", txt.head_mlp_hidden, ">= 1"),
        ("model.similarity.temperature", m.similarity.temperature, "a positive finite number"),
        ("model.similarity.dustbin_init", m.similarity.dustbin_init, "a finite number"),
    ]
    if d.train_fraction < 1.0:  # the subset's draw: numpy refuses a negative seed
        checks.append(("data.train_subset_seed", d.train_subset_seed, "in 0 .. 2**64-1 (numpy's seed range)"))
    for key, pool in (("model.image.pooling", img.pooling), ("model.text.pooling", txt.pooling)):
        checks.append((f"{key}.temperature", pool.temperature, "a positive finite number"))
    for key, value, rule in checks:
        if not _RANGES[rule](value):
            raise ConfigError(f"{key}={value}: must be {rule}")
