"""Typed recipes: YAML files over dataclasses, with `key=value` overrides and strict key checking.

A recipe names every part of a model (encoders, pooling, similarity, loss) and the training schedule.
Unknown keys are errors, because a typo in a config silently running the default is the most
expensive bug in a multi-day training run.

The sections of the parts (`model.image`, `model.text`, their `pooling`, `model.similarity`, `loss`) are
`PartSection`s: the part's name, and flat, the settings of every registered part of that kind, which each part
declares next to its code (`vsekit.registry`). The other sections are plain dataclasses here. Every key carries
its help, and optionally its range or choices (`registry.setting`); docs/recipe_keys.md is generated from them.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

import yaml

from vsekit import registry
from vsekit.errors import VseInputError, check_device_name
from vsekit.registry import setting
from vsekit.utils.safe_json import MAX_NUMBER_CHARS

log = logging.getLogger(__name__)

# What a recipe file may hold (a recipe may come from elsewhere: a downloaded file, a run's config.json). The
# built-in recipes are under 4 KB, nest 5 levels (model.image.pooling.name, a list inside) and use no YAML
# anchors or aliases, so each bound is far above any real recipe and refuses before the cost grows.
MAX_RECIPE_BYTES = 1 << 20  # 1 MiB: a recipe file, or one --set value
MAX_RECIPE_DEPTH = 32  # mappings and lists inside each other
# What the widths of a model may add up to, estimated from the recipe before anything is allocated (the weight
# matrices the widths size; a pretrained body is not counted): 2**30 parameters is 4 GiB as float32 (16 GiB with
# gradients and AdamW's two moments), 45x the ~24 M of the largest built-in recipe (hrem).
MAX_MODEL_PARAMETERS = 1 << 30


class ConfigError(VseInputError):
    """A recipe or override that does not fit the schema."""


@dataclass(init=False, eq=False, repr=False)
class PartSection:
    """A recipe section that names a registered part: its own keys (the part's `name`, or `kind` for encoders,
    and subsections) and, flat as recipes write them, the settings keys of every part of its kind, read and set
    as attributes (`cfg.d_pe`). Subclasses are dataclasses made with `init=False, eq=False, repr=False`."""

    part_kind: ClassVar[str]
    selector: ClassVar[str] = "name"
    settings: dict[str, Any] = field(default_factory=dict)  # key -> value of every settings key of the kind

    def __init__(self, **values: Any) -> None:
        given = dict(values.pop("settings", None) or {})  # dataclasses.replace passes the settings store
        for f in dataclasses.fields(self):
            if f.name != "settings":
                object.__setattr__(
                    self, f.name, values.pop(f.name) if f.name in values else registry.default_of(f)
                )
        known = registry.keys(self.part_kind)
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unknown recipe key(s) {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(known))}"
            )
        settings = {k: registry.default_of(key.field) for k, key in known.items()}
        settings.update((k, v) for k, v in given.items() if k in known)
        settings.update(values)
        object.__setattr__(self, "settings", settings)

    def __getattr__(self, key: str) -> Any:  # only for names that are not attributes: the settings keys
        settings = self.__dict__.get("settings")
        if settings is None or key.startswith("__"):
            raise AttributeError(key)
        if key not in settings:
            known = registry.keys(self.part_kind).get(key)
            if known is None:
                raise AttributeError(f"{type(self).__name__} has no recipe key {key!r}")
            settings[key] = registry.default_of(known.field)  # a part registered after this section was made
        return settings[key]

    def __setattr__(self, key: str, value: Any) -> None:
        if key in self.__dataclass_fields__:  # type: ignore[attr-defined]
            object.__setattr__(self, key, value)
        elif key in registry.keys(self.part_kind):
            self.settings[key] = value
        else:
            raise AttributeError(f"{type(self).__name__} has no recipe key {key!r}")

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        return to_dict(self) == to_dict(other)

    __hash__ = None  # type: ignore[assignment]  # mutable, like the dataclasses around it

    def __repr__(self) -> str:
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in to_dict(self).items())})"

    def part_settings(self) -> registry.Settings:
        """The named part's own settings dataclass, filled from this section."""
        part = registry.get(self.part_kind, getattr(self, self.selector))
        return part.settings(**{k: getattr(self, k) for k in part.fields()})


