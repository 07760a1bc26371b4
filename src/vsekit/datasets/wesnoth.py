"""A real, offline video–text set from Battle for Wesnoth unit animations (docs/wesnoth.md).

Source: the Debian package `wesnoth-1.16-data` (GPL-2.0-or-later). Every unit type's `.cfg` file describes
its animations in WML ([attack_anim], [defend], [death], [idle_anim], ...) as sequences of sprite frames
(`image="units/human-loyalists/spearman-attack-s-[1~14].png:[100*14]"`). One clip = one animation block of
one unit type, one [if]/[else] branch (direction, hit or miss); its frames are the sprites, composited on a
fixed grey background, and each frame becomes one 1280-d EfficientNet-Lite0 vector (the 7x7 grid averaged).

Pipeline:
1. find the data: `source` (an extracted package root, the `data` folder itself, or a `.deb`), else an
   installed `/usr/share/games/wesnoth/*/data`, else `apt-get download wesnoth-1.16-data` into a cache folder;
2. parse: a small WML preprocessor (#define/#enddef macros with #arg defaults, {MACRO args}, #ifdef treated
   as "not defined"), a WML tag/attribute parser, image-path expansion (`x-[1~4,3].png`, `[a,b]`, `*n`);
3. clips: one per animation branch with at least 2 distinct frames found on disk; identical frame sequences of
   one unit (variant) kept once; captions from real names in the data (see `CAPTION_RULES`);
4. split by advancement family (`advances_to`, connected components) in a fixed md5 order: test takes families
   until 10 % of the clips, dev the next 10 %, train the rest, so no unit line is in two splits;
5. render + features (each distinct sprite once, batched), write the frames layout (`vsekit.data.frames`),
   `{split}_caps.txt`, `_cap2img.txt`, `_ids.txt`, `_clips.jsonl`, `manifest.json`, README.md and the licence.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from collections import Counter, defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Protocol

import numpy as np
from PIL import Image

from vsekit.errors import SetupError, VseInputError
from vsekit.utils.io import prepare_dataset_dir

log = logging.getLogger(__name__)

FORMAT = "vsekit-wesnoth/1"
PACKAGE = "wesnoth-1.16-data"
LICENSE = "GPL-2.0-or-later"
INSTALLED_GLOB = "/usr/share/games/wesnoth/*/data"
SPLITS = ("train", "dev", "test")
SPLIT_FILES = ("_frames.npy", "_frame_offsets.npy", "_caps.txt", "_cap2img.txt", "_ids.txt", "_clips.jsonl")
EXTRA_FILES = ("manifest.json", "README.md", "COPYING.txt", "debian-copyright.txt")
TEST_FRACTION = 0.1
DEV_FRACTION = 0.1
BACKGROUND = (128, 128, 128)  # neutral grey behind the transparent sprites
CANVAS = 112  # native sprite pixels around the hex centre: a 72 px unit keeps its size relative to a dragon
IMAGE_SIZE = 224  # the canvas upscaled x2 (nearest: pixel art stays sharp) for the CNN
MAX_DESCRIPTION_WORDS = 60
MAX_MACRO_DEPTH = 25

ANIM_TAGS = frozenset({
    "attack_anim", "defend", "death", "idle_anim", "standing_anim", "movement_anim", "healing_anim",
    "leading_anim", "recruit_anim", "recruiting_anim", "victory_anim", "levelin_anim", "levelout_anim",
    "draw_weapon_anim", "sheath_weapon_anim", "pre_movement_anim", "post_movement_anim", "healed_anim",
    "poisoned_anim", "teleport_anim", "animation", "resistance_anim", "selected_anim", "extra_anim",
})  # fmt: skip
ACTION_PHRASE = {  # WML animation kind -> verb phrase (the only hand-written words of a caption)
    "attack_anim": "attacking", "defend": "defending", "death": "dying", "idle_anim": "idling",
    "standing_anim": "standing", "movement_anim": "moving", "healing_anim": "healing a neighbour",
    "leading_anim": "leading troops", "recruit_anim": "being recruited", "recruiting_anim": "recruiting",
    "victory_anim": "celebrating victory", "draw_weapon_anim": "drawing its weapon",
    "sheath_weapon_anim": "sheathing its weapon", "pre_movement_anim": "starting to move",
    "post_movement_anim": "stopping", "teleport_anim": "teleporting", "healed_anim": "being healed",
    "poisoned_anim": "suffering from poison", "animation": "performing an action",
    "levelin_anim": "levelling up", "levelout_anim": "levelling up",
}  # fmt: skip
RACE_WORD = {"bats": "bat"}  # race ids that are plural; every other race id is used as it is

CAPTION_RULES = [
    "One caption per clip by default: '<a|an> <unit name> [(<race>)] <action>[ with its <weapon> (<range> <type> "
    "attack)][ against a <range> attack][, hitting|missing|killing|being hit|being missed][, facing <way>]'.",
    "Unit name, race, weapon name/range/type, the animation kind, hits= and direction= all come from the unit's "
    ".cfg file; the verb phrase per animation kind (ACTION_PHRASE) is the only hand-written glue.",
    "The race is left out when the unit name already contains it ('drake burner', 'vampire bat').",
    "Facing from direction=: s -> south, se/sw -> south-east (the game mirrors the se sprite for sw; the file is "
    "rendered as it is), a mix of s and se/sw -> south; north alike; a north/south mix or none adds nothing.",
    "With descriptions=True a second caption is the unit's own description (help text), cut to whole sentences "
    f"within {MAX_DESCRIPTION_WORDS} words (at least the first sentence). It is shared by every clip of the unit, "
    "so text-to-clip retrieval with it is ambiguous by construction; it is off by default.",
    "Clips whose action caption is still identical to another clip's (other takes of one animation, e.g. a "
    "thief's three random dodges) are kept in train; dev and test keep the first take only (all_takes=True "
    "keeps them all), so every action caption of an evaluation split names exactly one clip.",
]


# --------------------------------------------------------------------------------------------- preprocessor

DIRECTIVES = ("#define", "#enddef", "#arg", "#endarg", "#ifdef", "#ifndef", "#else", "#endif", "#textdomain",
              "#undef", "#ifver", "#ifhave", "#ifnhave", "#ifnver")  # fmt: skip
DEFINE_RE = re.compile(r"^\s*#define\s+(\S+)(.*)$")
ARG_RE = re.compile(r"^\s*#arg\s+(\S+)")
NAMED_ARG_RE = re.compile(r"^([A-Z_][A-Z0-9_]*)=(.*)$", re.S)


@dataclass(frozen=True)
class Macro:
    params: tuple[str, ...]
    defaults: dict[str, str]
    body: str


def strip_comment(line: str) -> str:
    """Remove a `#` comment outside double quotes; preprocessor directives are kept whole."""
    if line.lstrip().startswith(DIRECTIVES):
        return line
    quoted = False
    for i, c in enumerate(line):
        if c == '"':
            quoted = not quoted
        elif c == "#" and not quoted:
            return line[:i]
    return line


def collect_macros(text: str) -> dict[str, Macro]:
    """Every `#define NAME PARAMS ... #enddef` of a file, with `#arg NAME ... #endarg` defaults."""
    macros: dict[str, Macro] = {}
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        m = DEFINE_RE.match(lines[i])
        i += 1
        if not m:
            continue
        name, params = m.group(1), tuple(m.group(2).split("#")[0].split())
        body: list[str] = []
        defaults: dict[str, str] = {}
        while i < len(lines) and not lines[i].strip().startswith("#enddef"):
            line = lines[i]
            if "#enddef" in line:  # body text and #enddef on one line
                body.append(line.split("#enddef")[0])
                break
            am = ARG_RE.match(line)
            if am:
                value: list[str] = []
                i += 1
                while i < len(lines) and not lines[i].strip().startswith("#endarg"):
                    value.append(lines[i])
                    i += 1
                defaults[am.group(1)] = "\n".join(value)
            else:
                body.append(strip_comment(line))
            i += 1
        macros[name] = Macro(params, defaults, "\n".join(body))
        i += 1
    return macros


def remove_defines(text: str) -> str:
    return re.sub(r"(?ms)^\s*#define\b.*?#enddef[^\n]*$", "", text)


def drop_ifdefs(text: str) -> str:
    """Keep the branches taken when no preprocessor symbol is defined; drop every directive line."""
    out: list[str] = []
    stack: list[bool] = []
    for line in text.splitlines():
        s = line.strip()
        if s.startswith(("#ifdef", "#ifhave", "#ifver")):
            stack.append(False)
        elif s.startswith(("#ifndef", "#ifnhave", "#ifnver")):
            stack.append(True)
        elif s.startswith("#else") and stack:
            stack[-1] = not stack[-1]
        elif s.startswith("#endif") and stack:
            stack.pop()
        elif s.startswith("#"):
            continue
        elif all(stack):
            out.append(line)
    return "\n".join(out)


def _balanced_end(s: str, start: int) -> int:
    """Index of the `}` closing the `{` at `start` (or len(s) when unbalanced)."""
    depth = 0
    for k in range(start, len(s)):
        if s[k] == "{":
            depth += 1
        elif s[k] == "}":
            depth -= 1
            if depth == 0:
                return k
    return len(s)


def split_args(call: str) -> list[str]:
    """`NAME a (b c) "d e" {X y}` -> ['NAME', 'a', 'b c', '"d e"', '{X y}']."""
    args: list[str] = []
    cur: list[str] = []
    depth, quoted, i = 0, False, 0
    while i < len(call):
        c = call[i]
        if c == '"':
            quoted = not quoted
            cur.append(c)
        elif quoted:
            cur.append(c)
        elif c == "(":
            if depth > 0:
                cur.append(c)
            depth += 1
        elif c == ")":
            depth -= 1
            if depth > 0:
                cur.append(c)
            elif depth == 0:
                args.append("".join(cur))
                cur = []
        elif c == "{":
            end = _balanced_end(call, i)
            cur.append(call[i : end + 1])
            i = end
        elif c.isspace() and depth == 0:
            if cur:
                args.append("".join(cur))
                cur = []
        else:
            cur.append(c)
        i += 1
    if cur:
        args.append("".join(cur))
    return args


def expand(text: str, macros: dict[str, Macro], depth: int = 0) -> str:
    """Substitute `{MACRO args}` calls recursively; unknown macros and file includes are dropped."""
    if depth > MAX_MACRO_DEPTH:
        return text
    out: list[str] = []
    i = 0
    while (j := text.find("{", i)) >= 0:
        out.append(text[i:j])
        k = _balanced_end(text, j)
        i = k + 1
        parts = split_args(text[j + 1 : k])
        if not parts or parts[0] not in macros:
            continue
        macro = macros[parts[0]]
        env = dict(macro.defaults)
        positional: list[str] = []
        for arg in parts[1:]:
            m = NAMED_ARG_RE.match(arg)
            if m:
                env[m.group(1)] = m.group(2)
            else:
                positional.append(arg)
        env.update(zip(macro.params, positional))
        body = drop_ifdefs(macro.body)
        for name in sorted(env, key=len, reverse=True):
            body = body.replace("{" + name + "}", env[name])
        out.append(expand(body, macros, depth + 1))
    out.append(text[i:])
    return "".join(out)


# --------------------------------------------------------------------------------------------- WML


@dataclass
class Node:
    tag: str
    attrs: dict[str, str] = field(default_factory=dict)
    children: list[Node] = field(default_factory=list)

    def kids(self, tag: str) -> list[Node]:
        return [c for c in self.children if c.tag == tag]

    def walk(self, parents: tuple[Node, ...] = ()) -> Iterator[tuple[Node, tuple[Node, ...]]]:
        yield self, parents
        for c in self.children:
            yield from c.walk(parents + (self,))


TAG_RE = re.compile(r"^\s*\[(/?)([+a-z_0-9]+)\]\s*$")
TAG_SPLIT_RE = re.compile(r"(\[/?[+a-z_0-9]+\])")


def clean_value(value: str) -> str:
    """A WML value without translation marks, quotes and `"a" + "b"` concatenation."""
    v = value.strip()
    v = re.sub(r'(^|[\s+])_\s*(?=")', r"\1", v)
    v = re.sub(r'"\s*\+\s*"', "", v)
    return v.replace('""', "\x00").replace('"', "").replace("\x00", '"').strip()


def parse_wml(text: str) -> Node:
    """Preprocessed WML -> a tree of tags with their attributes (later values of a key win)."""
    root = Node("root")
    stack = [root]
    lines = [strip_comment(line) for line in text.splitlines()]
    i = 0
    while i < len(lines):
        line = lines[i]
        i += 1
        for piece in TAG_SPLIT_RE.split(line):
            if not piece.strip():
                continue
            m = TAG_RE.match(piece)
            if m:
                if m.group(1):
                    if len(stack) > 1:
                        stack.pop()
                else:
                    node = Node(m.group(2).lstrip("+"))
                    stack[-1].children.append(node)
                    stack.append(node)
                continue
            if "=" not in piece:
                continue
            key, value = piece.split("=", 1)
            while value.count('"') % 2 == 1 and i < len(lines):  # a quoted value over several lines
                value += "\n" + lines[i]
                i += 1
            while value.rstrip().endswith("+") and i < len(lines):  # `"a" +` continued on the next line
                value = value.rstrip() + " " + lines[i].strip()
                i += 1
            stack[-1].attrs[key.strip()] = clean_value(value)
    return root


# --------------------------------------------------------------------------------------------- image paths

IMAGE_ENTRY_RE = re.compile(r"^(.*?\.(?:png|jpg|webp|PNG))(~[^:]*)?(?::.*)?$")


def split_top(s: str, sep: str = ",") -> list[str]:
    """Split on `sep` outside [] and ()."""
    out: list[str] = []
    cur: list[str] = []
    depth = 0
    for c in s:
        if c in "[(":
            depth += 1
        elif c in "])":
            depth -= 1
        if c == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    out.append("".join(cur))
    return out


def expand_list(body: str) -> list[str]:
    """'1~4,3' -> ['1','2','3','4','3']; '01~03' keeps the zero padding; 'x*2' -> ['x','x']; '4~2' counts down."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        repeat = 1
        m = re.match(r"^(.*)\*(\d+)$", item)
        if m:
            item, repeat = m.group(1), int(m.group(2))
        m = re.match(r"^(\d+)~(\d+)$", item)
        if m:
            a, b = int(m.group(1)), int(m.group(2))
            width = len(m.group(1)) if m.group(1).startswith("0") else 0
            values = [str(x).zfill(width) for x in (range(a, b + 1) if a <= b else range(a, b - 1, -1))]
        else:
            values = [item]
        out.extend(values * repeat)
    return out


