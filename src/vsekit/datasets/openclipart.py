"""Build a small, real image-text retrieval set from Debian's `openclipart-svg` (public-domain clip art).

Why this set: it installs offline from the distribution mirror, carries real human-written text
(Dublin Core title / description / keywords inside every SVG), and renders to clean 224 px pictures.
The output is the SCAN "precomp" layout with vsekit's variable-captions extension (`{split}_cap2img.txt`),
which `vsekit.data.precomp` reads.

Pipeline (each stage cached under `out_dir/.cache`, so a re-run is fast and an interrupted run resumes):
1. parse every SVG (whole document with ElementTree) -> title, description, keywords, creator;
2. de-duplicate identical drawings filed in several category folders (md5 of the SVG minus <metadata>);
3. label: a distinctive title, else a readable file-name stem, else drop (see `CAPTION_RULES`);
4. rasterise (cairosvg, fallback rsvg-convert) at 512 px, crop to content, pad square, 224 px PNG;
5. seeded split by image; EfficientNet-Lite0 grid features (49 x 1280, fp16); manifest with sha256s.
"""

from __future__ import annotations

import hashlib
import html
import io
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import signal
import subprocess
import threading
import time
import unicodedata
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vsekit.errors import SetupError
from vsekit.utils.io import (
    atomic_path,
    atomic_save_npy,
    atomic_write_bytes,
    atomic_write_json,
    atomic_write_text,
    sha256_file,
)
from vsekit.utils.progress import progress_bar

log = logging.getLogger(__name__)

DEFAULT_SVG_ROOT = "/usr/share/openclipart/svg"
PACKAGE = "openclipart-svg"
FORMAT = "vsekit-precomp/1"
SPLITS = ("train", "dev", "test")
CACHE_VERSION = 2  # metadata cache: bump when parsing or text repair changes
RENDER_VERSION = (
    "cairosvg512-crop-pad5-224-v1"  # part of the feature-cache key: change it when rendering changes
)
RENDER_SIZE = 512
IMAGE_SIZE = 224
MARGIN = 0.05
RENDER_TIMEOUT_S = 30
MAX_WORDS = 40
MAX_KEYWORDS = 8
MAX_SHARE = 3  # a title / label / description used by more than this many drawings is not distinctive
EVAL_FRACTION_CAP = 0.4  # test + dev never take more than this share of the images (small `limit` builds)
ID_LEN = 12

NS = {
    "dc": "http://purl.org/dc/elements/1.1/",
    "rdf": "http://www.w3.org/1999/02/22-rdf-syntax-ns#",
}
CC_NAMESPACES = ("http://web.resource.org/cc/", "http://creativecommons.org/ns#")
RDF_RESOURCE = f"{{{NS['rdf']}}}resource"
METADATA_RE = re.compile(rb"<(?:[\w.-]+:)?metadata\b(?:[^>]*/>|.*?</(?:[\w.-]+:)?metadata\s*>)", re.S)

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


# --------------------------------------------------------------------------------------------- helpers


def _fix_text(text: str) -> str:
    """Undo the two encoding accidents found in the metadata: HTML entities ('Baden-W&uuml;rttemberg',
    sometimes twice) and UTF-8 read as Latin-1 ('LÃ©zard'). Repairs only; never changes real words."""
    for _ in range(2):
        if "&" not in text:
            break
        text = html.unescape(text)
    if "Ã" in text or "Â" in text:
        try:
            text = text.encode("latin-1").decode("utf-8")
        except (UnicodeEncodeError, UnicodeDecodeError):
            pass
    return text


def _norm(text: str | None) -> str:
    text = _fix_text(text or "")
    return " ".join("".join(" " if unicodedata.category(ch) == "Cc" else ch for ch in text).split())


def _cap_words(text: str, n: int = MAX_WORDS) -> str:
    words = text.split()
    return " ".join(words[:n])


def _key(text: str) -> str:
    """Comparison key: case and punctuation ignored."""
    return " ".join(re.findall(r"[^\W_]+", text.casefold()))


def _bar(progress: bool, **kw):
    return progress_bar(enabled=progress, **kw)


