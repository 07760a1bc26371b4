"""Dublin Core metadata of one SVG (title, description, keywords, creator, licence, content md5), and of a
whole tree with a cache keyed by each file's size and mtime."""

from __future__ import annotations

import hashlib
import json
import logging
import re
import xml.etree.ElementTree as ET
from pathlib import Path

from vsekit.utils.io import atomic_write_json
from vsekit.utils.progress import progress_bar
from vsekit_lab.datasets.openclipart.text import norm_text

log = logging.getLogger(__name__)

CACHE_VERSION = 2  # metadata cache: bump when parsing or text repair changes
NS = {
    "dc": "http://purl.org/dc/elements/1.1/",
    "rdf": "http://www.w3.org/1999/02/22-rdf-syntax-ns#",
}
CC_NAMESPACES = ("http://web.resource.org/cc/", "http://creativecommons.org/ns#")
RDF_RESOURCE = f"{{{NS['rdf']}}}resource"
METADATA_RE = re.compile(rb"<(?:[\w.-]+:)?metadata\b(?:[^>]*/>|.*?</(?:[\w.-]+:)?metadata\s*>)", re.S)


class SvgMetadataError(ValueError):
    """An SVG that cannot be used: malformed XML or no Dublin Core metadata."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind  # "malformed" | "no_metadata"


def _text(el: ET.Element | None) -> str:
    return norm_text("".join(el.itertext())) if el is not None else ""


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
    return {
        "md5": md5,
        "title": title,
        "description": description,
        "keywords": keywords,
        "creator": creator,
        "license": licence,
    }


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
    for rel in progress_bar(enabled=progress, iterable=rel_paths, desc="parse svg", unit="file"):
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