@dataclass(init=False, eq=False, repr=False)
class PoolingConfig(PartSection):
    """How a set of vectors becomes one (`model.image.pooling`, `model.text.pooling`); settings: vsekit.pooling.parts."""

    part_kind: ClassVar[str] = "pooling"
    name: str = setting("gpo", "the pooling of the set of vectors (`vse recipes` lists the choices)")


@dataclass(init=False, eq=False, repr=False)
class ImageEncoderConfig(PartSection):
    """The image encoder (`model.image`); settings: vsekit.models.image_parts."""

    part_kind: ClassVar[str] = "image_encoder"
    selector: ClassVar[str] = "kind"
    kind: str = setting("precomp", "the image encoder (`vse recipes` lists the choices)")
    pooling: PoolingConfig = field(default_factory=PoolingConfig)


@dataclass(init=False, eq=False, repr=False)
class TextEncoderConfig(PartSection):
    """The caption encoder (`model.text`); settings: vsekit.models.text_parts."""

    part_kind: ClassVar[str] = "text_encoder"
    selector: ClassVar[str] = "kind"
    kind: str = setting("bigru", "the caption encoder (`vse recipes` lists the choices)")
    pooling: PoolingConfig = field(default_factory=PoolingConfig)


@dataclass(init=False, eq=False, repr=False)
class SimilarityConfig(PartSection):
    """How an image and a caption embedding are scored (`model.similarity`); settings: vsekit.similarity.parts."""

    part_kind: ClassVar[str] = "similarity"
    name: str = setting(
        "cosine", "the similarity of an image and a caption (`vse recipes` lists the choices)"
    )


@dataclass(init=False, eq=False, repr=False)
class LossConfig(PartSection):
    """The training objective (`loss`); settings: vsekit.losses.parts."""

    part_kind: ClassVar[str] = "loss"
    name: str = setting(
        "triplet", "the loss on the in-batch similarity matrix (`vse recipes` lists the choices)"
    )


@dataclass(init=False, eq=False, repr=False)
class SamplePolicyConfig(PartSection):
    """Which pairs an epoch trains on, and how much each counts (`train.sample_policy`); see
    vsekit.training.sample_policy."""

    part_kind: ClassVar[str] = "sample_policy"
    name: str = setting(
        "uniform",
        "the epoch plan: uniform = every pair, a fresh permutation each epoch (`vse recipes` lists the choices)",
    )


@dataclass
class ModelConfig:
    embed_dim: int = setting(1024, "size of the joint embedding space", rule=">= 1", max=registry.MAX_WIDTH)
    normalize: bool = setting(True, "L2-normalise both embeddings")
    l2_form: str = setting(
        "clamp",
        "how the L2 norm divides: clamp = x / max(|x|, 1e-12) (torch); add_eps = "
        "x / (|x| + 1e-8), the released VSE∞/2AD/AVSE code's form",
        choices=("clamp", "add_eps"),
    )
    centre: str = setting(
        "none",
        "batch = subtract the batch mean of each side's embeddings before a last L2 normalisation (IN2R; "
        "eval mode subtracts the running mean of the training batches') | none",
        choices=("none", "batch"),
    )
    image: ImageEncoderConfig = field(default_factory=ImageEncoderConfig)
    text: TextEncoderConfig = field(default_factory=TextEncoderConfig)
    similarity: SimilarityConfig = field(default_factory=SimilarityConfig)


