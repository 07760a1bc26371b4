"""A contact sheet of a dataset split: pictures with their captions beneath, to check by eye that they match."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from vsekit.data.pictures import open_image
from vsekit.data.precomp import dataset_image_root, resolve_image_path
from vsekit.errors import VseInputError
from vsekit.utils.io import atomic_path, check_output_file


def _lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    return text[:-1].split("\n") if text.endswith("\n") else (text.split("\n") if text else [])


def _font(size: int) -> ImageFont.ImageFont | ImageFont.FreeTypeFont:
    try:
        return ImageFont.load_default(size=size)  # scalable bundled font (Pillow >= 10.1 with FreeType)
    except TypeError:
        return ImageFont.load_default()


def _wrap(text: str, font, width: int, draw: ImageDraw.ImageDraw) -> list[str]:
    """Greedy word wrap by rendered pixel width (long words are hard-split)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        while draw.textlength(word, font=font) > width:  # a single word wider than the cell
            cut = max(1, int(len(word) * width / max(draw.textlength(word, font=font), 1)) - 1)
            if line:
                lines.append(line)
                line = ""
            lines.append(word[:cut])
            word = word[cut:]
        trial = f"{line} {word}".strip()
        if draw.textlength(trial, font=font) <= width:
            line = trial
        else:
            lines.append(line)
            line = word
    if line:
        lines.append(line)
    return lines


def picture_format(out_png: str | Path) -> str:
    """The Pillow format that `out_png`'s extension names, when Pillow can write an RGB picture in it (checked by
    writing a 1x1 one to memory); else a one-line error naming the file: the montage is a picture."""
    import io

    ext = Path(out_png).suffix.lower()
    fmt = Image.registered_extensions().get(ext)
    try:
        if fmt is None:
            raise KeyError(ext)
        Image.new("RGB", (1, 1)).save(io.BytesIO(), format=fmt)
    except (KeyError, OSError, ValueError):
        what = (
            f"{ext!r} is not a picture format Pillow writes" if ext else "has no extension to tell the format"
        )
        raise VseInputError(
            f"--out {out_png}: {what}; the montage is a picture: name a .png (or .jpg, .webp)"
        ) from None
    return fmt


