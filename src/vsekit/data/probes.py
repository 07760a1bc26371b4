"""Probe items for `vse eval --probe`: seeded word-order perturbations of a split's captions (ARO's
COCO-Order / Flickr30k-Order, made reproducible), the released SugarCrepe JSON files mapped to a precomp
split by COCO id, and the split of each item into clean and contaminated by the run's training pictures.

Order probes. Each chosen image gives one item per perturbation: its first caption (as its tokens joined by
spaces, so that the positive and the negatives differ in word order only, never in case or spacing) against
up to `negatives` distinct perturbed versions of it, none equal to the positive. Perturbations (ARO's):
- `shuffle_all`: every token in random order;
- `shuffle_trigrams`: the caption cut into consecutive trigrams (the last may be shorter), their order
  shuffled, each kept whole;
- `shuffle_within_trigrams`: the trigrams kept in place, the tokens inside each shuffled;
- `shuffle_nouns_adjectives`: the nouns and adjectives (a part-of-speech tagger's NN* / JJ* tags) permuted
  among their own positions, every other token in place; needs nltk with its tagger data, else it is skipped
  and the reason said.
An item whose caption allows no distinct perturbation (one word, or the same word throughout) is left out
of that perturbation and counted. Every draw comes from `numpy.random.default_rng((seed, perturbation,
image row))`, so one image's items do not depend on which other images were sampled.

SugarCrepe. The released files (github.com/RAIVNLab/sugar-crepe, `data/*.json`) are one JSON object per
category, `{"0": {"filename": "000000000139.jpg", "caption": ..., "negative_caption": ...}, ...}`, on COCO
val2017 pictures; a picture is found in a precomp split by the COCO id in its file name and the split's
`{split}_ids.txt`. A picture with no row is counted, never an error.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from vsekit.data.precomp import DataFormatError, read_lines
from vsekit.data.text import MAX_CAPTION_CHARS, tokenize_words
from vsekit.data.untrusted import UntrustedFileError, read_bounded
from vsekit.errors import VseInputError
from vsekit.utils.safe_json import JsonBoundsError, loads_bounded

log = logging.getLogger(__name__)

ORDER_PERTURBATIONS = (
    "shuffle_all",
    "shuffle_trigrams",
    "shuffle_within_trigrams",
    "shuffle_nouns_adjectives",
)
SUGARCREPE_CATEGORIES = (
    "add_att",
    "add_obj",
    "replace_att",
    "replace_obj",
    "replace_rel",
    "swap_att",
    "swap_obj",
)
SUBSETS = ("all", "clean", "contaminated")

MAX_PROBE_FILE_BYTES = 64 * 1024 * 1024  # one SugarCrepe category (add_obj: 0.5 MB) or a saved item file
MAX_PROBE_ITEMS = 1_000_000  # items of one file: SugarCrepe has 7,511 in all, COCO-Order 25,010
MAX_DRAWS = 50  # permutations tried per wanted negative before an item keeps fewer negatives
ITEMS_FORMAT = "vsekit-order-probe/1"


class ProbeInputError(VseInputError):
    """A probe file or folder that cannot be used; the message names it and the problem."""


def probe_words(caption: str) -> list[str]:
    """The tokens a probe perturbs: the lower-cased regex tokens (`vsekit.data.text.tokenize_words`)."""
    return tokenize_words(caption, "regex")


def trigrams(n: int) -> list[list[int]]:
    """Positions 0..n-1 cut into consecutive groups of three (the last one shorter)."""
    return [list(range(i, min(i + 3, n))) for i in range(0, n, 3)]


@dataclass
class Tagger:
    """A part-of-speech tagger, or the reason there is none (`available` False)."""

    tag: object = None  # callable: list of tokens -> list of (token, tag)
    reason: str = ""

    @property
    def available(self) -> bool:
        return self.tag is not None


def find_tagger() -> Tagger:
    """nltk's perceptron tagger when nltk and its tagger data are installed; never downloads anything."""
    try:
        import nltk
    except ImportError:
        return Tagger(reason="no part-of-speech tagger: nltk is not installed (pip install nltk)")
    try:
        nltk.pos_tag(["a", "dog"])
    except LookupError:
        return Tagger(
            reason="no part-of-speech tagger: nltk's tagger data is not installed "
            "(python -m nltk.downloader averaged_perceptron_tagger_eng)"
        )
    return Tagger(tag=nltk.pos_tag)