@dataclass
class DataConfig:
    train_split: str = setting(
        "train", "the split trained on ({split}_ims.npy or {split}_images.txt, {split}_caps.txt)"
    )
    val_split: str = setting("dev", "the split that picks the best epoch (validation after every epoch)")
    val_max_images: int = setting(
        1000,
        "validation on the first N images of val_split, as every reference does "
        "(the 1,000-image dev set); 0 = all",
        rule=">= 0",
    )
    train_fraction: float = setting(
        1.0,
        "train on this share of the training images (with all their captions), "
        "e.g. for a learning curve; a fixed draw from train_subset_seed, nested: "
        "25 % is inside 50 %",
        rule="in (0, 1]",
    )
    train_subset_seed: int = setting(
        0, "seed of the train_fraction draw (not train.seed, so every seed trains on the same subset)"
    )
    captions_per_image: int = setting(
        5, "captions per image of a split without {split}_cap2img.txt (SCAN layout)", rule=">= 1"
    )
    size_augment: bool = setting(
        True,
        "VSE∞'s size augmentation of training images (regions or grid cells dropped "
        "at random) and captions (words masked, replaced or dropped)",
    )
    region_keep_prob: float = setting(
        0.8,
        "size augmentation: each region of a region-feature image is kept with this probability",
        rule="in (0, 1]",
    )
    grid_drop_max: float = setting(
        0.2,
        "size augmentation: a grid-feature image drops a random share of its cells, up to this one",
        rule="in [0, 1]",
    )
    text_augment_prob: float = setting(
        0.2,
        "caption augmentation: each word is masked, replaced or dropped with this probability (0 = off)",
        rule="in [0, 1]",
    )
    num_workers: int = setting(
        0, "DataLoader worker processes (the CPU data path)", rule=">= 0", max=registry.MAX_WORKERS
    )


@dataclass
class OptimConfig:
    lr: float = setting(5e-4, "AdamW learning rate", rule="a positive finite number")
    weight_decay: float = setting(1e-4, "AdamW weight decay", rule=">= 0 and finite")
    lr_decay_epochs: list[int] = setting(
        [15],
        "epochs (counted finished) after which the learning rate is multiplied by lr_decay, once each",
        rule=">= 0",
    )
    lr_decay: float = setting(0.1, "the factor of each learning-rate decay", rule="a positive finite number")
    grad_clip: float = setting(
        2.0, "clip the gradient norm to this value (0 = no clipping)", rule=">= 0 and finite"
    )


@dataclass
class TrainConfig:
    epochs: int = setting(25, "epochs to train (at least 1; --epochs)")
    batch_size: int = setting(
        128,
        "image-caption pairs per batch, whose other pairs are the negatives (at least 2; --batch-size)",
        max=registry.MAX_BATCH,
    )
    eval_batch_size: int = setting(
        256, "batch size of encoding for validation", rule=">= 1", max=registry.MAX_BATCH
    )
    seed: int = setting(
        0,
        "seed of the initial weights, the batch order and the augmentation (--seed)",
        rule="in -2**63 .. 2**64-1 (torch's seed range)",
    )
    device: str = setting("auto", "cpu, cuda, cuda:N, mps, or auto (CUDA when present; --device)")
    log_every: int = setting(
        50, "write a training record to metrics.jsonl every N steps (0 = only per epoch)", rule=">= 0"
    )
    checkpoint_every: int = setting(0, "also checkpoint every N steps (0 = once per epoch)", rule=">= 0")
    amp: str = setting(
        "none",
        "mixed precision: none | bf16 (autocast on the run's device, CPU or CUDA; loss in fp32)",
        choices=("none", "bf16"),
    )
    length_bucketing: bool = setting(
        False, "batches of captions of similar length (less padding, the same pairs per epoch)"
    )
    tf32: bool = setting(
        False, "CUDA: TF32 matmuls during the train step (fp32 storage, ~10-bit mantissa products)"
    )
    compile: bool = setting(False, "torch.compile the two encoders for the train step")
    grad_cache_chunk: int = setting(
        0,
        "gradient caching (vsekit.training.grad_cache): encode the batch in chunks of "
        "this many pairs, score the full batch, then re-encode each chunk to "
        "back-propagate: the full batch's gradients at about one chunk's activation "
        "memory, for ~2x the encoder work; 0 = off",
        rule=">= 0",
        max=registry.MAX_BATCH,
    )
    collapse_steps: int = setting(
        200,
        "collapse alarm (vsekit.training.collapse): warn once when the loss stays "
        "within 1 % of its all-similarities-equal value, or the embeddings' spread "
        "near 0, for this many consecutive steps; 0 = off",
        rule=">= 0",
    )
    stop_on_collapse: bool = setting(False, "and then stop the run (state saved, `vse train` exits non-zero)")
    chance_validations: int = setting(
        2,
        "chance alarm (vsekit.training.chance): warn once when dev rsum stays below the level of random "
        "scores on the dev split (its mean + 3 std) for this many consecutive validations; 0 = off",
        rule=">= 0",
    )
    data_on_device: bool | str = setting(
        "auto",
        "where training batches are made (vsekit.training.data_path): true = "
        "precomp features and tokenised captions live on the device and each "
        "batch is gathered and augmented there; false = the DataLoader; auto "
        "= on the device when the recipe allows it and the set fits in half "
        "the free device memory",
    )
    caption_buckets: int = setting(
        4,
        "caption widths a batch is padded to (vsekit.training.data_path): N >= 1 fixed "
        "widths at quantiles of the training captions' token lengths, the last the "
        "longest caption; each batch takes the smallest that holds its longest "
        "caption. 0: each batch its own width (dynamic shapes). Transformer text "
        "(DataLoader only) pads each batch to its own longest caption",
        rule=">= 0",
        max=registry.MAX_COUNT,
    )
    cuda_graph: bool = setting(
        False,
        "CUDA: the whole step (forward, loss, backward, clipping, fused AdamW) captured "
        "as one CUDA graph per batch shape and replayed (vsekit.training.cuda_graph); "
        "refused on other devices and for parts that cannot be captured",
    )
    sample_policy: SamplePolicyConfig = field(default_factory=SamplePolicyConfig)


