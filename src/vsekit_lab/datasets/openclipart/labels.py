"""Labels and captions: duplicates merged into one drawing, a distinctive title or a readable file-name stem
as its label, and up to three captions from its real metadata (the rules: `CAPTION_RULES`)."""

from __future__ import annotations

import os
import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from vsekit_lab.datasets.openclipart.text import MAX_WORDS, cap_words, fix_text, norm_text, text_key

MAX_KEYWORDS = 8
MAX_SHARE = 3  # a title / label / description used by more than this many drawings is not distinctive
ID_LEN = 12

# Collection names used as the title of whole icon themes / series; they describe no single picture.
GENERIC_TITLE_PATTERNS = [
    r"^$",
    r"^gramastar$",
    r"^part of the .*collection\b",
    r"^lemon svg theme$",
    r"^svg gradient collection\b",
    r"^card$",
    r"^aiga symbol signs$",
    r"^various cliparts$",
    r"^etiquette icons$",
    r"[- ]theme$",
    r"\biconset$",
    r"^icons?$",
    r"^untitled\b",
]
# Generic collections whose file names are serial numbers or colour swatches, not picture labels: never renamed.
DROP_TITLE_PATTERNS = [r"^gramastar$", r"^svg gradient collection\b", r"^card$"]
JUNK_KEYWORDS = re.compile(
    r"^(?:hash|hash\(0x[0-9a-f]+\)|0x[0-9a-f]+|unsorted|none|null)$|\btheme\b|https?:|@", re.I
)
JUNK_TEXT = re.compile(r"https?://|www\.|\S+@\S+\.\w+|hash\(0x", re.I)
CLIPART_BY = re.compile(r"^clipart by [^-]+? - (.+)$", re.I)

CAPTION_RULES = [
    "All text comes from the SVG's Dublin Core metadata (dc:title, dc:description, dc:subject keywords) "
    "or, for generic collection titles only, from the file name; nothing is written by hand or generated.",
    "Text normalisation: HTML entities decoded ('W&uuml;rttemberg'), UTF-8 read as Latin-1 repaired "
    "('LÃ©zard' -> 'Lézard'), control characters removed; underscores in titles/keywords/file stems become "
    f"spaces; whitespace (incl. newlines) collapses to one space; every caption keeps its first {MAX_WORDS} words.",
    "Duplicates (same md5 of the SVG with <metadata> removed, filed in several folders) become one image: "
    "title = a non-generic title among the copies (most frequent, then longest), description = the longest "
    "usable one, keywords = union in file order, categories = all folders.",
    "A title is generic when it matches a collection pattern (empty, gramastar, 'Part of the ... Collection', "
    "'Lemon SVG theme', 'SVG Gradient Collection', 'card', 'AIGA_Symbol_Signs', 'Various Cliparts', "
    f"'Etiquette Icons', '...-theme', '... iconset', 'icon(s)', 'untitled') or is shared by more than {MAX_SHARE} "
    "unique drawings (e.g. 'stick man' x23, 'Clipart by Nicu Buculei - jigsaw_red_10' x48).",
    "'Clipart by <author> - <label>' titles that are not shared become '<label>'.",
    "Generic title -> the drawing is renamed from its file stem when the stem is readable, otherwise dropped. "
    "Readable stem: split on non-letters and camelCase; trailing digits stripped from tokens; dropped tokens: "
    "one letter, two-letter codes not in the vocabulary, words of the creator's name after the first token "
    "(author suffixes such as '_linda_kim_r'), a leading collection prefix taken from the generic title "
    "('aiga'); every other token must have no digits and appear in the vocabulary of the set's own metadata "
    "(words of non-generic titles, usable descriptions and keywords). gramastar stars, gradient swatches and "
    f"playing cards are always dropped. A renamed label shared by more than {MAX_SHARE} drawings is dropped too.",
    "Captions, in this order, the missing ones skipped: (1) the label (cleaned title, or readable file stem); "
    "(2) the description, when usable: no URL / e-mail / 'HASH(0x..)', at least 2 words, not equal to or "
    f"contained in the label (case and punctuation ignored), not boilerplate shared by more than {MAX_SHARE} "
    f"drawings; (3) '<label> (k1, k2, ...)' with up to {MAX_KEYWORDS} keywords whose words are not all in the "
    "label, when at least one is left.",
    "Keywords drop 'hash', 'HASH(0x..)', '0x..', URLs, e-mails, mojibake, 'unsorted', empty entries, the "
    "creator's name and collection tags containing 'theme' ('lemon_theme_icon'); duplicates (case-insensitive) "
    "are merged.",
    "Captions of one image are de-duplicated (case-insensitive) and stored consecutively.",
]