def expand_image_value(value: str) -> list[str]:
    """The image paths of one `image=` value: `a.png,b-[1~3].png:[100*3]` -> a.png, b-1.png, b-2.png, b-3.png.

    Durations (`:100`) and image-path functions (`~RC(...)`) are dropped; several bracket groups in one path
    advance together (the shorter list repeats its last value).
    """
    frames: list[str] = []
    for entry in split_top(value, ","):
        entry = entry.strip()
        if not entry:
            continue
        m = IMAGE_ENTRY_RE.match(entry)
        path = m.group(1) if m else entry.split(":")[0]
        groups = re.findall(r"\[([^\]]*)\]", path)
        if not groups:
            frames.append(path)
            continue
        lists = [expand_list(g) for g in groups]
        for k in range(max(len(v) for v in lists)):
            p = path
            for g, values in zip(groups, lists):
                p = p.replace("[" + g + "]", values[min(k, len(values) - 1)], 1)
            frames.append(p)
    return frames


# --------------------------------------------------------------------------------------------- units


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


def _display_name(name: str) -> str:
    """'female^Spearman' -> 'Spearman' (a translation context before ^)."""
    return name.split("^")[-1].strip()


def _unit_from(ut: Node, rel: str, source: str) -> Unit:
    a = ut.attrs
    weapons: dict[str, list[dict[str, str]]] = defaultdict(list)
    for attack in ut.kids("attack"):
        weapons[attack.attrs.get("name", "")].append(attack.attrs)
    advances = [x.strip() for x in a.get("advances_to", "").split(",") if x.strip() and x.strip() != "null"]
    return Unit(id=a["id"], name=_display_name(a.get("name", a["id"])), race=a.get("race", ""),
                description=" ".join(a.get("description", "").split()), advances_to=advances,
                weapons=dict(weapons), file=rel, source=source)  # fmt: skip


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
            out.append((branch.attrs.get("direction", anim.attrs.get("direction", "")),
                        branch.attrs.get("hits", anim.attrs.get("hits", "")), base + own))  # fmt: skip
    if out:
        return out
    return [(anim.attrs.get("direction", ""), anim.attrs.get("hits", ""), base)] if base else []