@dataclass
class Recipe:
    name: str = setting("custom", "the recipe's name (a file's stem when not given)")
    coco_scale: bool = setting(
        False,
        "its settings were chosen for Flickr30K / MS-COCO (29k-113k images): vse train hints at the "
        "bag-of-words floor when it meets a small split (training/advice.py)",
    )
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
        given = [a for a in args if a is not type(None)]
        if len(given) == 1:  # an optional key: the type's own message (must be a finite number, …)
            return _coerce(value, given[0], where)
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
                number = float(value) if len(value) <= MAX_NUMBER_CHARS else math.nan
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {value!r}") from None
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{where}: expected a number, got {value!r}")
        else:
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
        # no recipe key means NaN or infinity, and config.json (read back with JSON's bounds) never holds one
        if not math.isfinite(number):
            raise ConfigError(f"{where}={str(value)[:40]}: must be a finite number (not NaN or infinity)")
        return number
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{where}: expected a string, got {value!r}")
        return value
    raise ConfigError(f"{where}: unsupported type {_type_name(tp)}")


def _key_types(cls: type) -> dict[str, Any]:
    """The keys a section of `cls` takes and their types (a part section: its own and its kind's settings)."""
    hints = typing.get_type_hints(cls)
    out = {
        f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "settings" or not _is_part(cls)
    }
    if _is_part(cls):
        out.update({k: key.type for k, key in registry.keys(cls.part_kind).items()})
    return out


def _is_part(cls: type) -> bool:
    return isinstance(cls, type) and issubclass(cls, PartSection)


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass `cls` from `data`, refusing unknown keys and wrong types."""
    types_ = _key_types(cls)
    odd = next((k for k in data if not isinstance(k, str)), None)
    if odd is not None:
        raise ConfigError(
            f"{where or 'recipe'}: key {str(odd)[:40]!r} is not a name (a {type(odd).__name__})"
        )
    unknown = sorted(set(data) - set(types_))
    if unknown:
        prefix = f"{where}." if where else ""
        raise ConfigError(
            f"unknown key(s) {', '.join(prefix + k for k in unknown)}; "
            f"valid keys here: {', '.join(sorted(types_))}"
        )
    kwargs = {}
    for k, v in data.items():
        kwargs[k] = _coerce(v, types_[k], f"{where}.{k}" if where else k)
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    """A recipe (or one of its sections) as plain data, as config.json and `vse recipes NAME` write it: a part
    section's settings flat, after its name and before its subsections."""
    out: dict[str, Any] = {}
    subsections = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(obj, PartSection) and f.name == "settings":
            continue
        if dataclasses.is_dataclass(value):
            subsections[f.name] = to_dict(value)
        else:
            out[f.name] = copy.deepcopy(value)
    if isinstance(obj, PartSection):
        out.update((k, copy.deepcopy(getattr(obj, k))) for k in registry.keys(obj.part_kind))
    return {**out, **subsections}


