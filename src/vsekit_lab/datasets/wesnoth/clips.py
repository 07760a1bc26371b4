"""Clips and splits: one clip per animation branch with at least two distinct frames on disk, duplicates kept
once, captioned; split by advancement family so that no unit line is in two splits."""

from __future__ import annotations

import hashlib
import logging
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path

from vsekit_lab.datasets.wesnoth.captions import action_caption, facing_word, outcome_word, short_description
from vsekit_lab.datasets.wesnoth.units import Clip, RawAnim, Unit

log = logging.getLogger(__name__)

SPLITS = ("train", "dev", "test")
TEST_FRACTION = 0.1
DEV_FRACTION = 0.1


def _resolve(name: str, roots: Sequence[Path]) -> Path | None:
    for root in roots:
        p = root / name
        if p.is_file():
            return p
    return None


def _clip_id(unit: str, anim: RawAnim) -> str:
    """'Spearman/attack/spear/s/hit' (unit[+variant]/kind/weapon or range/facing/outcome; '-' = none)."""
    who = unit + (f"+{anim.variant_id}" if anim.variant_id else "")
    kind = anim.kind.removesuffix("_anim")
    what = anim.weapon or anim.weapon_range or anim.defend_vs or "-"
    if anim.weapon and anim.weapon_type:
        what += f"({anim.weapon_type})"
    facing = {"north": "n", "south": "s", "north-east": "ne", "south-east": "se"}.get(
        facing_word(anim.direction), anim.direction.replace(",", "+") or "-"
    )
    return "/".join([who, kind, what.replace("/", "_"), facing, outcome_word(anim.hits) or "-"])


def make_clips(
    data_dir: Path, units: dict[str, Unit], anims: list[RawAnim], descriptions: bool = False
) -> tuple[list[Clip], dict[str, int]]:
    """Resolve frames, drop static/missing ones and duplicate sequences, caption; ids are unique."""
    stats: Counter[str] = Counter()
    seen: set[tuple] = set()
    ids: Counter[str] = Counter()
    clips: list[Clip] = []
    for anim in anims:
        unit = units[anim.unit]
        paths = [_resolve(f, anim.image_roots) for f in anim.frames]
        stats["frames_referenced"] += len(paths)
        stats["frames_missing"] += sum(p is None for p in paths)
        found = [p for p in paths if p is not None]
        if len(set(found)) < 2:
            stats["dropped_static_or_missing"] += 1
            continue
        key = (anim.unit, anim.variant_id, tuple(found))
        if key in seen:
            stats["dropped_duplicate_sequence"] += 1
            continue
        seen.add(key)
        captions = [action_caption(unit, anim)]
        if descriptions and unit.description:
            captions.append(short_description(unit.description))
        base = _clip_id(anim.unit, anim)
        ids[base] += 1
        clip_id = base if ids[base] == 1 else f"{base}#{ids[base]}"
        clips.append(
            Clip(
                id=clip_id,
                unit=anim.unit,
                variant=anim.variant_id,
                kind=anim.kind,
                weapon=anim.weapon or anim.defend_vs,
                direction=anim.direction,
                hits=anim.hits,
                name=anim.variant_name,
                race=unit.race,
                family="",
                source=unit.source,
                frames=[p.relative_to(data_dir).as_posix() for p in found],
                captions=captions,
            )
        )
    return clips, dict(stats)


def families(units: dict[str, Unit]) -> dict[str, str]:
    """unit id -> its advancement family (connected by advances_to), named by the family's smallest unit id."""
    parent = {u: u for u in units}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for uid, unit in units.items():
        for target in unit.advances_to:
            if target in parent:
                a, b = find(uid), find(target)
                if a != b:
                    parent[max(a, b)] = min(a, b)
    return {u: find(u) for u in units}


def assign_splits(
    clips: list[Clip],
    units: dict[str, Unit],
    test_fraction: float = TEST_FRACTION,
    dev_fraction: float = DEV_FRACTION,
) -> dict[str, list[Clip]]:
    """Whole families in md5(family name) order: test until `test_fraction` of the clips, then dev, then train."""
    family = families(units)
    by_family: dict[str, list[Clip]] = defaultdict(list)
    for c in clips:
        c.family = family[c.unit]
        by_family[c.family].append(c)
    total = len(clips)
    done = 0
    out: dict[str, list[Clip]] = {s: [] for s in SPLITS}
    for fam in sorted(by_family, key=lambda f: (hashlib.md5(f.encode()).hexdigest(), f)):
        split = (
            "test"
            if done < test_fraction * total
            else "dev"
            if done < (test_fraction + dev_fraction) * total
            else "train"
        )
        for c in by_family[fam]:
            c.split = split
        out[split] += by_family[fam]
        done += len(by_family[fam])
    return out


def drop_repeated_captions(splits: dict[str, list[Clip]], keep_all: bool = False) -> dict[str, int]:
    """In dev and test keep one clip per action caption (the first, in data order); returns the drops per split.

    The dropped clips are other takes of the same animation (the same unit, kind, weapon, facing and outcome,
    e.g. a thief's three random dodges): with the same caption they cannot be told apart by text, so a
    text-to-clip query would have several right answers and score as wrong on all but one. Train keeps them.
    """
    dropped = {}
    for split in ("dev", "test"):
        seen: set[str] = set()
        kept = []
        for c in splits[split]:
            if keep_all or c.captions[0] not in seen:
                kept.append(c)
                seen.add(c.captions[0])
        dropped[split] = len(splits[split]) - len(kept)
        splits[split] = kept
    return dropped