def _variant(parents: tuple[Node, ...], unit_name: str) -> tuple[str, str]:
    """(variant id, display name) of an animation nested in [female] or [variation]; ('', unit name) otherwise."""
    for p in parents:
        if p.tag == "female":
            return "female", "female " + _display_name(p.attrs.get("name") or unit_name)
        if p.tag == "variation":
            vid = p.attrs.get("variation_id") or p.attrs.get("variation_name") or "variation"
            return vid, _display_name(p.attrs.get("variation_name") or p.attrs.get("name") or vid)
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
            anims.append(RawAnim(unit.id, variant_id, variant_name, node.tag, weapon, weapon_range, weapon_type,
                                 defend_vs, direction, hits, frames, image_roots))  # fmt: skip
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


# --------------------------------------------------------------------------------------------- captions


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def _facing(direction: str) -> str:
    """The way the (unmirrored) sprite faces: 'south' for s, 'south-east' for se/sw (the sw sprite is the se
    one mirrored by the game; we render the file as it is), 'south' for a mix of both; north alike."""
    dirs = {d.strip() for d in direction.split(",") if d.strip()}
    for pole in ("north", "south"):
        p = pole[0]
        if dirs and dirs <= {p + "e", p + "w"}:
            return pole + "-east"
        if dirs and all(d.startswith(p) for d in dirs):
            return pole
    return ""