def permute(words: list[str], kind: str, rng: np.random.Generator, tagger: Tagger | None = None) -> list[str]:
    """One random perturbation `kind` (ORDER_PERTURBATIONS) of `words`; it may equal `words`."""
    n = len(words)
    if kind == "shuffle_all":
        return [words[i] for i in rng.permutation(n)]
    groups = trigrams(n)
    if kind == "shuffle_trigrams":
        return [words[i] for g in rng.permutation(len(groups)) for i in groups[g]]
    if kind == "shuffle_within_trigrams":
        return [words[g[i]] for g in groups for i in rng.permutation(len(g))]
    if kind == "shuffle_nouns_adjectives":
        if tagger is None or not tagger.available:
            raise VseInputError("shuffle_nouns_adjectives needs a part-of-speech tagger")
        spots = [i for i, (_, t) in enumerate(tagger.tag(words)) if t.startswith(("NN", "JJ"))]
        out = list(words)
        for i, j in zip(spots, rng.permutation(spots)):
            out[i] = words[j]
        return out
    raise VseInputError(f"unknown perturbation {kind!r}; choose one of {', '.join(ORDER_PERTURBATIONS)}")


def perturbations_of(
    words: list[str], kind: str, negatives: int, rng: np.random.Generator, tagger: Tagger | None = None
) -> list[str]:
    """Up to `negatives` distinct perturbed captions, none equal to the positive (fewer when the caption
    allows fewer; none for one word)."""
    positive = " ".join(words)
    found: list[str] = []
    for _ in range(MAX_DRAWS * negatives):
        if len(found) == negatives:
            break
        text = " ".join(permute(words, kind, rng, tagger))
        if text != positive and text not in found:
            found.append(text)
    return found


@dataclass
class OrderItem:
    """One image's positive caption against its perturbed versions."""

    image: int  # image index in the split
    image_id: str
    positive: str
    negatives: list[str]


@dataclass
class OrderProbe:
    """The items of every perturbation, how they were drawn, and what was left out and why."""

    split: str
    seed: int
    negatives: int
    items: dict[str, list[OrderItem]] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # perturbation -> why it has no items
    left_out: dict[str, int] = field(default_factory=dict)  # perturbation -> images with no distinct version


def sample_images(n_images: int, sample: int, seed: int) -> np.ndarray:
    """All image indices (sample 0 or >= n), else `sample` of them drawn with `seed`, in order."""
    if sample <= 0 or sample >= n_images:
        return np.arange(n_images)
    return np.sort(np.random.default_rng(seed).permutation(n_images)[:sample])


def build_order_probe(
    captions: list[str],
    cap2img: np.ndarray,
    image_ids: list[str],
    split: str = "test",
    seed: int = 0,
    negatives: int = 4,
    sample: int = 0,
    tagger: Tagger | None = None,
) -> OrderProbe:
    """The order probe of a split (module docstring): one item per sampled image and perturbation, its
    first caption against up to `negatives` perturbed versions."""
    if negatives < 1:
        raise VseInputError(f"--probe-negatives {negatives}: at least 1")
    tagger = tagger if tagger is not None else find_tagger()
    first: dict[int, int] = {}
    for c, img in enumerate(np.asarray(cap2img).tolist()):
        first.setdefault(img, c)
    chosen = sample_images(len(image_ids), sample, seed)
    probe = OrderProbe(split, seed, negatives)
    for p, kind in enumerate(ORDER_PERTURBATIONS):
        if kind == "shuffle_nouns_adjectives" and not tagger.available:
            probe.skipped[kind] = tagger.reason
            continue
        items, left = [], 0
        for img in chosen.tolist():
            if img not in first:
                continue
            words = probe_words(captions[first[img]])
            rng = np.random.default_rng((seed, p, img))
            negs = perturbations_of(words, kind, negatives, rng, tagger)
            if not negs:
                left += 1
                continue
            items.append(OrderItem(img, str(image_ids[img]), " ".join(words), negs))
        probe.items[kind] = items
        probe.left_out[kind] = left
    return probe