def _merge(base: dict, update: dict) -> dict:
    out = dict(base)
    for k, v in update.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


def builtin_recipes() -> list[str]:
    return sorted(
        p.name[:-5] for p in resources.files("vsekit.recipes").iterdir() if p.name.endswith(".yaml")
    )


class _OutOfBounds(yaml.MarkedYAMLError):
    """A recipe's YAML beyond the bounds of `_RecipeLoader` (valid YAML, refused)."""


class _RecipeLoader(yaml.SafeLoader):
    """YAML's safe loader within the recipe bounds: no aliases (a few hundred bytes of nested `*a` expand to
    billions of nodes; recipes never need them), at most `MAX_RECIPE_DEPTH` levels (the composer recurses once a
    level), and numbers of at most `MAX_NUMBER_CHARS` characters (int() of thousands of digits is quadratic)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _OutOfBounds(
                None,
                None,
                f"an alias (*{event.anchor}): recipes do not use YAML anchors and aliases",
                event.start_mark,
            )
        self._depth += 1
        if self._depth > MAX_RECIPE_DEPTH:
            raise _OutOfBounds(
                None, None, f"nested more than {MAX_RECIPE_DEPTH} levels deep", self.peek_event().start_mark
            )
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node: Any) -> int:
        _check_number(node)
        return super().construct_yaml_int(node)

    def construct_yaml_float(self, node: Any) -> float:
        _check_number(node)
        return super().construct_yaml_float(node)


def _check_number(node: Any) -> None:
    if len(node.value) > MAX_NUMBER_CHARS:
        raise _OutOfBounds(
            None,
            None,
            f"a number of {len(node.value):,} characters (at most {MAX_NUMBER_CHARS})",
            node.start_mark,
        )


_RecipeLoader.add_constructor("tag:yaml.org,2002:int", _RecipeLoader.construct_yaml_int)
_RecipeLoader.add_constructor("tag:yaml.org,2002:float", _RecipeLoader.construct_yaml_float)


def parse_yaml(text: str | bytes, label: str) -> Any:
    """A recipe's YAML (a file's bytes, or one `--set` value) within the recipe bounds (`_RecipeLoader`,
    `MAX_RECIPE_BYTES`, UTF-8); every problem is a ConfigError naming `label`."""
    if len(text) > MAX_RECIPE_BYTES:
        raise ConfigError(f"{label}: {len(text):,} bytes, more than a recipe may hold ({MAX_RECIPE_BYTES:,})")
    if isinstance(text, (bytes, bytearray)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{label}: not UTF-8 text (byte {e.start}); a recipe is a YAML text file"
            ) from None
    try:
        return yaml.load(text, Loader=_RecipeLoader)  # noqa: S506  (a SafeLoader subclass)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        kind = "" if isinstance(e, _OutOfBounds) else "not valid YAML: "
        raise ConfigError(f"{label}: {kind}{' '.join(str(e.problem or e.context).split())}{where}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{label}: not valid YAML: {' '.join(str(e).split())}") from None
    except RecursionError:  # the bounds above stop well before; kept so no recursion escapes as a crash
        raise ConfigError(f"{label}: nested too deep") from None


def _read_bytes(path: Path | Any, label: str) -> bytes:
    """At most MAX_RECIPE_BYTES + 1 bytes of a recipe file (a larger one is refused by `parse_yaml`)."""
    try:
        if isinstance(path, Path):
            with open(path, "rb") as f:
                return f.read(MAX_RECIPE_BYTES + 1)
        return path.read_bytes()  # a packaged recipe
    except OSError as e:
        raise ConfigError(f"{label}: cannot read the recipe ({e.strerror or e})") from None


def _read_yaml(path: Path | Any, label: str) -> dict:
    data = parse_yaml(_read_bytes(path, label), label)
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
            raise ConfigError(
                f"unknown recipe {name_or_path!r}; built-in recipes: {', '.join(builtin_recipes())}"
            )
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
    shown = item if len(item) <= 80 else item[:60] + "…"
    value = parse_yaml(raw, f"override {shown!r}: value") if raw.strip() else ""
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


def _sections(obj: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, section) of the recipe and every section inside it, outermost first."""
    yield path, obj
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            yield from _sections(value, f"{path}.{f.name}" if path else f.name)