def _hits(hits: str) -> str:
    """'hit' | 'miss' | 'kill' | '' from a hits= value (yes/no/hit/miss/kill lists)."""
    values = {h.strip() for h in hits.split(",")}
    if values & {"yes", "hit"}:
        return "hit"
    if values & {"no", "miss"}:
        return "miss"
    return "kill" if "kill" in values else ""


def _weapon_attrs(unit: Unit, name: str, wrange: str, wtype: str) -> dict[str, str]:
    """The [attack] of that name matching the filter's range/type (the first when several match)."""
    attacks = unit.weapons.get(name, [])
    for a in attacks:
        if (not wrange or a.get("range") == wrange) and (not wtype or a.get("type") in wtype.split(",")):
            return a
    return attacks[0] if attacks else {}


def _weapon_phrase(unit: Unit, anim: RawAnim) -> str:
    names = [w.strip() for w in anim.weapon.split(",") if w.strip()]
    parts = []
    for name in names:
        attrs = _weapon_attrs(unit, name, anim.weapon_range, anim.weapon_type)
        desc = _display_name(attrs.get("description") or name).lower()
        kind = " ".join(x for x in (attrs.get("range", ""), attrs.get("type", "")) if x)
        parts.append(f"{desc} ({kind} attack)" if kind else desc)
    return " or ".join(parts)