@dataclass
class Drawing:
    """One unique picture (possibly filed in several folders) and its text."""

    id: str
    md5: str
    files: list[str]
    titles: list[str]
    creator: str
    license: str
    title: str = ""
    description: str = ""
    keywords: list[str] = field(default_factory=list)
    label: str = ""
    label_source: str = ""  # "title" | "file_stem"
    captions: list[str] = field(default_factory=list)

    @property
    def categories(self) -> list[str]:
        return sorted({os.path.dirname(f) for f in self.files})

    @property
    def stem(self) -> str:
        return Path(self.files[0]).stem


def _clean_title(title: str) -> str:
    return norm_text(title.replace("_", " "))


def _is_generic_pattern(title: str, patterns: list[str] = GENERIC_TITLE_PATTERNS) -> bool:
    t = _clean_title(title).casefold()
    return any(re.search(p, t) for p in patterns)


def _clean_keywords(keywords: Iterable[str | None], creator: str) -> list[str]:
    out, seen = [], set()
    creator_key = text_key(creator)
    for k in keywords:
        if any(unicodedata.category(ch) == "Cc" for ch in fix_text(k or "")):
            continue  # mojibake such as 'ã\x82âº'
        k = norm_text((k or "").replace("_", " "))
        if (
            not k
            or JUNK_KEYWORDS.search(k)
            or not re.search(r"[^\W\d_]", k)
            or (creator_key and text_key(k) == creator_key)
        ):
            continue
        if text_key(k) in seen:
            continue
        seen.add(text_key(k))
        out.append(k)
    return out


def _usable_description(desc: str) -> bool:
    return bool(desc) and not JUNK_TEXT.search(desc) and len(desc.split()) >= 2


def merge_duplicates(parsed: dict[str, dict]) -> tuple[list[Drawing], int]:
    """Group files by content md5; returns the unique drawings (sorted by id) and the duplicate-file count."""
    groups: dict[str, list[str]] = {}
    for rel in sorted(parsed):
        groups.setdefault(parsed[rel]["md5"], []).append(rel)
    drawings = []
    for md5, files in groups.items():
        metas = [parsed[f] for f in files]
        titles = [_clean_title(m["title"]) for m in metas]
        counts = Counter(titles)
        # prefer a non-generic title, then the most frequent among copies, then the longest, then alphabetical
        title = min(titles, key=lambda t: (_is_generic_pattern(t), -counts[t], -len(t), t))
        descs = [norm_text(m["description"]) for m in metas]
        usable = [d for d in descs if _usable_description(d)]
        description = max(usable, key=lambda d: (len(d), d)) if usable else ""
        creator = next((m["creator"] for m in metas if m["creator"]), "")
        keywords = _clean_keywords((k for m in metas for k in m["keywords"]), creator)
        licence = next((m.get("license", "") for m in metas if m.get("license")), "")
        drawings.append(
            Drawing(
                id=md5[:ID_LEN],
                md5=md5,
                files=files,
                titles=titles,
                creator=creator,
                license=licence,
                title=title,
                description=description,
                keywords=keywords,
            )
        )
    if len({d.id for d in drawings}) != len(drawings):
        raise RuntimeError("md5 prefix collision in drawing ids; increase ID_LEN")
    return sorted(drawings, key=lambda d: d.id), len(parsed) - len(drawings)


def _words(text: str) -> list[str]:
    return re.findall(r"[a-z]+", text.casefold())