def order_probe_json(probe: OrderProbe) -> dict:
    """The items as a JSON object, so that a second model is scored on exactly these items."""
    return {
        "format": ITEMS_FORMAT,
        "split": probe.split,
        "seed": probe.seed,
        "negatives": probe.negatives,
        "skipped": dict(probe.skipped),
        "left_out": dict(probe.left_out),
        "items": {
            kind: [
                {
                    "image": it.image,
                    "image_id": it.image_id,
                    "positive": it.positive,
                    "negatives": it.negatives,
                }
                for it in items
            ]
            for kind, items in probe.items.items()
        },
    }


def read_json_file(path: str | Path) -> object:
    """A JSON file from elsewhere, bounded in bytes (MAX_PROBE_FILE_BYTES) and shape (`loads_bounded`)."""
    try:
        raw = read_bounded(path, MAX_PROBE_FILE_BYTES, follow_symlinks=True, expected="a JSON file")
        return loads_bounded(raw, str(path))
    except UntrustedFileError as e:
        raise ProbeInputError(str(e)) from None
    except JsonBoundsError as e:
        raise ProbeInputError(str(e)) from None
    except OSError as e:
        raise ProbeInputError(f"{path}: cannot be read ({e.strerror or e})") from None


def _text(value: object, where: str, key: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ProbeInputError(f"{where}: {key!r} must be a non-empty string, got {str(value)[:40]!r}")
    if len(value) > MAX_CAPTION_CHARS:
        raise ProbeInputError(
            f"{where}: {key!r} has {len(value):,} characters (at most {MAX_CAPTION_CHARS:,})"
        )
    return value


def read_order_probe(path: str | Path, n_images: int, image_ids: list[str]) -> OrderProbe:
    """Items saved by an earlier `--probe order` run, checked against the split they are scored on: each
    item's image index must be in it and carry the same id."""
    data = read_json_file(path)
    if (
        not isinstance(data, dict)
        or data.get("format") != ITEMS_FORMAT
        or not isinstance(data.get("items"), dict)
    ):
        raise ProbeInputError(f"{path}: not an order-probe item file (format {ITEMS_FORMAT!r})")
    probe = OrderProbe(str(data.get("split", "")), int(data.get("seed", 0)), int(data.get("negatives", 0)))
    skipped = data.get("skipped", {})
    probe.skipped = {str(k): str(v) for k, v in skipped.items()} if isinstance(skipped, dict) else {}
    left = data.get("left_out", {})
    if isinstance(left, dict):
        probe.left_out = {
            str(k): v for k, v in left.items() if isinstance(v, int) and not isinstance(v, bool)
        }
    total = 0
    for kind, rows in data["items"].items():
        if kind not in ORDER_PERTURBATIONS or not isinstance(rows, list):
            raise ProbeInputError(f"{path}: unknown perturbation {str(kind)[:40]!r} or its items not a list")
        items = []
        for i, row in enumerate(rows):
            where = f"{path}: {kind} item {i}"
            total += 1
            if total > MAX_PROBE_ITEMS:
                raise ProbeInputError(f"{path}: more than {MAX_PROBE_ITEMS:,} items")
            if not isinstance(row, dict):
                raise ProbeInputError(f"{where}: not an object")
            img = row.get("image")
            if not isinstance(img, int) or isinstance(img, bool) or not 0 <= img < n_images:
                raise ProbeInputError(
                    f"{where}: image {str(img)[:40]} is not a row of the split (0..{n_images - 1})"
                )
            if str(row.get("image_id")) != str(image_ids[img]):
                raise ProbeInputError(
                    f"{where}: image {img} has id {image_ids[img]!r} in this split, not {str(row.get('image_id'))[:40]!r}"
                    " (items of another split)"
                )
            negs = row.get("negatives")
            if not isinstance(negs, list) or not negs:
                raise ProbeInputError(f"{where}: 'negatives' must be a non-empty list")
            items.append(
                OrderItem(
                    img,
                    str(image_ids[img]),
                    _text(row.get("positive"), where, "positive"),
                    [_text(n, where, "negatives") for n in negs],
                )
            )
        probe.items[kind] = items
    return probe


# ---------------------------------------------------------------- SugarCrepe


@dataclass
class SugarCrepeItem:
    """One released example: a COCO picture, its positive caption and the hard negative."""

    key: str
    filename: str
    coco_id: int
    positive: str
    negative: str


_COCO_ID_RE = re.compile(r"(\d+)\.(?:jpe?g|png)$", re.IGNORECASE)


def coco_id_of(filename: str) -> int | None:
    """The COCO image id in a file name (`000000000139.jpg`, `COCO_val2014_000000000139.jpg` -> 139)."""
    m = _COCO_ID_RE.search(filename.strip())
    return int(m.group(1)) if m and len(m.group(1)) <= 12 else None


def sugarcrepe_files(folder: str | Path) -> dict[str, Path]:
    """The category files of a SugarCrepe copy: `{category}.json` in the folder (or in its `data/`, the
    released repository's layout); ProbeInputError naming the folder when it holds none of them."""
    root = Path(folder)
    if not root.is_dir():
        raise ProbeInputError(f"--probe sugarcrepe {folder}: not a folder")
    for where in (root, root / "data"):
        found = {c: where / f"{c}.json" for c in SUGARCREPE_CATEGORIES if (where / f"{c}.json").is_file()}
        if found:
            return found
    raise ProbeInputError(
        f"--probe sugarcrepe {folder}: not SugarCrepe's layout: none of "
        f"{', '.join(c + '.json' for c in SUGARCREPE_CATEGORIES)} in it or in its data/ folder"
    )


def read_sugarcrepe(folder: str | Path) -> dict[str, list[SugarCrepeItem]]:
    """Every category file of a SugarCrepe copy, checked: each example an object with a `filename` holding a
    COCO id and non-empty `caption` and `negative_caption`."""
    out: dict[str, list[SugarCrepeItem]] = {}
    for cat, path in sugarcrepe_files(folder).items():
        data = read_json_file(path)
        if not isinstance(data, dict):
            raise ProbeInputError(f"{path}: expected one JSON object of examples, got {type(data).__name__}")
        if len(data) > MAX_PROBE_ITEMS:
            raise ProbeInputError(f"{path}: {len(data):,} examples (at most {MAX_PROBE_ITEMS:,})")
        items = []
        for key, ex in data.items():
            where = f"{path}: example {str(key)[:40]!r}"
            if not isinstance(ex, dict):
                raise ProbeInputError(f"{where}: not an object")
            filename = _text(ex.get("filename"), where, "filename")
            coco_id = coco_id_of(filename)
            if coco_id is None:
                raise ProbeInputError(
                    f"{where}: file name {filename[:60]!r} holds no COCO id (000000000139.jpg)"
                )
            items.append(
                SugarCrepeItem(
                    str(key),
                    filename,
                    coco_id,
                    _text(ex.get("caption"), where, "caption"),
                    _text(ex.get("negative_caption"), where, "negative_caption"),
                )
            )
        out[cat] = items
    return out


def id_rows(image_ids: list[str], where: str) -> dict[int, int]:
    """COCO id -> image index of a split from its image ids; ids that are not integers cannot be COCO ids."""
    rows: dict[int, int] = {}
    for i, s in enumerate(image_ids):
        try:
            rows.setdefault(int(str(s).strip()), i)
        except ValueError:
            raise ProbeInputError(
                f"{where}: image {i} has id {str(s)[:40]!r}, not a COCO id; SugarCrepe needs "
                "{split}_ids.txt with COCO image ids"
            ) from None
    return rows


def read_training_ids(data_dir: str | Path, train_split: str) -> set[int] | None:
    """The COCO ids of the run's training pictures (`{train_split}_ids.txt`), or None when the dataset has no
    such file (then no item can be called clean)."""
    path = Path(data_dir) / f"{train_split}_ids.txt"
    if not path.is_file():
        return None
    ids = set()
    for lineno, line in enumerate(read_lines(path), 1):
        try:
            ids.add(int(line.strip()))
        except ValueError:
            raise DataFormatError(f"{path}:{lineno}: expected a COCO image id, got {line[:40]!r}") from None
    return ids


def subset_masks(coco_ids: np.ndarray, training_ids: set[int] | None) -> dict[str, np.ndarray]:
    """Boolean masks of the three subsets: all; clean (picture outside the training split); contaminated
    (inside it). Without training ids only `all`."""
    masks = {"all": np.ones(len(coco_ids), dtype=bool)}
    if training_ids is not None:
        inside = np.array([int(i) in training_ids for i in coco_ids], dtype=bool)
        masks["clean"], masks["contaminated"] = ~inside, inside
    return masks