def action_caption(unit: Unit, anim: RawAnim) -> str:
    """The templated caption around the real names of the data (CAPTION_RULES)."""
    name = anim.variant_name.lower()
    race = RACE_WORD.get(unit.race, unit.race).lower()
    who = f"{_article(name)} {name}"
    if race and race not in name:
        who += f" ({race})"
    kind = anim.kind
    phrase = ACTION_PHRASE.get(kind, kind.removesuffix("_anim").replace("_", " "))
    if kind == "attack_anim" and anim.weapon:
        phrase += f" with its {_weapon_phrase(unit, anim)}"
    elif kind == "defend":  # the range of the exchange: the attacker's weapon, else the defender's own
        vs = anim.defend_vs or anim.weapon_range
        phrase += f" against a {vs} attack" if vs else " against a blow"
    outcome = _hits(anim.hits)
    if outcome:
        if kind == "defend":
            outcome = {"hit": "being hit", "miss": "being missed"}.get(outcome, "")
        else:
            outcome = {"hit": "hitting", "miss": "missing", "kill": "killing"}[outcome]
    tail = [x for x in (outcome, f"facing {_facing(anim.direction)}" if _facing(anim.direction) else "") if x]
    return ", ".join([f"{who} {phrase}", *tail])


def short_description(text: str, max_words: int = MAX_DESCRIPTION_WORDS) -> str:
    """Whole sentences of `text` within `max_words` words (at least the first sentence)."""
    sentences = re.split(r"(?<=[.!?])\s+", " ".join(text.split()))
    out: list[str] = []
    for s in sentences:
        if out and len(" ".join([*out, s]).split()) > max_words:
            break
        out.append(s)
    return " ".join(out)


# --------------------------------------------------------------------------------------------- clips


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
        _facing(anim.direction), anim.direction.replace(",", "+") or "-"
    )
    return "/".join([who, kind, what.replace("/", "_"), facing, _hits(anim.hits) or "-"])


def make_clips(data_dir: Path, units: dict[str, Unit], anims: list[RawAnim],
               descriptions: bool = False) -> tuple[list[Clip], dict[str, int]]:  # fmt: skip
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
        clips.append(Clip(id=clip_id, unit=anim.unit, variant=anim.variant_id, kind=anim.kind,
                          weapon=anim.weapon or anim.defend_vs, direction=anim.direction, hits=anim.hits,
                          name=anim.variant_name, race=unit.race, family="", source=unit.source,
                          frames=[p.relative_to(data_dir).as_posix() for p in found],
                          captions=captions))  # fmt: skip
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


def assign_splits(clips: list[Clip], units: dict[str, Unit],
                  test_fraction: float = TEST_FRACTION, dev_fraction: float = DEV_FRACTION) -> dict[str, list[Clip]]:  # fmt: skip
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


# --------------------------------------------------------------------------------------------- frames