# --------------------------------------------------------------------------------------------- source


def ensure_svg_root(svg_root: str | Path) -> Path:
    """The SVG folder; installs the Debian package when the default folder is missing and we are root."""
    root = Path(svg_root)
    if root.is_dir():
        return root
    if root != Path(DEFAULT_SVG_ROOT):
        raise FileNotFoundError(
            f"{root}: no such folder (svg_root must be a folder of openclipart .svg files)"
        )
    cmd = f"sudo apt-get update && sudo apt-get install -y {PACKAGE}"
    if hasattr(os, "geteuid") and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        log.warning("%s is missing; installing the Debian package %s", root, PACKAGE)
        rc = subprocess.run(["apt-get", "install", "-y", PACKAGE], env=env).returncode
        if rc != 0:  # stale or empty package lists: refresh once and retry
            subprocess.run(["apt-get", "update"], env=env)
            rc = subprocess.run(["apt-get", "install", "-y", PACKAGE], env=env).returncode
        if rc == 0 and root.is_dir():
            return root
        raise SetupError(f"`apt-get install -y {PACKAGE}` failed (exit {rc}); {root} is still missing")
    raise FileNotFoundError(f"{root} is missing; install the clip art with: {cmd}")


def find_svgs(root: Path) -> tuple[list[str], int]:
    """Sorted relative paths of regular .svg files, and the number of symlinked ones skipped (aliases)."""
    paths, links = [], 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in filenames:
            if not name.lower().endswith(".svg"):
                continue
            full = os.path.join(dirpath, name)
            if os.path.islink(full):
                links += 1
                continue
            if os.path.isfile(full):
                paths.append(os.path.relpath(full, root))
    return sorted(paths), links


def package_version(package: str = PACKAGE) -> str | None:
    try:
        r = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout.strip() or None if r.returncode == 0 else None


# --------------------------------------------------------------------------------------------- metadata


