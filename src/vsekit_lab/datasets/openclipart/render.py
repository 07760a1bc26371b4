"""Rasterising: an SVG to an RGBA picture (cairosvg, else rsvg-convert, each under a timeout), cropped to its
content and padded square at 224 px; many in worker processes."""

from __future__ import annotations

import io
import multiprocessing as mp
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np

from vsekit.errors import SetupError
from vsekit.utils.io import atomic_write_bytes
from vsekit.utils.progress import progress_bar

RENDER_VERSION = (
    "cairosvg512-crop-pad5-224-v1"  # part of the feature-cache key: change it when rendering changes
)
RENDER_SIZE = 512
IMAGE_SIZE = 224
MARGIN = 0.05
RENDER_TIMEOUT_S = 30


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
            r = subprocess.run(
                [exe, "-a", "-w", str(size), "-h", str(size), path], capture_output=True, timeout=timeout
            )
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


def render_all(
    jobs: list[tuple[str, str, str]], workers: int, progress: bool, on_result: Callable[[str, str, str], None]
) -> None:
    """Render in `workers` processes (spawned: safe when torch threads exist in the parent)."""
    if not jobs:
        return
    bar = progress_bar(enabled=progress, total=len(jobs), desc="render", unit="img")
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