def render_frame(path: Path, background: tuple[int, int, int] = BACKGROUND, canvas: int = CANVAS,
                 size: int = IMAGE_SIZE) -> Image.Image:  # fmt: skip
    """The sprite centred on a `canvas`-pixel grey square (shrunk only if larger), then upscaled to `size`."""
    try:
        with Image.open(path) as im:
            sprite = im.convert("RGBA")
    except (OSError, ValueError) as e:
        raise VseInputError(f"{path}: cannot read the sprite ({e})") from None
    if max(sprite.size) > canvas:
        scale = canvas / max(sprite.size)
        sprite = sprite.resize((max(1, round(sprite.width * scale)), max(1, round(sprite.height * scale))),
                               Image.Resampling.LANCZOS)  # fmt: skip
    bg = Image.new("RGBA", (canvas, canvas), (*background, 255))
    bg.alpha_composite(sprite, ((canvas - sprite.width) // 2, (canvas - sprite.height) // 2))
    return bg.convert("RGB").resize((size, size), Image.Resampling.NEAREST)


class FrameExtractor(Protocol):
    def __call__(self, frames: list[Image.Image]) -> np.ndarray: ...  # (n, D) float

    def describe(self) -> dict: ...


class EfficientNetFrameMean:
    """EfficientNet-Lite0 grid at 224 px (7x7 x 1280), averaged over the grid: one 1280-d vector a frame."""

    def __init__(self, batch_size: int = 16) -> None:
        from vsekit.features.efficientnet import GridFeatureExtractor

        self.extractor = GridFeatureExtractor(image_size=IMAGE_SIZE)
        self.batch_size = batch_size

    def __call__(self, frames: list[Image.Image]) -> np.ndarray:
        import torch

        from vsekit.features.efficientnet import preprocess_image

        batch = torch.stack([preprocess_image(f, IMAGE_SIZE) for f in frames])
        return self.extractor(batch).mean(dim=1).float().cpu().numpy()

    def describe(self) -> dict:
        spec = self.extractor.describe()
        spec.update(name="efficientnet_lite0_grid_mean", regions=1, grid_pooling="mean over the 7x7 grid cells",
                    preprocess="the rendered 224 px RGB frame (frame_render), ImageNet mean/std",
                    dtype="float16", frame_render=f"RGBA sprite centred on a {CANVAS} px RGB{BACKGROUND} square "
                    f"(shrunk to fit if larger), nearest-neighbour upscaled to {IMAGE_SIZE} px")  # fmt: skip
        return spec


def extract_frames(paths: list[Path], extract: FrameExtractor, batch_size: int = 16,
                   progress: bool = True) -> np.ndarray:  # fmt: skip
    """One feature row per sprite path, in order (rendered and extracted in batches)."""
    from vsekit.utils.progress import progress_bar

    rows: list[np.ndarray] = []
    bar = progress_bar(total=len(paths), desc="wesnoth frames", unit="frame", enabled=progress)
    for start in range(0, len(paths), batch_size):
        chunk = paths[start : start + batch_size]
        feats = np.asarray(extract([render_frame(p) for p in chunk]), dtype=np.float32)
        if feats.ndim != 2 or feats.shape[0] != len(chunk):
            raise VseInputError(f"the frame extractor returned shape {feats.shape} for {len(chunk)} frames")
        rows.append(feats)
        bar.update(len(chunk))
    bar.close()
    return np.concatenate(rows)


# --------------------------------------------------------------------------------------------- source


@dataclass
class Source:
    data_dir: Path
    origin: str  # "deb" | "folder" | "installed" | "apt-get download"
    package: str | None = None
    version: str | None = None
    deb: str | None = None
    deb_sha256: str | None = None
    package_root: Path | None = None  # the extracted package root (for its copyright file)


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vsekit" / "wesnoth"


def _run(cmd: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=1800)
    except FileNotFoundError:
        raise SetupError(f"`{cmd[0]}` is not installed; it is needed for `{' '.join(cmd)}`") from None
    except subprocess.TimeoutExpired:
        raise SetupError(f"`{' '.join(cmd)}` did not finish within 30 minutes") from None


def _data_dir_in(root: Path) -> Path | None:
    """`root` itself when it is a Wesnoth `data` folder, else the newest `usr/share/games/wesnoth/*/data` in it."""
    if (root / "core" / "units").is_dir():
        return root
    found = sorted(Path(p) for p in glob.glob(str(root / "usr/share/games/wesnoth/*/data")))
    found = [p for p in found if (p / "core" / "units").is_dir()]
    return found[-1] if found else None


def _version_dir(data_dir: Path) -> str | None:
    """'1.16' from .../wesnoth/1.16/data."""
    return data_dir.parent.name if data_dir.parent.parent.name == "wesnoth" else None


def _package_root(data_dir: Path) -> Path | None:
    parts = data_dir.parts
    if len(parts) >= 6 and parts[-6:-2] == ("usr", "share", "games", "wesnoth"):
        return Path(*parts[:-6]) if len(parts) > 6 else Path("/")
    return None


def extract_deb(deb: Path, cache_dir: Path) -> Source:
    """Extract a .deb (`dpkg-deb -x`) into `cache_dir/<sha256 prefix>`, once; its data folder and provenance."""
    from vsekit.utils.io import sha256_file

    if not deb.is_file():
        raise VseInputError(f"{deb}: no such .deb file")
    sha = sha256_file(deb)
    info = _run(["dpkg-deb", "-f", str(deb), "Package", "Version"])
    if info.returncode != 0:
        raise SetupError(f"{deb}: not a readable .deb (dpkg-deb -f: {info.stderr.strip()[-300:]})")
    fields = dict(line.split(": ", 1) for line in info.stdout.splitlines() if ": " in line)
    target = cache_dir / f"{fields.get('Package', 'deb')}-{sha[:16]}"
    if not (target / ".complete").is_file():
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=cache_dir))
        log.info("extracting %s into %s", deb, target)
        r = _run(["dpkg-deb", "-x", str(deb), str(tmp)])
        if r.returncode != 0:
            shutil.rmtree(tmp, ignore_errors=True)
            raise SetupError(f"{deb}: `dpkg-deb -x` failed (exit {r.returncode}): {r.stderr.strip()[-300:]}")
        (tmp / ".complete").write_text(sha + "\n")
        shutil.rmtree(target, ignore_errors=True)
        tmp.rename(target)
    data_dir = _data_dir_in(target)
    if data_dir is None:
        raise VseInputError(f"{deb}: holds no usr/share/games/wesnoth/*/data/core/units; is it {PACKAGE}?")
    return Source(data_dir, "deb", fields.get("Package"), fields.get("Version"), str(deb), sha, target)