def _keys(section: Any) -> dict[str, dataclasses.Field]:
    """The recipe keys of a section with their fields (help, range, choices)."""
    out = {f.name: f for f in dataclasses.fields(section) if "help" in f.metadata}
    if isinstance(section, PartSection):
        out.update((k, key.field) for k, key in registry.keys(section.part_kind).items())
    return out


def _check_value(key: str, value: Any, f: dataclasses.Field) -> None:
    """A key's declared choices, range and upper bound (for a list, each element's)."""
    choices, rule, most = f.metadata.get("choices"), f.metadata.get("rule"), f.metadata.get("max")
    if choices and value not in choices:
        raise ConfigError(f"{key}={value!r}; choose one of {', '.join(choices)}")
    if (rule is None and most is None) or value is None:
        return
    items = [(f"{key}[{i}]", v) for i, v in enumerate(value)] if isinstance(value, list) else [(key, value)]
    for name, v in items:
        if rule is not None and not registry.RULES[rule](v):
            raise ConfigError(f"{name}={v}: must be {rule}")
        if most is not None and v > most:
            raise ConfigError(f"{name}={v}: at most {most:,} (the bound vsekit sets on this size)")


def _named_fields(section: Any) -> set[str]:
    """The settings keys the part a section names reads (none for a plain section)."""
    if not isinstance(section, PartSection):
        return set()
    return set(registry.get(section.part_kind, getattr(section, section.selector)).fields())


def parameter_estimate(r: Recipe, img_dim: int = 0, vocab_size: int = 0) -> list[tuple[str, int]]:
    """(the key that sizes it, parameters) of the largest weight matrices the recipe's widths ask for, before
    any is allocated: projections, residual MLPs, GRUs, word embeddings, attention layers of the embedding width.
    `img_dim` (the features' width) and `vocab_size` come from a run's data; 0 when not known yet. An estimate
    (a pretrained body is not counted), so that `check_model_size` refuses a model the machine cannot hold with a
    line naming the key, rather than the allocator failing after minutes."""
    e = r.model.embed_dim
    image, text = r.model.image, r.model.text
    terms = [("model.embed_dim", img_dim * e)]  # the image projection
    image_keys, text_keys = _named_fields(image), _named_fields(text)
    if "mlp_hidden" in image_keys:
        terms.append(("model.image.mlp_hidden", (img_dim + e) * image.mlp_hidden))
    if "word_dim" in text_keys:
        terms.append(("model.text.word_dim", vocab_size * text.word_dim))
    if "num_layers" in text_keys:  # a bidirectional GRU of width embed_dim: 3 gates x 2 directions a layer
        layers = text.num_layers
        gru = 6 * e * (text.word_dim + e) + (layers - 1) * 6 * e * (3 * e)
        terms.append(("model.text.num_layers" if layers > 1 else "model.embed_dim", gru))
    if "head_mlp_hidden" in text_keys:
        terms.append(("model.text.head_mlp_hidden", 2 * e * text.head_mlp_hidden))
    attention = 6 * e * e  # query, key, value, output and a feed-forward of the embedding width
    for path, section in (("model.image.pooling", image.pooling), ("model.text.pooling", text.pooling)):
        keys = _named_fields(section)
        if "d_hidden" in keys:  # GPO's BiGRU over the positional encodings
            terms.append((f"{path}.d_hidden", 6 * section.d_hidden * (section.d_pe + section.d_hidden)))
        if "hrem_heads" in keys:
            terms.append(("model.embed_dim", attention))
    if "selfattn_heads" in image_keys:
        terms.append(("model.embed_dim", attention))
    for key in registry.fact("loss", r.loss.name, "model_width_keys", ()):  # null: model.embed_dim
        width = getattr(r.loss, key)
        terms.append((f"loss.{key}", 6 * (e if width is None else width) ** 2))
    return terms


