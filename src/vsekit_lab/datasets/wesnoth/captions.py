"""Captions from the names in the data: the unit, its race, the action, the weapon, the outcome and the way the
sprite faces (the rules: `CAPTION_RULES`); the verb phrase per animation kind is the only hand-written glue."""

from __future__ import annotations

import re

from vsekit_lab.datasets.wesnoth.units import RawAnim, Unit, display_name

MAX_DESCRIPTION_WORDS = 60
ACTION_PHRASE = {  # WML animation kind -> verb phrase (the only hand-written words of a caption)
    "attack_anim": "attacking",
    "defend": "defending",
    "death": "dying",
    "idle_anim": "idling",
    "standing_anim": "standing",
    "movement_anim": "moving",
    "healing_anim": "healing a neighbour",
    "leading_anim": "leading troops",
    "recruit_anim": "being recruited",
    "recruiting_anim": "recruiting",
    "victory_anim": "celebrating victory",
    "draw_weapon_anim": "drawing its weapon",
    "sheath_weapon_anim": "sheathing its weapon",
    "pre_movement_anim": "starting to move",
    "post_movement_anim": "stopping",
    "teleport_anim": "teleporting",
    "healed_anim": "being healed",
    "poisoned_anim": "suffering from poison",
    "animation": "performing an action",
    "levelin_anim": "levelling up",
    "levelout_anim": "levelling up",
}
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


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


def facing_word(direction: str) -> str:
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


def outcome_word(hits: str) -> str:
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
        desc = display_name(attrs.get("description") or name).lower()
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
    outcome = outcome_word(anim.hits)
    if outcome:
        if kind == "defend":
            outcome = {"hit": "being hit", "miss": "being missed"}.get(outcome, "")
        else:
            outcome = {"hit": "hitting", "miss": "missing", "kill": "killing"}[outcome]
    tail = [
        x
        for x in (outcome, f"facing {facing_word(anim.direction)}" if facing_word(anim.direction) else "")
        if x
    ]
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