def download_deb(cache_dir: Path, package: str = PACKAGE) -> Path:
    """`apt-get download PACKAGE` into `cache_dir` (reusing a .deb already there)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    have = sorted(cache_dir.glob(f"{package}_*.deb"))
    if have:
        return have[-1]
    log.info("downloading %s with apt-get into %s", package, cache_dir)
    r = _run(["apt-get", "download", package], cwd=cache_dir)
    have = sorted(cache_dir.glob(f"{package}_*.deb"))
    if r.returncode != 0 or not have:
        raise SetupError(
            f"`apt-get download {package}` in {cache_dir} failed (exit {r.returncode}): "
            f"{(r.stderr or r.stdout).strip()[-300:]}\nFix: run `sudo apt-get update` and retry; or install the "
            f"game data (`sudo apt-get install {package}`); or fetch the .deb elsewhere and pass it with "
            f"--source path/to/{package}_*.deb (an extracted package root or its data folder works too)"
        )
    return have[-1]


def _installed_version(version_dir: str | None) -> tuple[str | None, str | None]:
    package = f"wesnoth-{version_dir}-data" if version_dir else None
    if package is None or shutil.which("dpkg-query") is None:
        return package, None
    r = _run(["dpkg-query", "-W", "-f=${Version}", package])
    return package, (r.stdout.strip() or None) if r.returncode == 0 else None


def locate_source(source: str | Path | None = None, cache_dir: str | Path | None = None) -> Source:
    """The Wesnoth data folder: `source` (.deb, package root or data folder), else installed, else apt-get."""
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if source is not None:
        src = Path(source)
        if src.is_file():
            return extract_deb(src, cache)
        if not src.is_dir():
            raise VseInputError(
                f"{src}: --source must be a {PACKAGE} .deb, an extracted package root or its data folder"
            )
        data_dir = _data_dir_in(src)
        if data_dir is None:
            raise VseInputError(
                f"{src}: no Wesnoth data here (neither core/units nor usr/share/games/wesnoth/*/data)"
            )
        ver = _version_dir(data_dir)
        return Source(data_dir, "folder", f"wesnoth-{ver}-data" if ver else None, ver,
                      package_root=_package_root(data_dir))  # fmt: skip
    installed = sorted(p for p in glob.glob(INSTALLED_GLOB) if (Path(p) / "core" / "units").is_dir())
    if installed:
        data_dir = Path(installed[-1])
        package, version = _installed_version(_version_dir(data_dir))
        return Source(data_dir, "installed", package, version, package_root=Path("/"))
    src = extract_deb(download_deb(cache), cache)
    src.origin = "apt-get download"
    return src


# --------------------------------------------------------------------------------------------- build


def prepare_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty folder unless `overwrite`; then remove only the files a Wesnoth build writes."""
    prepare_dataset_dir(out, overwrite, SPLITS, SPLIT_FILES, EXTRA_FILES)
    out.mkdir(parents=True, exist_ok=True)


def _ambiguous(captions: list[str]) -> int:
    """Captions whose exact text is also another clip's caption in the same split."""
    counts = Counter(captions)
    return sum(n for n in counts.values() if n > 1)


def _stats(clips: list[Clip]) -> dict:
    lengths = [len(c.frames) for c in clips]
    caps = [cap for c in clips for cap in c.captions]
    words = Counter(w for cap in caps for w in re.findall(r"[a-z']+", cap.lower()))
    return {
        "clips": len(clips), "units": len({c.unit for c in clips}), "families": len({c.family for c in clips}),
        "frames": sum(lengths), "frames_per_clip": [min(lengths), statistics.median(lengths), max(lengths)],
        "captions": len(caps), "distinct_captions": len(set(caps)), "ambiguous_captions": _ambiguous(caps),
        "vocabulary": len(words),
    }  # fmt: skip


def _readme(manifest: dict) -> str:
    src = manifest["source"]
    return (
        "# Battle for Wesnoth unit animations: a video–text retrieval set (vsekit)\n\n"
        f"Built by `vse data wesnoth` (vsekit, {FORMAT}); see docs/wesnoth.md in vsekit.\n\n"
        f"Source: Debian package `{src.get('package')}` version `{src.get('version')}`"
        + (f", .deb sha256 `{src['deb_sha256']}`" if src.get("deb_sha256") else "")
        + ".\n\n"
        "Licence: the sprites and unit descriptions are part of Battle for Wesnoth, copyright the Battle for "
        "Wesnoth project and its contributors (https://www.wesnoth.org), released under the GNU General Public "
        f"License version 2 or later ({LICENSE}); COPYING.txt is the licence text shipped with the data"
        " and debian-copyright.txt the package's copyright file (when found). The frame features and captions "
        "here are derived from that data and are distributed under the same licence.\n\n"
        "Files per split: `_frames.npy` (frames x 1280, float16, EfficientNet-Lite0 grid mean), "
        "`_frame_offsets.npy` (clips + 1), `_caps.txt`, `_cap2img.txt` (clip row per caption), `_ids.txt`, "
        "`_clips.jsonl` (unit, animation, weapon, direction, hits, sprite paths, captions).\n"
    )


