"""Unit types and their animation blocks, read from the `.cfg` files of the core data (and, when asked, the
campaigns): names, races, weapons, and each animation branch's frames, direction and outcome."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from vsekit.errors import SetupError, VseInputError
from vsekit_lab.datasets.wesnoth.wml import (
    Macro,
    Node,
    collect_macros,
    drop_ifdefs,
    expand,
    expand_image_value,
    parse_wml,
    remove_defines,
)

log = logging.getLogger(__name__)

ANIM_TAGS = frozenset(
    {
        "attack_anim",
        "defend",
        "death",
        "idle_anim",
        "standing_anim",
        "movement_anim",
        "healing_anim",
        "leading_anim",
        "recruit_anim",
        "recruiting_anim",
        "victory_anim",
        "levelin_anim",
        "levelout_anim",
        "draw_weapon_anim",
        "sheath_weapon_anim",
        "pre_movement_anim",
        "post_movement_anim",
        "healed_anim",
        "poisoned_anim",
        "teleport_anim",
        "animation",
        "resistance_anim",
        "selected_anim",
        "extra_anim",
    }
)


@dataclass
class Unit:
    id: str
    name: str
    race: str
    description: str
    advances_to: list[str]
    weapons: dict[str, list[dict[str, str]]]  # name -> the attributes of each [attack] of that name
    file: str  # relative to the data folder
    source: str  # "core" or the campaign folder name


@dataclass
class RawAnim:
    """One branch of one animation block, frames still as relative image names."""

    unit: str
    variant_id: str  # "" | "female" | a variation_id
    variant_name: str
    kind: str
    weapon: str
    weapon_range: str
    weapon_type: str  # [filter_attack] type=: one weapon name with two damage types (halberd blade / pierce)
    defend_vs: str
    direction: str
    hits: str
    frames: list[str]
    image_roots: list[Path]


@dataclass
class Clip:
    id: str
    unit: str
    variant: str
    kind: str
    weapon: str
    direction: str
    hits: str
    name: str
    race: str
    family: str
    source: str
    frames: list[str]  # relative to the data folder
    captions: list[str]
    split: str = ""


@dataclass
class UnitFile:
    path: Path
    macros: dict[str, Macro]  # campaign-level macros (core macros are shared)
    image_roots: list[Path]
    source: str


def display_name(name: str) -> str:
    """'female^Spearman' -> 'Spearman' (a translation context before ^)."""
    return name.split("^")[-1].strip()


def _unit_from(ut: Node, rel: str, source: str) -> Unit:
    a = ut.attrs
    weapons: dict[str, list[dict[str, str]]] = defaultdict(list)
    for attack in ut.kids("attack"):
        weapons[attack.attrs.get("name", "")].append(attack.attrs)
    advances = [x.strip() for x in a.get("advances_to", "").split(",") if x.strip() and x.strip() != "null"]
    return Unit(
        id=a["id"],
        name=display_name(a.get("name", a["id"])),
        race=a.get("race", ""),
        description=" ".join(a.get("description", "").split()),
        advances_to=advances,
        weapons=dict(weapons),
        file=rel,
        source=source,
    )


def frames_of(node: Node) -> list[str]:
    out: list[str] = []
    for frame in node.kids("frame"):
        if "image" in frame.attrs:
            out.extend(expand_image_value(frame.attrs["image"]))
    return out


def anim_branches(anim: Node) -> list[tuple[str, str, list[str]]]:
    """(direction, hits, frames) per [if]/[else] branch with frames, or the block itself when it has none."""
    base = frames_of(anim)
    out = []
    for branch in anim.children:
        if branch.tag not in ("if", "else"):
            continue
        own = frames_of(branch)
        if own:
            out.append(
                (
                    branch.attrs.get("direction", anim.attrs.get("direction", "")),
                    branch.attrs.get("hits", anim.attrs.get("hits", "")),
                    base + own,
                )
            )
    if out:
        return out
    return [(anim.attrs.get("direction", ""), anim.attrs.get("hits", ""), base)] if base else []


def _variant(parents: tuple[Node, ...], unit_name: str) -> tuple[str, str]:
    """(variant id, display name) of an animation nested in [female] or [variation]; ('', unit name) otherwise."""
    for p in parents:
        if p.tag == "female":
            return "female", "female " + display_name(p.attrs.get("name") or unit_name)
        if p.tag == "variation":
            vid = p.attrs.get("variation_id") or p.attrs.get("variation_name") or "variation"
            return vid, display_name(p.attrs.get("variation_name") or p.attrs.get("name") or vid)
    return "", unit_name


def unit_anims(ut: Node, unit: Unit, image_roots: list[Path]) -> list[RawAnim]:
    anims: list[RawAnim] = []
    for node, parents in ut.walk():
        if node.tag not in ANIM_TAGS:
            continue
        variant_id, variant_name = _variant(parents, unit.name)
        weapon = weapon_range = weapon_type = defend_vs = ""
        for f in node.kids("filter_attack"):
            weapon, weapon_range, weapon_type = (
                f.attrs.get("name", ""),
                f.attrs.get("range", ""),
                f.attrs.get("type", ""),
            )
        if not weapon and node.tag == "animation":
            weapon = node.attrs.get("flag", "")
        for f in node.kids("filter_second_attack"):
            defend_vs = f.attrs.get("range", "")
        for direction, hits, frames in anim_branches(node):
            anims.append(
                RawAnim(
                    unit.id,
                    variant_id,
                    variant_name,
                    node.tag,
                    weapon,
                    weapon_range,
                    weapon_type,
                    defend_vs,
                    direction,
                    hits,
                    frames,
                    image_roots,
                )
            )
    return anims


def _cfg_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.cfg") if p.is_file())


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise SetupError(f"{path}: cannot read ({e})") from None


def _macros_of(paths: Sequence[Path]) -> dict[str, Macro]:
    macros: dict[str, Macro] = {}
    for p in paths:
        macros.update(collect_macros(_read(p)))
    return macros


def unit_files(data_dir: Path, campaigns: bool) -> tuple[dict[str, Macro], list[UnitFile]]:
    """Core macros and the unit .cfg files: data/core/units, plus data/campaigns/*/units with `campaigns`."""
    core = data_dir / "core"
    units_dir = core / "units"
    if not units_dir.is_dir():
        raise VseInputError(f"{data_dir}: no core/units folder; this is not a Wesnoth data folder")
    core_cfgs = _cfg_files(core)
    macros = _macros_of([p for p in core_cfgs if units_dir not in p.parents])
    roots = [core / "images"]
    files = [UnitFile(p, {}, roots, "core") for p in core_cfgs if units_dir in p.parents]
    if campaigns and (data_dir / "campaigns").is_dir():
        for cdir in sorted(p for p in (data_dir / "campaigns").iterdir() if p.is_dir()):
            cfgs = _cfg_files(cdir)
            cm = _macros_of([p for p in cfgs if not {"units", "scenarios"} & set(p.relative_to(cdir).parts)])
            croots = [cdir / "images", *roots]
            files += [
                UnitFile(p, cm, croots, cdir.name) for p in cfgs if "units" in p.relative_to(cdir).parts
            ]
    return macros, files


def parse_units(data_dir: Path, campaigns: bool = False) -> tuple[dict[str, Unit], list[RawAnim]]:
    """Every [unit_type] (the first definition of an id wins) and its animation branches."""
    macros, files = unit_files(data_dir, campaigns)
    units: dict[str, Unit] = {}
    anims: list[RawAnim] = []
    for uf in files:
        raw = _read(uf.path)
        if "[unit_type]" not in raw:
            continue
        env = {**macros, **uf.macros, **collect_macros(raw)}
        tree = parse_wml(expand(drop_ifdefs(remove_defines(raw)), env))
        for ut in tree.kids("unit_type"):
            uid = ut.attrs.get("id", "")
            if not uid or uid in units:
                continue
            unit = _unit_from(ut, uf.path.relative_to(data_dir).as_posix(), uf.source)
            units[uid] = unit
            anims += unit_anims(ut, unit, uf.image_roots)
    log.info("%d unit types, %d animation branches from %d unit files", len(units), len(anims), len(files))
    return units, anims
