"""Raw images: Karpathy-style JSON splits (`dataset_flickr30k.json`, `dataset_coco.json`) and pixel loading.

Karpathy JSON: {"images": [{"filename", "filepath"?, "split": train|restval|val|test, "sentences":
[{"raw", "tokens"}], "imgid"?, "cocoid"?}]}. `restval` counts as train (the usual 113K COCO train),
`val` is vsekit's `dev`.

Transforms (VSE∞ `RawImageDataset`, PIL + numpy since torchvision is not required): training takes a
random crop with side ratio U(0.6, 1), resizes to size x size and flips horizontally with p 0.5;
evaluation resizes the whole image. Normalisation and the resize filter are the backbone's own
(`vsekit.features.backbones.PixelTransform`: timm / torchvision data config), ImageNet mean/std with
bilinear resizing by default.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from vsekit.data.pictures import on_white, open_image, to_pixels
from vsekit.data.precomp import DataFormatError
from vsekit.data.text import caption_problem
from vsekit.features.backbones import IMAGENET_TRANSFORM, PixelTransform
from vsekit.utils.printable import printable

log = logging.getLogger(__name__)

IMAGENET_MEAN = np.array(IMAGENET_TRANSFORM.mean, dtype=np.float32)
IMAGENET_STD = np.array(IMAGENET_TRANSFORM.std, dtype=np.float32)
_SPLIT_ALIASES = {"train": ("train", "restval"), "dev": ("val",), "val": ("val",), "test": ("test",)}
# line breaks and tabs in a sentence: spaces of one caption line
_LAYOUT_SPACE_RE = re.compile(r"[\t\n\r\v\f]")


def _sentence_text(sentence: object) -> tuple[str | None, str | None]:
    """(caption, None) of one Karpathy sentence ({"raw": ..., "tokens": [...]}), or (None, why it is not
    usable): not an object, `raw` / `tokens` not text, a lone surrogate (not valid Unicode, so not writable
    as UTF-8), or what `vsekit.data.text.caption_problem` refuses (a control character: a terminal escape in
    `{split}_caps.txt` and in whatever prints it; an over-long caption), the rule of the own builders."""
    if not isinstance(sentence, dict):
        return None, f"is {type(sentence).__name__}, not an object with 'raw' or 'tokens'"
    raw, tokens = sentence.get("raw"), sentence.get("tokens")
    if raw is not None and not isinstance(raw, str):
        return None, f"its 'raw' is {type(raw).__name__}, not text"
    if not raw:
        if tokens is None:
            tokens = []
        if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens):
            return None, "its 'tokens' is not a list of text"
        raw = " ".join(tokens)
    text = _LAYOUT_SPACE_RE.sub(" ", raw).strip()
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return (
            None,
            f"a lone surrogate \\u{ord(text[e.start]):04x} at character {e.start + 1} (not valid Unicode)",
        )
    problem = caption_problem(text)
    if problem is not None:
        return None, f"{problem[0]}: {problem[1]}"
    return text, None


@dataclass
class RawSplit:
    root: Path
    split: str
    captions: list[str]
    cap2img: np.ndarray
    image_paths: list[str]
    image_ids: list[str]

    @property
    def n_images(self) -> int:
        return len(self.image_paths)

    @property
    def n_captions(self) -> int:
        return len(self.captions)

    def abs_image_path(self, index: int) -> Path:
        return self.root / self.image_paths[index]

    def truncate(self, max_images: int) -> RawSplit:
        if max_images <= 0 or max_images >= self.n_images:
            return self
        keep = np.nonzero(self.cap2img < max_images)[0]
        return RawSplit(
            self.root,
            self.split,
            [self.captions[i] for i in keep],
            self.cap2img[keep],
            self.image_paths[:max_images],
            self.image_ids[:max_images],
        )


def load_karpathy_split(json_path: str | Path, split: str, image_root: str | Path | None = None) -> RawSplit:
    json_path = Path(json_path)
    if not json_path.is_file():
        raise DataFormatError(f"{json_path}: missing (expected a Karpathy-style dataset JSON)")
    try:
        data = json.loads(json_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise DataFormatError(f"{json_path}: not UTF-8 text (byte {e.start})") from e
    except (ValueError, RecursionError) as e:  # JSONDecodeError, a number of thousands of digits, nesting
        raise DataFormatError(f"{json_path}: not valid JSON ({printable(e)})") from e
    if not isinstance(data, dict) or not isinstance(data.get("images"), list):
        raise DataFormatError(f"{json_path}: expected a top-level object with an 'images' list")
    wanted = _SPLIT_ALIASES.get(split, (split,))
    root = Path(image_root) if image_root else json_path.parent
    captions, cap2img, paths, ids = [], [], [], []
    for n, entry in enumerate(data["images"]):
        if not isinstance(entry, dict) or "filename" not in entry or "sentences" not in entry:
            raise DataFormatError(f"{json_path}: images[{n}] needs 'filename' and 'sentences'")
        if entry.get("split") not in wanted:
            continue
        filename = entry["filename"]
        ident = str(entry.get("cocoid", entry.get("imgid", len(paths))))
        for field, value in (("filename", filename), ("filepath", entry.get("filepath", "")), ("id", ident)):
            if not isinstance(value, str):
                raise DataFormatError(f"{json_path}: images[{n}]: its {field} is not text")
            if printable(value) != value:  # one line of {split}_images.txt / _ids.txt, valid UTF-8
                raise DataFormatError(
                    f"{json_path}: images[{n}]: its {field} '{printable(value)}' holds a control character "
                    "or is not valid Unicode"
                )
        if not isinstance(entry["sentences"], list):
            raise DataFormatError(
                f"{json_path}: images[{n}] ({printable(filename)}): 'sentences' is not a list"
            )
        sents = []
        for k, sentence in enumerate(entry["sentences"]):
            text, why = _sentence_text(sentence)
            if why is not None:  # reported and skipped, as the own builders skip a caption they refuse
                log.warning(
                    "%s: images[%d].sentences[%d] (%s) %s; skipped", json_path, n, k, printable(filename), why
                )
            elif text:
                sents.append(text)
        if not sents:
            raise DataFormatError(f"{json_path}: images[{n}] ({printable(filename)}) has no caption")
        img = len(paths)
        paths.append(str(Path(entry.get("filepath", "")) / entry["filename"]))
        ids.append(ident)
        captions.extend(sents)
        cap2img.extend([img] * len(sents))
    if not paths:
        raise DataFormatError(f"{json_path}: no image has split {' or '.join(wanted)}")
    return RawSplit(root, split, captions, np.asarray(cap2img, dtype=np.int64), paths, ids)


def load_pixels(
    path: Path, size: int, rng: np.random.Generator | None, transform: PixelTransform = IMAGENET_TRANSFORM
) -> torch.Tensor:
    """[3, size, size] float tensor; training-time crop/flip when `rng` is given. The picture a dataset names
    is input from elsewhere: read and decoded by `vsekit.data.pictures.open_image` (a regular file under the
    byte cap, its pixel count checked from its header before decoding), every refusal a DataFormatError
    naming the file."""
    im = on_white(open_image(path))
    if rng is not None:
        w, h = im.size
        ratio = rng.uniform(0.6, 1.0)
        cw, ch = max(1, int(w * ratio)), max(1, int(h * ratio))
        x0, y0 = int(rng.integers(0, w - cw + 1)), int(rng.integers(0, h - ch + 1))
        im = im.crop((x0, y0, x0 + cw, y0 + ch))
        if rng.random() < 0.5:
            im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return to_pixels(im, size, transform)


class PixelSource:
    """Images as normalised pixels, for end-to-end training with a CNN backbone."""

    kind = "pixels"

    def __init__(
        self,
        split,
        image_size: int = 224,
        augment: bool = False,
        transform: PixelTransform = IMAGENET_TRANSFORM,
    ) -> None:
        if getattr(split, "image_paths", None) is None:
            raise DataFormatError(
                f"{split.root}: split {split.split!r} lists no image paths ({split.split}_images.txt)"
            )
        self.split = split
        self.image_size = image_size
        self.augment = augment
        self.transform = transform
        self.n_images = split.n_images

    def load(self, index: int, rng: np.random.Generator | None) -> torch.Tensor:
        return load_pixels(
            self.split.abs_image_path(index), self.image_size, rng if self.augment else None, self.transform
        )


def convert_karpathy(
    json_path: str | Path,
    out_dir: str | Path,
    image_root: str | Path | None = None,
    splits: tuple[str, ...] = ("train", "dev", "test"),
) -> dict[str, dict[str, int]]:
    """Write a Karpathy JSON as vsekit split files (captions, cap2img, ids, images) without features.

    The result trains backbone recipes from pixels (`vse train --recipe vse_infty_grid_e2e --data OUT`) and
    is read by the same precomp reader. The pictures stay where they are: `manifest.json` records their
    folder as `images_root` (relative to `out_dir` when the pictures lie under it, else absolute) and
    `{split}_images.txt` lists each picture relative to it. Splits are checked (every picture exists, none
    resolves outside the images folder) before anything is written, so a bad JSON leaves no half layout.
    """
    import os

    from vsekit.data.manifest import ManifestError, read_manifest, write_manifest
    from vsekit.data.precomp import IMAGES, dataset_image_root, splits_with, write_precomp_split

    out = Path(out_dir)
    loaded = {s: load_karpathy_split(json_path, s, image_root) for s in splits}
    folder = Path(image_root) if image_root else Path(json_path).parent
    base = folder.resolve()
    rel_paths: dict[str, list[str]] = {}
    for s, raw in loaded.items():
        rels = []
        for i in range(raw.n_images):
            path = raw.abs_image_path(i)
            if not path.is_file():
                raise DataFormatError(
                    f"{json_path}: split {s!r} image {raw.image_paths[i]!r} not found at "
                    f"{path} (pass --images ROOT)"
                )
            full = path.resolve()
            if not full.is_relative_to(base):
                raise DataFormatError(
                    f"{json_path}: split {s!r} image {raw.image_paths[i]!r} resolves to {full}, "
                    f"outside the images folder {base} ('..' or a symlink out of it); "
                    f"pass the folder that holds every picture as --images"
                )
            rels.append(full.relative_to(base).as_posix())
        rel_paths[s] = rels
    out_abs = out.resolve()
    declared = os.path.relpath(base, out_abs) if base.is_relative_to(out_abs) else str(base)
    # other splits already in `out` keep their pictures' root: refuse one that would move it under them
    others = [s for s in splits_with(out, IMAGES) if s not in loaded]
    if others and dataset_image_root(out).resolve() != base:
        raise DataFormatError(
            f"{out}: split(s) {', '.join(others)} list pictures under {dataset_image_root(out).resolve()}; "
            f"these pictures are under {base}: convert every split in one command "
            f"(--splits) or choose another --out"
        )
    out.mkdir(parents=True, exist_ok=True)
    manifest: dict = {}
    try:
        manifest = read_manifest(out)
    except ManifestError:  # an unreadable one is replaced
        pass
    counts = {s: {"images": raw.n_images, "captions": raw.n_captions} for s, raw in loaded.items()}
    manifest.update(
        {"format": "karpathy", "source_json": str(Path(json_path).resolve()), "images_root": declared}
    )
    manifest["splits"] = {
        **(manifest.get("splits") if isinstance(manifest.get("splits"), dict) else {}),
        **counts,
    }
    write_manifest(out, manifest)  # first: split files never point into an undeclared root
    for s, raw in loaded.items():
        write_precomp_split(
            out,
            s,
            captions=[c.replace("\n", " ") for c in raw.captions],
            cap2img=raw.cap2img.tolist(),
            image_ids=raw.image_ids,
            image_paths=rel_paths[s],
        )
    return counts