class SvgMetadataError(ValueError):
    """An SVG that cannot be used: malformed XML or no Dublin Core metadata."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "malformed" | "no_metadata"


def _text(el: ET.Element | None) -> str:
    return _norm("".join(el.itertext())) if el is not None else ""


def parse_svg_metadata(raw: bytes) -> dict:
    """Title, description, keywords, creator, licence and content md5 of one SVG document.

    The md5 covers the SVG with its <metadata> removed, so the same drawing filed twice with edited
    metadata still counts as one picture.
    """
    try:
        root = ET.fromstring(raw)
    except ET.ParseError as e:
        raise SvgMetadataError("malformed", f"malformed XML: {e}") from None
    if not root.tag.endswith("svg"):
        raise SvgMetadataError("malformed", f"root element is {root.tag!r}, not svg")
    md5 = hashlib.md5(METADATA_RE.sub(b"", raw)).hexdigest()
    work = None
    for cc in CC_NAMESPACES:
        work = root.find(f".//{{{cc}}}Work")
        if work is not None:
            break
    if work is None:
        raise SvgMetadataError("no_metadata", "no <metadata> with a cc:Work (Dublin Core) block")
    title = _text(work.find("dc:title", NS))
    description = _text(work.find("dc:description", NS))
    creator = _text(work.find("dc:creator", NS))
    subject = work.find("dc:subject", NS)
    keywords: list[str] = []
    if subject is not None:
        items = subject.findall(".//rdf:li", NS)
        keywords = [_text(li) for li in items] if items else [k for k in _text(subject).split(",")]
    licence = ""
    for cc in CC_NAMESPACES:
        lic = work.find(f"{{{cc}}}license")
        if lic is not None:
            licence = lic.get(RDF_RESOURCE, "") or _text(lic)
            break
    return {"md5": md5, "title": title, "description": description, "keywords": keywords,
            "creator": creator, "license": licence}  # fmt: skip


def parse_all(root: Path, rel_paths: list[str], cache_file: Path, progress: bool = True) -> tuple[dict, dict]:
    """Parse every SVG, reusing cached results for files whose size and mtime did not change.

    Returns (ok: relpath -> metadata, errors: relpath -> {"kind", "message"}).
    """
    cache: dict = {}
    if cache_file.is_file():
        try:
            data = json.loads(cache_file.read_text(encoding="utf-8"))
            if data.get("version") == CACHE_VERSION and data.get("root") == str(root.resolve()):
                cache = data.get("entries", {})
        except (OSError, ValueError):
            log.warning("%s: unreadable metadata cache, re-parsing", cache_file)
    entries: dict = {}
    ok: dict = {}
    errors: dict = {}
    changed = False
    for rel in _bar(progress, iterable=rel_paths, desc="parse svg", unit="file"):
        st = (root / rel).stat()
        stamp = [st.st_size, st.st_mtime_ns]
        entry = cache.get(rel)
        if entry is None or entry.get("stamp") != stamp:
            try:
                entry = {"stamp": stamp, "meta": parse_svg_metadata((root / rel).read_bytes())}
            except SvgMetadataError as e:
                entry = {"stamp": stamp, "error": {"kind": e.kind, "message": str(e)}}
            except OSError as e:
                entry = {"stamp": stamp, "error": {"kind": "malformed", "message": f"unreadable: {e}"}}
            changed = True
        entries[rel] = entry
        if "error" in entry:
            errors[rel] = entry["error"]
            log.warning("skipping %s: %s", rel, entry["error"]["message"])
        else:
            ok[rel] = entry["meta"]
    if changed or set(cache) != set(entries):
        atomic_write_json(
            cache_file,
            {"version": CACHE_VERSION, "root": str(root.resolve()), "entries": entries},
            ensure_ascii=False,
        )
    return ok, errors


# --------------------------------------------------------------------------------------------- labels


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
    return _norm(title.replace("_", " "))


def _is_generic_pattern(title: str, patterns: list[str] = GENERIC_TITLE_PATTERNS) -> bool:
    t = _clean_title(title).casefold()
    return any(re.search(p, t) for p in patterns)


def _clean_keywords(keywords: Iterable[str | None], creator: str) -> list[str]:
    out, seen = [], set()
    creator_key = _key(creator)
    for k in keywords:
        if any(unicodedata.category(ch) == "Cc" for ch in _fix_text(k or "")):
            continue  # mojibake such as 'ã\x82âº'
        k = _norm((k or "").replace("_", " "))
        if (
            not k
            or JUNK_KEYWORDS.search(k)
            or not re.search(r"[^\W\d_]", k)
            or (creator_key and _key(k) == creator_key)
        ):
            continue
        if _key(k) in seen:
            continue
        seen.add(_key(k))
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
        descs = [_norm(m["description"]) for m in metas]
        usable = [d for d in descs if _usable_description(d)]
        description = max(usable, key=lambda d: (len(d), d)) if usable else ""
        creator = next((m["creator"] for m in metas if m["creator"]), "")
        keywords = _clean_keywords((k for m in metas for k in m["keywords"]), creator)
        licence = next((m.get("license", "") for m in metas if m.get("license")), "")
        drawings.append(Drawing(id=md5[:ID_LEN], md5=md5, files=files, titles=titles, creator=creator,
                                license=licence, title=title, description=description, keywords=keywords))  # fmt: skip
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
            d.label, d.label_source = _cap_words(m.group(1) if m else d.title), "title"
            labelled.append(d)
            continue
        if _is_generic_pattern(d.title, DROP_TITLE_PATTERNS):
            stats["generic_dropped_collection"] += 1
            continue
        label = stem_label(d.stem, d.creator, vocab, d.title)
        if label is None:
            stats["generic_dropped_unreadable_stem"] += 1
            continue
        d.label, d.label_source = _cap_words(label), "file_stem"
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
    desc_share = Counter(_key(d.description) for d in kept if d.description)
    for d in kept:
        d.captions = make_captions(d, desc_share)
    return kept, stats


def make_captions(d: Drawing, desc_share: Counter | None = None) -> list[str]:
    """Caption 1 = label; 2 = usable description; 3 = label + keywords (rules in CAPTION_RULES)."""
    caps = [d.label]
    desc = d.description
    if desc and _usable_description(desc):
        dk, lk = _key(desc), _key(d.label)
        shared = desc_share is not None and desc_share[dk] > MAX_SHARE
        if dk and dk != lk and dk not in lk and not shared:
            caps.append(_cap_words(desc))
    label_words = set(_words(d.label))
    extra = [k for k in d.keywords if not set(_words(k)) <= label_words][:MAX_KEYWORDS]
    if extra:
        caps.append(_cap_words(f"{d.label} ({', '.join(extra)})"))
    out, seen = [], set()
    for c in caps:
        c = _norm(c)
        if c and c.casefold() not in seen:
            seen.add(c.casefold())
            out.append(c)
    return out


# --------------------------------------------------------------------------------------------- rendering


class _RenderTimeout(Exception):
    pass


def _on_alarm(signum, frame):  # pragma: no cover - only under a real timeout
    raise _RenderTimeout()


def render_svg(path: str, size: int = RENDER_SIZE, timeout: int = RENDER_TIMEOUT_S):
    """RGBA PIL image of the SVG fitted into size x size (aspect kept); cairosvg, else rsvg-convert."""
    from PIL import Image

    errors = []
    try:
        import cairosvg
    except ImportError:
        cairosvg = None
    if cairosvg is not None:
        use_alarm = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGALRM")
        old = signal.signal(signal.SIGALRM, _on_alarm) if use_alarm else None
        if use_alarm:
            signal.alarm(timeout)
        try:
            png = cairosvg.svg2png(url=path, output_width=size, output_height=size)
            img = Image.open(io.BytesIO(png))
            img.load()
            return img.convert("RGBA")
        except _RenderTimeout:
            errors.append(f"cairosvg: timeout after {timeout}s")
        except Exception as e:  # cairosvg raises many types on odd SVGs
            errors.append(f"cairosvg: {type(e).__name__}: {str(e)[:200]}")
        finally:
            if use_alarm:
                signal.alarm(0)
                signal.signal(signal.SIGALRM, old)
    exe = shutil.which("rsvg-convert")
    if exe:
        try:
            r = subprocess.run([exe, "-a", "-w", str(size), "-h", str(size), path], capture_output=True,
                               timeout=timeout)  # fmt: skip
            if r.returncode == 0 and r.stdout:
                img = Image.open(io.BytesIO(r.stdout))
                img.load()
                return img.convert("RGBA")
            errors.append(f"rsvg-convert: exit {r.returncode}: {r.stderr.decode(errors='replace')[:200]}")
        except subprocess.TimeoutExpired:
            errors.append(f"rsvg-convert: timeout after {timeout}s")
        except Exception as e:
            errors.append(f"rsvg-convert: {type(e).__name__}: {e}")
    if cairosvg is None and not exe:
        errors.append("no rasteriser: pip install cairosvg (or apt-get install librsvg2-bin)")
    raise RuntimeError("; ".join(errors))


def crop_square(img, out_size: int = IMAGE_SIZE, margin: float = MARGIN, min_pixels: int = 64):
    """Crop to the non-white, non-transparent content, pad to a square with a margin, resize.

    Many drawings sit in a corner of an A4 page, so without the crop the picture would be a speck.
    Returns None for a blank render (nothing drawn, e.g. gradient swatches cairo cannot paint).
    """
    from PIL import Image

    rgba = img.convert("RGBA")
    flat = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba).convert("RGB")
    arr = np.asarray(flat)
    mask = (255 - arr.astype(np.int16)).max(axis=2) > 10
    if int(mask.sum()) < min_pixels:
        return None
    rows, cols = np.nonzero(mask.any(axis=1))[0], np.nonzero(mask.any(axis=0))[0]
    top, bottom, left, right = rows[0], rows[-1] + 1, cols[0], cols[-1] + 1
    crop = flat.crop((int(left), int(top), int(right), int(bottom)))
    side = max(crop.size)
    pad = int(round(side * margin))
    canvas = Image.new("RGB", (side + 2 * pad, side + 2 * pad), (255, 255, 255))
    canvas.paste(crop, (pad + (side - crop.size[0]) // 2, pad + (side - crop.size[1]) // 2))
    return canvas.resize((out_size, out_size), Image.Resampling.LANCZOS)


def _render_job(job: tuple[str, str, str]) -> tuple[str, str, str]:
    """Worker: (id, svg path, png path) -> (id, "ok" | "blank" | "failed", detail)."""
    ident, svg, png = job
    try:
        img = render_svg(svg)
    except Exception as e:
        return ident, "failed", str(e)
    try:
        out = crop_square(img)
        if out is None:
            return ident, "blank", "nothing drawn"
        buf = io.BytesIO()
        out.save(buf, format="PNG", optimize=False)
        atomic_write_bytes(Path(png), buf.getvalue(), fsync=False)
    except Exception as e:
        return ident, "failed", f"{type(e).__name__}: {e}"
    return ident, "ok", ""


def render_all(jobs: list[tuple[str, str, str]], workers: int, progress: bool,
               on_result: Callable[[str, str, str], None]) -> None:  # fmt: skip
    """Render in `workers` processes (spawned: safe when torch threads exist in the parent)."""
    if not jobs:
        return
    bar = _bar(progress, total=len(jobs), desc="render", unit="img")
    try:
        if workers <= 1:
            for job in jobs:
                on_result(*_render_job(job))
                bar.update()
            return
        ctx = mp.get_context("spawn")
        stall = RENDER_TIMEOUT_S * 3 + 60  # a worker that died on a file loses its task: don't wait forever
        with ctx.Pool(workers) as pool:
            it = pool.imap_unordered(_render_job, jobs)  # chunksize 1: only then does next() take a timeout
            for _ in range(len(jobs)):
                try:
                    result = it.next(timeout=stall)
                except mp.TimeoutError:
                    pool.terminate()
                    raise SetupError(
                        f"rendering stalled for {stall}s (a worker probably crashed); finished PNGs are kept, "
                        "run the build again to continue"
                    ) from None
                on_result(*result)
                bar.update()
    finally:
        bar.close()


# --------------------------------------------------------------------------------------------- splits


def split_sizes(n: int, n_test: int, n_dev: int) -> tuple[int, int]:
    """Requested test/dev sizes, scaled down (ratio kept) when they would exceed 40 % of the images."""
    if n_test + n_dev <= EVAL_FRACTION_CAP * n:
        return n_test, n_dev
    budget = EVAL_FRACTION_CAP * n
    total = max(n_test + n_dev, 1)
    t = max(1, int(round(budget * n_test / total))) if n >= 3 else 0
    d = max(1, int(round(budget * n_dev / total))) if n >= 3 else 0
    return t, d


def assign_splits(ids: list[str], seed: int, n_test: int, n_dev: int) -> dict[str, list[str]]:
    """Seeded split by image (captions follow their image); rows inside a split are sorted by id."""
    ids = sorted(ids)
    t, d = split_sizes(len(ids), n_test, n_dev)
    perm = np.random.default_rng(seed).permutation(len(ids))
    test, dev, train = perm[:t], perm[t : t + d], perm[t + d :]
    return {"train": sorted(ids[i] for i in train), "dev": sorted(ids[i] for i in dev),
            "test": sorted(ids[i] for i in test)}  # fmt: skip


# --------------------------------------------------------------------------------------------- features


def compute_features(
    ids: list[str], out_dir: Path, cache_dir: Path, progress: bool
) -> tuple[dict, dict, Counter]:
    """Lite0 grids for every image, cached per image id in buckets (first 2 hex digits of the id).

    Buckets, not fixed-size chunks of the sorted list: adding or removing one drawing then invalidates
    nothing, only the missing ids are computed, and an interrupted run keeps every finished bucket.
    The cache folder is keyed by the extractor spec and the render version, so changing either recomputes.
    Returns (id -> (bucket array, row), extractor spec, stats).
    """
    from vsekit.features.efficientnet import GridFeatureExtractor

    extractor = GridFeatureExtractor()
    spec = extractor.describe()
    spec_key = hashlib.sha1((json.dumps(spec, sort_keys=True) + RENDER_VERSION).encode()).hexdigest()[:16]
    folder = cache_dir / spec_key
    folder.mkdir(parents=True, exist_ok=True)
    for stale in cache_dir.iterdir():  # caches of another extractor / renderer are dead weight
        if stale.name == spec_key:
            continue
        if stale.is_dir():
            shutil.rmtree(stale)
        else:
            stale.unlink()
    shape = (spec["regions"], spec["dim"])
    buckets: dict[str, list[str]] = {}
    for ident in ids:
        buckets.setdefault(ident[:2], []).append(ident)
    where: dict[str, tuple[np.ndarray, int]] = {}
    stats: Counter = Counter()
    bar = _bar(progress, total=len(ids), desc="features", unit="img")
    for name in sorted(buckets):
        npy, idf = folder / f"{name}.npy", folder / f"{name}.ids"
        old_ids: list[str] = []
        arr = np.zeros((0, *shape), np.float16)
        if npy.is_file() and idf.is_file():
            try:
                loaded = np.load(npy, mmap_mode="r")
                listed = idf.read_text(encoding="utf-8").split()
                if (
                    loaded.shape[1:] == shape
                    and loaded.dtype == np.float16
                    and len(listed) == loaded.shape[0]
                ):
                    arr, old_ids = loaded, listed
            except (OSError, ValueError):
                pass
        known = set(old_ids)
        missing = [i for i in buckets[name] if i not in known]
        if missing:
            feats = extractor.extract_paths(
                [out_dir / "images" / f"{i}.png" for i in missing], progress=False
            )
            if not np.isfinite(feats).all():
                raise RuntimeError(f"non-finite features for one of {missing}")
            atomic_save_npy(npy, np.concatenate([np.asarray(arr), feats]))
            old_ids = old_ids + missing
            # after the array: a mismatch means redo
            atomic_write_text(idf, "".join(f"{i}\n" for i in old_ids))
            arr = np.load(npy, mmap_mode="r")
        stats["computed"] += len(missing)
        stats["reused"] += len(buckets[name]) - len(missing)
        row_of = {ident: r for r, ident in enumerate(old_ids)}
        for ident in buckets[name]:
            where[ident] = (arr, row_of[ident])
        bar.update(len(buckets[name]))
    bar.close()
    return where, spec, stats


def _write_features(path: Path, ids: list[str], where: dict) -> None:
    """Stream rows into a temp .npy next to the target, fsync, rename (the train file is ~300 MB)."""
    first = where[ids[0]][0] if ids else None
    regions, dim = (first.shape[1], first.shape[2]) if first is not None else (49, 1280)
    with atomic_path(path) as tmp:
        mm = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(len(ids), regions, dim))
        for row, ident in enumerate(ids):
            arr, r = where[ident]
            mm[row] = arr[r]
        mm.flush()
        del mm


# --------------------------------------------------------------------------------------------- build


def build_openclipart(out_dir: str | Path, svg_root: str | Path = DEFAULT_SVG_ROOT, seed: int = 0,
                      limit: int | None = None, workers: int = 2, n_test: int = 500, n_dev: int = 300,
                      progress: bool = True) -> dict:  # fmt: skip
    """Build (or finish, or refresh) the openclipart retrieval set in `out_dir`; returns the manifest.

    `limit` keeps a seeded random subset of that many labelled drawings (after parsing and filtering the
    whole tree, so labels are the same as in the full build) for quick smoke runs; test/dev sizes then
    shrink so that they take at most 40 % of the images.
    """
    t0 = time.perf_counter()
    timings: dict[str, float] = {}
    out = Path(out_dir)
    cache = out / ".cache"
    (out / "images").mkdir(parents=True, exist_ok=True)
    cache.mkdir(parents=True, exist_ok=True)
    root = ensure_svg_root(svg_root)

    rel_paths, links = find_svgs(root)
    if not rel_paths:
        raise FileNotFoundError(f"{root}: no .svg files found")
    parsed, errors = parse_all(root, rel_paths, cache / "metadata.json", progress)
    timings["parse"] = time.perf_counter() - t0
    drawings, n_dup = merge_duplicates(parsed)
    kept, label_stats = assign_labels(drawings)
    if limit is not None and len(kept) > limit:
        pick = np.random.default_rng(seed).choice(len(kept), size=max(int(limit), 0), replace=False)
        kept = [kept[i] for i in sorted(pick)]
    by_id = {d.id: d for d in kept}

    # render (PNGs and non-ok outcomes are cached, so a re-run only renders what is missing)
    t1 = time.perf_counter()
    status_file = cache / "render_status.json"
    status: dict = {}
    if status_file.is_file():
        try:
            data = json.loads(status_file.read_text(encoding="utf-8"))
            status = data.get("status", {}) if data.get("render_version") == RENDER_VERSION else {}
        except (OSError, ValueError):
            status = {}
    jobs = []
    reused = 0
    for d in kept:
        png = out / "images" / f"{d.id}.png"
        if png.is_file():
            status[d.id] = {"status": "ok", "detail": ""}
            reused += 1
        elif status.get(d.id, {}).get("status") in ("blank", "failed"):
            continue
        else:
            jobs.append((d.id, str(root / d.files[0]), str(png)))
    pending = {"n": 0}

    def on_result(ident: str, st: str, detail: str) -> None:
        status[ident] = {"status": st, "detail": detail}
        if st == "failed":
            log.warning("render failed for %s (%s): %s", ident, by_id[ident].files[0], detail)
        pending["n"] += 1
        if pending["n"] % 200 == 0:
            atomic_write_json(
                status_file, {"render_version": RENDER_VERSION, "status": status}, ensure_ascii=False
            )

    try:
        render_all(jobs, workers, progress, on_result)
    finally:
        atomic_write_json(
            status_file, {"render_version": RENDER_VERSION, "status": status}, ensure_ascii=False
        )
    timings["render"] = time.perf_counter() - t1
    outcome = Counter(status[d.id]["status"] for d in kept)
    images = [d for d in kept if status[d.id]["status"] == "ok"]
    if not images:
        raise SetupError(f"no usable images from {root} (render outcomes: {dict(outcome)})")

    # split + features
    splits = assign_splits([d.id for d in images], seed, n_test, n_dev)
    t2 = time.perf_counter()
    where, spec, feat_stats = compute_features(
        sorted(d.id for d in images), out, cache / "features", progress
    )
    timings["features"] = time.perf_counter() - t2

    # write the layout
    t3 = time.perf_counter()
    files: dict[str, str] = {}
    split_info: dict[str, dict] = {}
    for split in SPLITS:
        ids = splits[split]
        caps, cap2img, metas = [], [], []
        for row, ident in enumerate(ids):
            d = by_id[ident]
            for c in d.captions:
                if "\n" in c or "\r" in c or not c.strip():
                    raise RuntimeError(f"bad caption for {ident}: {c!r}")
                caps.append(c)
                cap2img.append(row)
            metas.append({"id": d.id, "label": d.label, "label_source": d.label_source, "title": d.title,
                          "description": d.description, "keywords": d.keywords, "creator": d.creator,
                          "categories": d.categories, "files": d.files, "captions": d.captions})  # fmt: skip
        if ids:
            _write_features(out / f"{split}_ims.npy", ids, where)
        else:  # an empty split (tiny `limit` builds) still gets well-formed files
            atomic_save_npy(out / f"{split}_ims.npy", np.zeros((0, spec["regions"], spec["dim"]), np.float16))
        atomic_write_text(out / f"{split}_caps.txt", "".join(c + "\n" for c in caps))
        atomic_write_text(out / f"{split}_cap2img.txt", "".join(f"{r}\n" for r in cap2img))
        atomic_write_text(out / f"{split}_ids.txt", "".join(f"{i}\n" for i in ids))
        atomic_write_text(out / f"{split}_images.txt", "".join(f"images/{i}.png\n" for i in ids))
        atomic_write_text(
            out / f"{split}_meta.jsonl", "".join(json.dumps(m, ensure_ascii=False) + "\n" for m in metas)
        )
        per_image = Counter(len(by_id[i].captions) for i in ids)
        split_info[split] = {"images": len(ids), "captions": len(caps),
                             "captions_per_image": {str(k): per_image[k] for k in sorted(per_image)}}  # fmt: skip
    for split in SPLITS:
        for suffix in ("ims.npy", "caps.txt", "cap2img.txt", "ids.txt", "images.txt", "meta.jsonl"):
            name = f"{split}_{suffix}"
            files[name] = sha256_file(out / name)
    timings["write"] = time.perf_counter() - t3
    timings["total"] = time.perf_counter() - t0

    err_kinds = Counter(e["kind"] for e in errors.values())
    licences = Counter(d.license.rsplit("/", 1)[-1] or "(none)" for d in drawings)
    is_default = root.resolve() == Path(DEFAULT_SVG_ROOT).resolve()
    manifest = {
        "format": FORMAT,
        "name": "openclipart",
        "source": {
            "package": PACKAGE if is_default else None,
            "version": package_version() if is_default else None,
            "svg_root": str(root),
        },
        "license": "Public domain: Creative Commons Public Domain Dedication (the predecessor of CC0), per "
        "/usr/share/doc/openclipart-svg/copyright; each SVG's RDF carries cc:license PublicDomain.",
        "license_per_drawing": dict(licences),
        "build": {
            "seed": seed,
            "limit": limit,
            "n_test": n_test,
            "n_dev": n_dev,
            "workers": workers,
            "render": RENDER_VERSION,
            "render_size": RENDER_SIZE,
            "image_size": IMAGE_SIZE,
            "crop_margin": MARGIN,
            "max_words": MAX_WORDS,
            "max_share": MAX_SHARE,
        },  # fmt: skip
        "counts": {
            "svg_files": len(rel_paths),
            "symlinks_skipped": links,
            "malformed_skipped": err_kinds.get("malformed", 0),
            "no_metadata_skipped": err_kinds.get("no_metadata", 0),
            "parsed": len(parsed),
            "duplicates": n_dup,
            "unique_drawings": len(drawings),
            "generic_titles": label_stats["generic_titles"],
            "renamed_from_file_stem": label_stats["renamed_from_file_stem"],
            "generic_dropped": label_stats["generic_dropped"],
            "generic_dropped_collection": label_stats["generic_dropped_collection"],
            "generic_dropped_unreadable_stem": label_stats["generic_dropped_unreadable_stem"],
            "generic_dropped_ambiguous_stem": label_stats["generic_dropped_ambiguous_stem"],
            "labelled": len(drawings) - label_stats["generic_dropped"],
            "selected": len(kept),
            "render_failures": outcome.get("failed", 0),
            "blank": outcome.get("blank", 0),
            "images": len(images),
            "captions": sum(s["captions"] for s in split_info.values()),
        },
        "splits": split_info,
        "caption_rules": CAPTION_RULES,
        "layout": {
            "{split}_ims.npy": "float16 (images, 49, 1280) EfficientNet-Lite0 grid, one row per image",
            "{split}_caps.txt": "one caption per line, captions of one image consecutive",
            "{split}_cap2img.txt": "0-based image row of each caption line",
            "{split}_ids.txt": "stable image id (md5 prefix of the SVG without <metadata>) per image row",
            "{split}_images.txt": "PNG path relative to this folder per image row",
            "{split}_meta.jsonl": "per image row: label, title, description, keywords, creator, categories, files",
        },
        "features": spec,
        "files_sha256": files,
        "cache": {
            "png_reused": reused,
            "png_rendered": len(jobs),
            "features_reused": feat_stats["reused"],
            "features_computed": feat_stats["computed"],
        },  # fmt: skip
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
    }
    atomic_write_json(out / "manifest.json", manifest, ensure_ascii=False)
    return manifest


__all__ = ["build_openclipart", "parse_svg_metadata", "merge_duplicates", "assign_labels", "make_captions",
           "stem_label", "render_svg", "crop_square", "assign_splits", "split_sizes", "CAPTION_RULES", "Drawing",
           "SvgMetadataError"]  # fmt: skip
