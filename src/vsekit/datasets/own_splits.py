"""Which split each of users' own pictures goes to: a declared split's name (with its aliases), the one
split of a picture declared in several (the evaluation side), or a seeded split by picture (fractions or
counts)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from vsekit.datasets.own_items import SPLIT_CONFLICT, Problem
from vsekit.errors import VseInputError

SPLITS = ("train", "dev", "test")
SPLIT_ALIASES = {
    "train": "train",
    "training": "train",
    "restval": "train",
    "dev": "dev",
    "val": "dev",
    "valid": "dev",
    "validation": "dev",
    "test": "test",
    "testing": "test",
}
EVAL_ORDER = {"train": 0, "dev": 1, "test": 2}  # a picture declared in two splits goes to the later one


def resolve_split(declared: Sequence[tuple[str, str]], name: str) -> tuple[str | None, Problem | None]:
    """The one split of a picture declared (by `(source name, split)` pairs) maybe more than once: the
    evaluation side of a conflict (test, then dev), which is reported."""
    values = sorted({s for _, s in declared}, key=EVAL_ORDER.get)
    if len(values) <= 1:
        return (values[0] if values else None), None
    where = ", ".join(f"{n} ({s})" for n, s in declared)
    return values[-1], Problem(
        name, SPLIT_CONFLICT, f"declared in several splits: {where}; it goes to {values[-1]}"
    )


def split_name(value: str, where: str) -> str:
    """A declared split, with its aliases (val/validation -> dev, restval -> train); else an input error."""
    key = str(value).strip().lower()
    if key not in SPLIT_ALIASES:
        raise VseInputError(
            f"{where}: split {str(value)!r} is not train, dev or test (aliases: "
            f"{', '.join(k for k in SPLIT_ALIASES if k not in SPLITS)})"
        )
    return SPLIT_ALIASES[key]


def split_count(value: float, n: int, flag: str) -> int:
    """Pictures a split gets: a fraction in [0, 1) of n (at least 1 when above 0), or a whole count >= 1."""
    if not math.isfinite(value) or value < 0:
        raise VseInputError(f"{flag} must be a fraction in [0, 1) or a count, got {value}")
    if value < 1:
        return 0 if value == 0 else max(1, int(math.floor(value * n + 0.5)))
    if value != int(value):
        raise VseInputError(
            f"{flag} {value}: give a fraction below 1 (0.1) or a whole number of pictures (500)"
        )
    return int(value)


def assign_splits(ids: Sequence[str], dev: float, test: float, seed: int) -> dict[str, list[str]]:
    """Seeded split by picture: a permutation (from `seed`) of the sorted ids; test first, then dev."""
    ids = sorted(ids)
    n = len(ids)
    t, d = split_count(test, n, "--test"), split_count(dev, n, "--dev")
    if t + d >= n:
        raise VseInputError(
            f"{n} usable picture(s) cannot give {t} test and {d} dev pictures and keep one to "
            "train on; lower --dev / --test"
        )
    perm = np.random.default_rng(seed).permutation(n)
    return {
        "test": sorted(ids[i] for i in perm[:t]),
        "dev": sorted(ids[i] for i in perm[t : t + d]),
        "train": sorted(ids[i] for i in perm[t + d :]),
    }