def build_wesnoth(
    out_dir: str | Path,
    source: str | Path | None = None,
    campaigns: bool = False,
    descriptions: bool = False,
    all_takes: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    extractor: FrameExtractor | None = None,
    cache_dir: str | Path | None = None,
    batch_size: int = 16,
) -> dict:
    """Build the set in `out_dir`; returns the manifest. `extractor` replaces the CNN (tests).

    `descriptions`: add the unit description as a second caption; `all_takes`: keep in dev/test the clips whose
    action caption repeats another clip's (dropped by default, see `drop_repeated_captions`).
    """
    from vsekit.data.frames import write_frames
    from vsekit.utils.io import atomic_write_json, atomic_write_text

    out = Path(out_dir)
    prepare_out_dir(out, overwrite)  # before any heavy work: a refused --out costs nothing
    src = locate_source(source, cache_dir)
    log.info("Wesnoth data: %s (%s)", src.data_dir, src.origin)
    units, anims = parse_units(src.data_dir, campaigns)
    clips, clip_stats = make_clips(src.data_dir, units, anims, descriptions)
    if not clips:
        raise VseInputError(f"{src.data_dir}: no animation with at least 2 distinct frames found")
    splits = assign_splits(clips, units)
    repeated = drop_repeated_captions(splits, keep_all=all_takes)
    clips = [c for split in SPLITS for c in splits[split]]
    extract = extractor if extractor is not None else EfficientNetFrameMean(batch_size)
    distinct = sorted({f for c in clips for f in c.frames})
    feats = extract_frames([src.data_dir / f for f in distinct], extract, batch_size, progress)
    row = {f: i for i, f in enumerate(distinct)}
    split_stats: dict[str, dict] = {}
    for split in SPLITS:
        members = splits[split]
        if not members:
            raise VseInputError(f"{split}: no clips (only {len(clips)} clips in {len({c.family for c in clips})} "
                                "families); the split needs more unit families")  # fmt: skip
        write_frames(out, split, [feats[[row[f] for f in c.frames]] for c in members], dtype=np.float16)
        caps = [(cap, i) for i, c in enumerate(members) for cap in c.captions]
        atomic_write_text(out / f"{split}_caps.txt", "".join(cap + "\n" for cap, _ in caps))
        atomic_write_text(out / f"{split}_cap2img.txt", "".join(f"{i}\n" for _, i in caps))
        atomic_write_text(out / f"{split}_ids.txt", "".join(c.id + "\n" for c in members))
        atomic_write_text(out / f"{split}_clips.jsonl",
                          "".join(json.dumps(asdict(c), ensure_ascii=False) + "\n" for c in members))  # fmt: skip
        split_stats[split] = _stats(members)
        log.info("%s: %s", split, split_stats[split])
    manifest = {
        "format": FORMAT,
        "name": "wesnoth",
        "source": {
            "origin": src.origin,
            "package": src.package,
            "version": src.version,
            "deb": src.deb,
            "deb_sha256": src.deb_sha256,
            "data_dir": str(src.data_dir),
        },  # fmt: skip
        "license": LICENSE,
        "attribution": "Battle for Wesnoth, copyright the Battle for Wesnoth project and contributors, "
        "https://www.wesnoth.org",
        "build": {
            "campaigns": campaigns,
            "descriptions": descriptions,
            "all_takes": all_takes,
            "test_fraction": TEST_FRACTION,
            "dev_fraction": DEV_FRACTION,
            "split_rule": "advancement families (advances_to) in md5(family) "
            "order: test until 10% of the clips, dev until 20%, train the rest",
        },  # fmt: skip
        "counts": {
            "unit_types": len(units),
            "animation_branches": len(anims),
            **clip_stats,
            "dropped_repeated_caption": repeated,
            "distinct_sprites": len(distinct),
            **_stats(clips),
        },  # fmt: skip
        "splits": split_stats,
        "caption_rules": CAPTION_RULES,
        "features": extract.describe(),
    }
    atomic_write_json(out / "manifest.json", manifest, ensure_ascii=False)
    atomic_write_text(out / "README.md", _readme(manifest))
    copying = src.data_dir / "COPYING.txt"
    if copying.is_file():
        shutil.copyfile(copying, out / "COPYING.txt")
    if src.package_root is not None and src.package:
        debian = src.package_root / "usr/share/doc" / src.package / "copyright"
        if debian.is_file():
            shutil.copyfile(debian, out / "debian-copyright.txt")
    return manifest


__all__ = ["build_wesnoth", "parse_units", "make_clips", "assign_splits", "drop_repeated_captions", "families", "action_caption",
           "expand_image_value", "expand", "collect_macros", "parse_wml", "locate_source", "render_frame",
           "EfficientNetFrameMean", "CAPTION_RULES"]  # fmt: skip