def check_model_size(r: Recipe, img_dim: int = 0, vocab_size: int = 0, where: str = "") -> None:
    """Refuse a recipe whose model would hold more than `MAX_MODEL_PARAMETERS` parameters (`parameter_estimate`),
    naming the key of its largest term; `where` (a run's config.json) prefixes the message."""
    terms = parameter_estimate(r, img_dim, vocab_size)
    total = sum(n for _, n in terms)
    if total > MAX_MODEL_PARAMETERS:
        key, n = max(terms, key=lambda t: t[1])
        prefix = f"{where}: " if where else ""
        raise ConfigError(
            f"{prefix}{key}={_value_at(r, key)}: the model would hold about {total / 1e9:.1f} G parameters "
            f"({4 * total / 2**30:,.0f} GiB as float32; {n / 1e9:.1f} G from this key), more than vsekit's "
            f"bound of {MAX_MODEL_PARAMETERS / 1e9:.2f} G (vsekit.config.MAX_MODEL_PARAMETERS)"
        )
    log.debug("recipe %s: about %.1f M parameters in its widths", r.name, total / 1e6)


def _value_at(r: Recipe, key: str) -> Any:
    node: Any = r
    for part in key.split("."):
        node = getattr(node, part)
    return node


def validate_recipe(r: Recipe) -> None:
    """The parts named exist; every key is in its range and choices; the named parts' own rules and the rules
    across sections hold. The first problem is a ConfigError naming the key."""
    sections = list(_sections(r))
    for path, section in sections:
        if isinstance(section, PartSection):
            name, choices = getattr(section, section.selector), registry.names(section.part_kind)
            if name not in choices:
                raise ConfigError(f"{path}.{section.selector}={name!r}; choose one of {', '.join(choices)}")
    if r.train.batch_size < 2:
        raise ConfigError("train.batch_size must be at least 2 (in-batch negatives)")
    if r.train.epochs < 1:
        raise ConfigError(f"train.epochs (--epochs) must be at least 1, got {r.train.epochs}")
    if r.model.centre == "batch" and r.model.image.views != 1:
        raise ConfigError(
            f"model.centre=batch centres one embedding per image; model.image.views={r.model.image.views} "
            "needs model.centre=none"
        )
    for path, section in sections:
        for key, f in _keys(section).items():
            _check_value(f"{path}.{key}" if path else key, getattr(section, key), f)
    check_model_size(r)
    seed_rule = "in 0 .. 2**64-1 (numpy's seed range)"  # the subset's draw: numpy refuses a negative seed
    if r.data.train_fraction < 1.0 and not registry.RULES[seed_rule](r.data.train_subset_seed):
        raise ConfigError(f"data.train_subset_seed={r.data.train_subset_seed}: must be {seed_rule}")
    if not (isinstance(r.train.data_on_device, bool) or r.train.data_on_device == "auto"):
        raise ConfigError(f"train.data_on_device={r.train.data_on_device!r}; choose one of auto, true, false")
    for (
        path,
        section,
    ) in sections:  # the named part's rules across keys, and the rules every part of a kind shares
        if isinstance(section, PartSection):
            section.part_settings().check(path, r)
            for common in registry.shared(section.part_kind):
                common.settings(**{k: getattr(section, k) for k in common.fields()}).check(path, r)
    if r.train.grad_cache_chunk > 0 and (r.train.compile or r.train.cuda_graph):
        raise ConfigError(
            "train.grad_cache_chunk (gradient caching) cannot be combined with train.compile or "
            "train.cuda_graph: it re-enters the encoders chunk by chunk; set one of them off"
        )
    check_device_name(r.train.device, "train.device (--device)", ConfigError)