def show_dataset(
    data_dir: str | Path,
    out_png: str | Path,
    split: str = "test",
    n: int = 16,
    seed: int = 0,
    cell: int = 224,
    max_lines: int = 12,
) -> Path:
    """Write a montage of `n` seeded-random images of `split` with all their captions; returns the PNG path.

    Needs `{split}_images.txt` (raw pictures), `{split}_caps.txt` and `{split}_cap2img.txt` (or k captions
    per image in order). Ids from `{split}_ids.txt` are printed above the captions when present. `out_png`
    is checked first: a picture format Pillow writes (`picture_format`), in an existing folder, outside the
    dataset folder (`vsekit.utils.io.check_output_file`); it is written whole or not at all.
    """
    fmt = picture_format(out_png)
    out = check_output_file(out_png, "--out", [data_dir])
    root = Path(data_dir)
    images_file = root / f"{split}_images.txt"
    if not images_file.is_file():
        raise FileNotFoundError(f"{images_file}: missing; the montage needs the raw image paths of the split")
    paths = _lines(images_file)
    images_root = dataset_image_root(root)  # manifest.json's images_root (vse data karpathy), else the folder
    caps = _lines(root / f"{split}_caps.txt")
    c2i_file = root / f"{split}_cap2img.txt"
    if c2i_file.is_file():
        cap2img = [int(x) for x in _lines(c2i_file)]
    else:
        k = max(len(caps) // max(len(paths), 1), 1)
        cap2img = [i // k for i in range(len(caps))]
    ids_file = root / f"{split}_ids.txt"
    ids = _lines(ids_file) if ids_file.is_file() else [str(i) for i in range(len(paths))]
    by_image: dict[int, list[str]] = {}
    for c, i in zip(caps, cap2img):
        by_image.setdefault(i, []).append(c)

    count = min(n, len(paths))
    if count == 0:
        raise VseInputError(f"{images_file}: no images in split {split!r}")
    rows_idx = sorted(np.random.default_rng(seed).choice(len(paths), size=count, replace=False).tolist())
    cols = math.ceil(math.sqrt(count))
    nrows = math.ceil(count / cols)
    pad = 8
    font, small = _font(13), _font(11)
    line_h = 16
    scratch = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    blocks = []
    for i in rows_idx:
        header = f"#{i}  {ids[i]}"
        while len(header) > 4 and scratch.textlength(header, font=small) > cell:
            header = header[:-2] + "…"
        lines = [(header, small, (110, 110, 110))]
        for j, c in enumerate(by_image.get(i, []), 1):
            for k, part in enumerate(_wrap(f"{j}. {c}", font, cell, scratch)):
                lines.append(("   " + part if k else part, font, (0, 0, 0)))
        if len(lines) > max_lines:
            lines = lines[: max_lines - 1] + [("…", font, (0, 0, 0))]
        blocks.append(lines)
    row_heights = [
        cell + pad + line_h * max(len(b) for b in blocks[r * cols : (r + 1) * cols]) + 2 * pad
        for r in range(nrows)
    ]
    sheet = Image.new("RGB", (cols * (cell + 2 * pad), sum(row_heights)), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    y0 = 0
    for r in range(nrows):
        for c in range(cols):
            idx = r * cols + c
            if idx >= count:
                break
            x = c * (cell + 2 * pad) + pad
            row = rows_idx[idx]
            # a dataset's picture list is untrusted: inside the images root, a regular file, bounded bytes and pixels
            with open_image(resolve_image_path(images_root, paths[row], f"{images_file}:{row + 1}")) as im:
                im = im.convert("RGB")
                im.thumbnail((cell, cell))
                sheet.paste(im, (x, y0 + pad))
            draw.rectangle([x - 1, y0 + pad - 1, x + cell, y0 + pad + cell], outline=(200, 200, 200))
            y = y0 + pad + cell + pad // 2
            for text, f, color in blocks[idx]:
                draw.text((x, y), text, font=f, fill=color)
                y += line_h
        y0 += row_heights[r]
        if r < nrows - 1:
            draw.line([0, y0 - 1, sheet.width, y0 - 1], fill=(220, 220, 220))
    with atomic_path(out) as tmp:
        sheet.save(tmp, format=fmt)
    return out


def show_pairs(
    split, pairs: list[tuple[int, str, str]], out_png: str | Path, option: str = "--png", cell: int = 224
) -> Path:
    """A montage of given pairs, one cell each: the picture of image `row`, a `header` line, the `caption`
    (e.g. `vse data audit`'s least likely pairs, to check by eye). `split` is a loaded precomp split with
    pictures (`{split}_images.txt`); `out_png` is checked as `show_dataset` checks it, written whole."""
    fmt = picture_format(out_png)
    out = check_output_file(out_png, option, [split.root])
    if split.image_paths is None:
        raise VseInputError(
            f"{split.root} split {split.split!r}: no {split.split}_images.txt, no pictures to show"
        )
    if not pairs:
        raise VseInputError(f"{option} {out_png}: no pairs to show")
    images_file = split.root / f"{split.split}_images.txt"
    cols = math.ceil(math.sqrt(len(pairs)))
    nrows = math.ceil(len(pairs) / cols)
    pad, line_h, max_lines = 8, 16, 8
    font, small = _font(13), _font(11)
    scratch = ImageDraw.Draw(Image.new("RGB", (1, 1)))
    blocks = []
    for _, caption, header in pairs:
        lines = [(header, small, (110, 110, 110))]
        lines += [(part, font, (0, 0, 0)) for part in _wrap(caption, font, cell, scratch)]
        blocks.append(lines[:max_lines])
    row_h = cell + 3 * pad + line_h * max(len(b) for b in blocks)
    sheet = Image.new("RGB", (cols * (cell + 2 * pad), nrows * row_h), (255, 255, 255))
    draw = ImageDraw.Draw(sheet)
    for idx, (row, _, _) in enumerate(pairs):
        x, y0 = (idx % cols) * (cell + 2 * pad) + pad, (idx // cols) * row_h
        # a dataset's picture list is untrusted: inside the images root, a regular file, bounded bytes and pixels
        path = resolve_image_path(split.images_root, split.image_paths[row], f"{images_file}:{row + 1}")
        with open_image(path) as im:
            im = im.convert("RGB")
            scale = cell / max(im.size)  # small pictures up to the cell too, so a face reads by eye
            im = im.resize((max(1, round(im.width * scale)), max(1, round(im.height * scale))))
            sheet.paste(im, (x, y0 + pad))
        y = y0 + 2 * pad + cell
        for text, f, color in blocks[idx]:
            draw.text((x, y), text, font=f, fill=color)
            y += line_h
    with atomic_path(out) as tmp:
        sheet.save(tmp, format=fmt)
    return out