def stem_label(stem: str, creator: str, vocab: set[str], generic_title: str = "") -> str | None:
    """A label made of the file stem's real words, or None when the stem is not readable (never guessed)."""
    spaced = re.sub(r"([a-z])([A-Z])", r"\1 \2", stem)
    tokens = [t for t in re.split(r"[^A-Za-z0-9]+", spaced) if t]
    name_words = _words(creator)
    prefix_words = set(_words(generic_title))
    out: list[str] = []
    for i, tok in enumerate(tokens):
        t = tok.lower().rstrip("0123456789")
        if not t:
            continue
        if any(ch.isdigit() for ch in t):
            return None
        if len(t) == 1:
            continue
        if i > 0 and len(t) >= 2 and any(w.startswith(t) for w in name_words):
            continue  # author suffix, often truncated ("..._architetto_francesc_04")
        if t in vocab:
            out.append(t)
            continue
        if len(t) == 2 or (i == 0 and t in prefix_words):
            continue  # variant code ("_aa", "-md") or collection prefix ("aiga_")
        return None
    if not any(len(t) >= 3 for t in out):
        return None
    return " ".join(out)


def assign_labels(drawings: list[Drawing]) -> tuple[list[Drawing], Counter]:
    """Pick each drawing's label and captions; drop those without distinctive real text (see CAPTION_RULES)."""
    stats: Counter = Counter()
    title_share = Counter(d.title.casefold() for d in drawings)
    generic = {
        d.id: _is_generic_pattern(d.title) or title_share[d.title.casefold()] > MAX_SHARE for d in drawings
    }
    stats["generic_titles"] = sum(generic.values())
    vocab: set[str] = set()
    for d in drawings:
        if not generic[d.id]:
            vocab.update(_words(d.title))
        vocab.update(_words(d.description))
        for k in d.keywords:
            vocab.update(_words(k))
    labelled: list[Drawing] = []
    for d in drawings:
        if not generic[d.id]:
            m = CLIPART_BY.match(d.title)
            d.label, d.label_source = cap_words(m.group(1) if m else d.title), "title"
            labelled.append(d)
            continue
        if _is_generic_pattern(d.title, DROP_TITLE_PATTERNS):
            stats["generic_dropped_collection"] += 1
            continue
        label = stem_label(d.stem, d.creator, vocab, d.title)
        if label is None:
            stats["generic_dropped_unreadable_stem"] += 1
            continue
        d.label, d.label_source = cap_words(label), "file_stem"
        labelled.append(d)
    label_share = Counter(d.label.casefold() for d in labelled)
    kept = []
    for d in labelled:
        if d.label_source == "file_stem" and label_share[d.label.casefold()] > MAX_SHARE:
            stats["generic_dropped_ambiguous_stem"] += 1
            continue
        kept.append(d)
    stats["renamed_from_file_stem"] = sum(d.label_source == "file_stem" for d in kept)
    stats["generic_dropped"] = sum(v for k, v in stats.items() if k.startswith("generic_dropped_"))
    desc_share = Counter(text_key(d.description) for d in kept if d.description)
    for d in kept:
        d.captions = make_captions(d, desc_share)
    return kept, stats


def make_captions(d: Drawing, desc_share: Counter | None = None) -> list[str]:
    """Caption 1 = label; 2 = usable description; 3 = label + keywords (rules in CAPTION_RULES)."""
    caps = [d.label]
    desc = d.description
    if desc and _usable_description(desc):
        dk, lk = text_key(desc), text_key(d.label)
        shared = desc_share is not None and desc_share[dk] > MAX_SHARE
        if dk and dk != lk and dk not in lk and not shared:
            caps.append(cap_words(desc))
    label_words = set(_words(d.label))
    extra = [k for k in d.keywords if not set(_words(k)) <= label_words][:MAX_KEYWORDS]
    if extra:
        caps.append(cap_words(f"{d.label} ({', '.join(extra)})"))
    out, seen = [], set()
    for c in caps:
        c = norm_text(c)
        if c and c.casefold() not in seen:
            seen.add(c.casefold())
            out.append(c)
    return out
