"""The parts a recipe names: image and text encoders, poolings, similarities and losses.

Each part registers, next to its code, its name, its own settings dataclass (the recipe keys it reads, each with
its type, default, range and help: `setting(...)`) and its builder. Recipe validation, the choices a recipe may
name, the `create_*` factories, `vse recipes` and docs/recipe_keys.md all read them here, so a new part is one
module and one `register` call:

    @dataclass
    class LSESettings(Settings):
        lse_sharpness: float = setting(5.0, "how close to max pooling", rule="a positive finite number")

    register("pooling", "lse", LSESettings, build=lambda cfg, dim: LSEPool(cfg.lse_sharpness), help="log-sum-exp")

A recipe writes a part's settings flat in the part's section (`model.image.pooling: {name: gpo, d_pe: 32}`), as
recipes always have: a section takes the keys of every part of its kind, so a key two parts share is declared
once (a base dataclass both settings inherit) or identically. Settings that every part of a kind reads (the
loss's view regulariser) are registered with `register_shared`.

What a builder is given, by kind: pooling `(cfg: PoolingConfig, dim)`; similarity `(cfg: SimilarityConfig,
embed_dim, views)`; loss `(cfg: LossConfig)`; sample_policy `(cfg: SamplePolicyConfig)`; image_encoder and
text_encoder `(recipe: Recipe, spec: DataSpec)`.
Each returns the `nn.Module`. `cfg` is the recipe's whole flat section, so the part reads its keys as attributes.

What consumers need to know of a part beyond its settings is a **fact** it declares at registration
(`register(..., facts={"reads_pixels": True})`; the facts each kind may declare, and what each means, are
`FACTS`), read only through `has_fact` / `fact` / `part_facts` / `names_with`: no consumer tests a part's name,
so a part registered from outside (a test, a notebook) gets the same data, tokenizer, search and alarms as a
built-in one that declares the same facts.

The built-in parts register the first time the registry is asked (the package root installs that loader:
`vsekit.parts`); a part of your own registers when your module is imported, before you load a recipe naming it.
This module imports nothing of vsekit, so every layer may use it.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("image_encoder", "text_encoder", "pooling", "similarity", "loss", "sample_policy")
# the recipe's own keys in a part's section (the part's name, the encoder kind, the encoder's pooling section, the
# section's store of settings): no part may declare a setting with one of these names
RESERVED_KEYS = frozenset({"name", "kind", "pooling", "settings"})

# the ranges a setting may declare (`setting(rule=...)`), the words the error message uses; every test is False for NaN
RULES: dict[str, Callable[[Any], bool]] = {
    ">= 0 and finite": lambda v: 0 <= v < math.inf,
    "a positive finite number": lambda v: 0 < v < math.inf,
    "a finite number": lambda v: -math.inf < v < math.inf,
    "in [0, 1]": lambda v: 0 <= v <= 1,
    "in (0, 1]": lambda v: 0 < v <= 1,
    "in [0, 1)": lambda v: 0 <= v < 1,
    ">= 0": lambda v: v >= 0,
    ">= 1": lambda v: v >= 1,
    ">= -1 (-1: every stage)": lambda v: v >= -1,
    "in -2**63 .. 2**64-1 (torch's seed range)": lambda v: -(2**63) <= v < 2**64,
    "in 0 .. 2**64-1 (numpy's seed range)": lambda v: 0 <= v < 2**64,
}

# Upper bounds of the keys that size an allocation or a loop (`setting(max=...)`, checked with the rule whenever a
# recipe is validated, a run's config.json included): a recipe from elsewhere names sizes, and without a bound
# the allocator is the check (a 10**9 embed_dim asks for terabytes). Each is far above what any recipe uses, so
# no real model is refused; what a model of in-bound widths would hold is bounded as a whole by
# `vsekit.config.MAX_MODEL_PARAMETERS`.
MAX_WIDTH = 65_536  # a vector width (embed_dim, word_dim, hidden sizes): 64x the built-in recipes' 1,024
MAX_COUNT = 256  # layers, heads, views, levels, stages, caption widths: built-in recipes use at most 16
MAX_BATCH = 1_048_576  # pairs per batch or chunk (2**20): 32x the largest published contrastive batch, 32k
MAX_ITERATIONS = 100_000  # iterations of a loop run every step (Sinkhorn): built-in recipes use 20
MAX_WORKERS = 256  # DataLoader worker processes: one per core of the largest machines
MAX_IMAGE_SIDE = 8_000  # a picture's side in pixels: 8,000**2 = MAX_IMAGE_PIXELS, the decoder's own cap
MAX_CACHE_MB = 1_048_576  # a memory budget in MB (1 TiB): the cache fills only as far as there is data


# The facts a part may declare (`register(..., facts=...)`), by kind: each fact's type and what it means to the
# consumers that read it. A fact a part does not declare is False / None. One table, so a typo in a fact's name is
# a RegistryError at registration, not a silently absent fact.
FACTS: dict[str, dict[str, tuple[type | str, str]]] = {
    "image_encoder": {
        "reads_pixels": (
            bool,
            "takes pictures (resized to the section's image_size), not precomputed features: the trainer, "
            "evaluation, search and CLIP_benchmark feed it pixels",
        ),
        "cuda_graph": (bool, "its forward was checked free of host syncs and step-to-step changes"),
        "encode_kwargs": (tuple, "keyword arguments `encode_image` passes on besides `generator`"),
    },
    "text_encoder": {
        "word_vocabulary": (
            bool,
            "reads word ids of a vocabulary built from the train captions (or model.text.vocab_path), not a "
            "pretrained tokenizer: the trainer builds it, a loaded model reads it from its spec",
        ),
        "cuda_graph": (bool, "its forward was checked free of host syncs (no length read back)"),
    },
    "pooling": {
        "keeps_sets": (
            bool,
            "no pooling: the encoder's set of vectors itself, for a similarity that `takes_sets`",
        ),
        "makes_views": (
            bool,
            "where its own encoders apply (`encoders`), it trains on two views of each item, which only a "
            "loss with `scores_views` takes",
        ),
    },
    "similarity": {
        "inner_product": (
            bool,
            "the score is the inner product of one image vector and one caption vector: a search index "
            "answers exactly, without re-ranking",
        ),
        "takes_sets": (bool, "scores sets of vectors [N, S, D] (late interaction), not one vector per item"),
    },
    "loss": {
        "cuda_graph": (bool, "its forward was checked free of host syncs and data-dependent shapes"),
        "cuda_graph_blockers": (
            "callable",
            "(cfg) -> list of the settings of this loss a CUDA graph cannot capture, each naming why",
        ),
        "equal_score": (
            "callable",
            "(cfg, negatives [B] float, hardest: bool, k) -> (label, 0-d tensor) or None: the loss's value when "
            "every similarity of the batch is equal (the collapse alarm); k is ADOPT's K of the step",
        ),
        "model_width_keys": (
            tuple,
            "settings that are the joint space's width: null in a recipe takes model.embed_dim (`create_loss` "
            "fills them; a loss builder sees only its config)",
        ),
        "takes_targets": (
            bool,
            "reads per-batch `targets=` (soft labels the co-teaching trainer computes: NCR's co-rectified ones)",
        ),
        "peer_queues": (
            bool,
            "trains each network of a pair with two forward passes of a labeled batch and the peer's memory "
            "queue on an unlabeled one (IN2R: `vsekit.losses.in2r`, run by `vsekit.training.in2r_step`)",
        ),
        "scores_views": (bool, "scores groups of views of each item (a pooling with `makes_views`)"),
    },
    # a sample policy (`train.sample_policy`, vsekit.training.sample_policy): its builder `(cfg)` returns the
    # policy object, or None for every pair in a fresh permutation each epoch (`uniform`)
    "sample_policy": {
        "members": (
            int,
            "how many networks the policy trains together (2: co-teaching, NCR's co-divide): the run is a pair, "
            "scored as the mean of both similarity matrices (vsekit.models.pair)",
        ),
    },
}


class RegistryError(ValueError):
    """A part registered twice, or declared in a way a recipe could not hold (a programming error)."""


def setting(
    default: Any,
    help: str,
    *,
    rule: str | None = None,
    choices: tuple[str, ...] | None = None,
    max: int | None = None,  # noqa: A002  (the recipe-facing word, as docs/recipe_keys.md prints it)
) -> Any:
    """A recipe key of a settings dataclass: its default, the one line of help docs/recipe_keys.md prints, and
    optionally its range (a `RULES` name; for a list, each element's), its string choices, or its upper bound
    (`max`: every key that sizes an allocation or a loop has one, e.g. `MAX_WIDTH`, so a recipe cannot make
    the allocator the check)."""
    if not help.strip():
        raise RegistryError("every recipe key needs a help string")
    if rule is not None and rule not in RULES:
        raise RegistryError(f"unknown rule {rule!r}; choose one of {', '.join(RULES)}")
    if max is not None and (isinstance(max, bool) or not isinstance(max, int)):
        raise RegistryError(f"max={max!r}: the bound of a recipe key is an integer")
    metadata = {"help": help, "rule": rule, "choices": tuple(choices) if choices else None, "max": max}
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def default_of(f: dataclasses.Field) -> Any:
    """The default value of a dataclass field (a fresh one for list and dict defaults)."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise RegistryError(f"recipe key {f.name!r} has no default")


@dataclass
class Settings:
    """Base of a part's settings dataclass: its fields (made with `setting`) are the recipe keys the part reads."""

    def check(self, where: str, recipe: Any) -> None:
        """Rules across keys or sections, checked when this part is the one a recipe names (the range of one key
        is its `setting(rule=...)`, checked always): raise `vsekit.config.ConfigError` naming `where`."""


@dataclass(frozen=True)
class Key:
    """One recipe key of a kind's section: its field, its type, and the parts that read it."""

    field: dataclasses.Field
    type: Any
    parts: tuple[str, ...]
    shared: bool  # read by every part of the kind

    @property
    def help(self) -> str:
        return self.field.metadata["help"]


@dataclass(frozen=True)
class Part:
    kind: str
    name: str
    settings: type[Settings]
    build: Callable[..., Any] | None  # None for shared settings
    help: str
    module: str  # where it was registered (for the duplicate message)
    shared: bool = False
    # a pooling that brings its own encoder for an encoder kind: {"image:precomp": build, "text:bigru": build},
    # each `build(recipe, spec)` -> the encoder, or None where the pooling's own encoder does not apply
    encoders: Mapping[str, Callable[..., Any]] = dataclasses.field(default_factory=dict)
    facts: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # checked against `FACTS`

    def fields(self) -> dict[str, tuple[dataclasses.Field, Any]]:
        hints = typing.get_type_hints(self.settings)
        return {f.name: (f, hints[f.name]) for f in dataclasses.fields(self.settings)}


_ENTRIES: dict[str, list[Part]] = {k: [] for k in KINDS}  # parts and shared settings, in registration order
_LOADERS: list[Callable[[], None]] = []
_STATE = {"loaded": False, "loading": False}
_KEYS: dict[str, dict[str, Key]] = {}  # `keys(kind)`, cleared whenever a registration changes


def add_loader(loader: Callable[[], None]) -> None:
    """`loader()` registers parts; it runs once, the first time the registry is asked (the package root adds the
    one that imports the built-in parts, `vsekit.parts`)."""
    _LOADERS.append(loader)
    _STATE["loaded"] = False


def _ensure_loaded() -> None:
    if _STATE["loaded"] or _STATE["loading"]:
        return
    _STATE["loading"] = True
    try:
        for loader in list(_LOADERS):
            loader()
        _STATE["loaded"] = True
    finally:
        _STATE["loading"] = False


def _check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise RegistryError(f"unknown kind of part {kind!r}; choose one of {', '.join(KINDS)}")


def _consistent(kind: str, owner: str, fields: dict[str, tuple[dataclasses.Field, Any]]) -> None:
    """A key declared by two parts of a kind is one key of the flat section: same type, default, help and range."""
    for key, (f, tp) in fields.items():
        if key in RESERVED_KEYS:
            raise RegistryError(f"{kind} {owner!r}: setting {key!r} is a reserved recipe key")
        if "help" not in f.metadata:
            raise RegistryError(f"{kind} {owner!r}: setting {key!r} must be made with registry.setting(...)")
        default_of(f)
        for other in _ENTRIES[kind]:
            mine = other.fields().get(key)
            if mine is None:
                continue
            g, other_tp = mine
            if (other_tp, default_of(g), dict(g.metadata)) != (tp, default_of(f), dict(f.metadata)):
                raise RegistryError(
                    f"{kind} {owner!r}: setting {key!r} differs from the one {other.name!r} declares "
                    "(a shared key is declared once, e.g. in a base class both settings inherit)"
                )


def _add(part: Part) -> Part:
    if not (
        isinstance(part.settings, type)
        and issubclass(part.settings, Settings)
        and dataclasses.is_dataclass(part.settings)
    ):
        raise RegistryError(
            f"{part.kind} {part.name!r}: settings must be a dataclass subclassing registry.Settings"
        )
    _consistent(part.kind, part.name, part.fields())
    _ENTRIES[part.kind].append(part)
    _KEYS.clear()
    return part


def register(
    kind: str,
    name: str,
    settings: type[Settings] = Settings,
    *,
    build: Callable[..., Any],
    help: str,
    encoders: Mapping[str, Callable[..., Any]] | None = None,
    facts: Mapping[str, Any] | None = None,
) -> Part:
    """Register the part a recipe names `name` in a section of `kind`, with its settings and builder; a name
    already registered for that kind is an error (unregister it first). `encoders` (poolings only): the
    encoders the pooling brings, by "side:encoder kind" (`pooling_encoder`). `facts`: what consumers need to
    know of the part (`FACTS[kind]` names them), read with `has_fact` / `fact`."""
    _check_kind(kind)
    _ensure_loaded()  # the built-in parts first, so a clash with one of them is found here
    if not name or not name.replace("_", "").replace("-", "").isalnum():
        raise RegistryError(f"{kind} name {name!r}: use letters, digits, _ and -")
    for p in _ENTRIES[kind]:
        if not p.shared and p.name == name:
            raise RegistryError(f"{kind} {name!r} is already registered (by {p.module}); unregister it first")
    if encoders and kind != "pooling":
        raise RegistryError(f"{kind} {name!r}: only a pooling brings its own encoders")
    for key in encoders or {}:
        side, _, encoder_kind = key.partition(":")
        if side not in ("image", "text") or not encoder_kind:
            raise RegistryError(
                f"pooling {name!r}: encoder key {key!r} must read 'image:KIND' or 'text:KIND'"
            )
    checked = _checked_facts(kind, name, facts or {})
    module = getattr(build, "__module__", "?") or "?"
    return _add(Part(kind, name, settings, build, help, module, encoders=dict(encoders or {}), facts=checked))


def _checked_facts(kind: str, name: str, facts: Mapping[str, Any]) -> dict[str, Any]:
    """`facts` as declared, each one `FACTS[kind]` knows, of its type."""
    known = FACTS[kind]
    for key, value in facts.items():
        if key not in known:
            choices = ", ".join(known) or "none"
            raise RegistryError(f"{kind} {name!r}: unknown fact {key!r}; a {kind} declares {choices}")
        tp = known[key][0]
        ok = callable(value) if tp == "callable" else isinstance(value, tp)  # type: ignore[arg-type]
        if tp is tuple:
            ok = ok and all(isinstance(v, str) for v in value)
        if not ok:
            want = "a function" if tp == "callable" else getattr(tp, "__name__", str(tp))
            raise RegistryError(f"{kind} {name!r}: fact {key!r} must be {want}, got {value!r}")
    return dict(facts)


def register_shared(kind: str, settings: type[Settings], *, help: str) -> Part:
    """Settings every part of `kind` reads (the trainer's or a wrapper's), checked whichever part is named."""
    _check_kind(kind)
    _ensure_loaded()
    if any(p.shared and p.settings is settings for p in _ENTRIES[kind]):
        raise RegistryError(f"{kind} shared settings {settings.__name__} are already registered")
    return _add(Part(kind, settings.__name__, settings, None, help, settings.__module__, shared=True))


def unregister(kind: str, name: str) -> None:
    """Remove a part (a test's, or one a notebook is redefining)."""
    _check_kind(kind)
    _ensure_loaded()
    for i, p in enumerate(_ENTRIES[kind]):
        if not p.shared and p.name == name:
            del _ENTRIES[kind][i]
            _KEYS.clear()
            return
    raise RegistryError(f"{kind} {name!r} is not registered")


def parts(kind: str) -> tuple[Part, ...]:
    """The parts of `kind` a recipe may name, in registration order."""
    _check_kind(kind)
    _ensure_loaded()
    return tuple(p for p in _ENTRIES[kind] if not p.shared)


def shared(kind: str) -> tuple[Part, ...]:
    _check_kind(kind)
    _ensure_loaded()
    return tuple(p for p in _ENTRIES[kind] if p.shared)


def names(kind: str) -> tuple[str, ...]:
    return tuple(p.name for p in parts(kind))


def get(kind: str, name: str) -> Part:
    """The part of `kind` called `name`; another name is a ValueError listing the choices."""
    for p in parts(kind):
        if p.name == name:
            return p
    raise ValueError(f"unknown {kind.replace('_', ' ')} {name!r}; choose one of {', '.join(names(kind))}")


def _fact_name(kind: str, fact_name: str) -> None:
    _check_kind(kind)
    if fact_name not in FACTS[kind]:
        raise RegistryError(
            f"a {kind} declares no fact {fact_name!r}; the facts are {', '.join(FACTS[kind])}"
        )


def part_facts(kind: str, name: str) -> Mapping[str, Any]:
    """The facts the part of `kind` called `name` declared (read-only); an unknown name is `get`'s ValueError."""
    return types.MappingProxyType(dict(get(kind, name).facts))


def fact(kind: str, name: str, fact_name: str, default: Any = None) -> Any:
    """The value of one fact of a part (`default` when the part does not declare it)."""
    _fact_name(kind, fact_name)
    return get(kind, name).facts.get(fact_name, default)


def has_fact(kind: str, name: str, fact_name: str) -> bool:
    """Whether the part of `kind` called `name` declares `fact_name` (true): what consumers ask instead of its
    name, e.g. `has_fact("image_encoder", recipe.model.image.kind, "reads_pixels")`."""
    return bool(fact(kind, name, fact_name))


def names_with(kind: str, fact_name: str) -> tuple[str, ...]:
    """The parts of `kind` that declare `fact_name`, in registration order (for messages listing them)."""
    _fact_name(kind, fact_name)
    return tuple(p.name for p in parts(kind) if p.facts.get(fact_name))


def pooling_encoder(side: str, encoder_kind: str, recipe: Any, spec: Any) -> Any:
    """The encoder that the pooling of `side` ("image" or "text") brings for `encoder_kind`, built for
    `recipe`, or None when it brings none (the encoder kind's own builder then builds it)."""
    pooling = recipe.model.image.pooling if side == "image" else recipe.model.text.pooling
    build = get("pooling", pooling.name).encoders.get(f"{side}:{encoder_kind}")
    return build(recipe, spec) if build is not None else None


def keys(kind: str) -> dict[str, Key]:
    """Every recipe key a section of `kind` takes (the union of its parts' settings), in declaration order."""
    _check_kind(kind)
    _ensure_loaded()
    if kind in _KEYS:
        return dict(_KEYS[kind])
    out: dict[str, Key] = {}
    for p in _ENTRIES[kind]:
        for key, (f, tp) in p.fields().items():
            if key in out:
                k = out[key]
                out[key] = Key(
                    k.field, k.type, k.parts + (() if p.shared else (p.name,)), k.shared or p.shared
                )
            else:
                out[key] = Key(f, tp, () if p.shared else (p.name,), p.shared)
    if not _STATE["loading"]:
        _KEYS[kind] = dict(out)
    return out
