"""Moving shapes: a procedurally generated video–text set in the frames layout (`vsekit.data.frames`).

Each clip shows one or two coloured shapes; each shape does one thing (moves left/right/up/down, grows,
shrinks, appears, disappears), one after another, and the captions say what happened and in which order
("a red circle moves left, then a blue square grows"), 5–10 paraphrases per clip. A clip is rendered as a
variable number of frames (`frames=(MIN, MAX)`), each frame becomes one feature vector, and so a clip is a
set of frame vectors, which is what the video recipes pool (GPO or average).

Why the rendering has the cues it has: a permutation-invariant pooling sees a set of frames, not a sequence,
so a clip must show in single frames what the captions ask about. Moving shapes leave a fading motion-blur
trail behind them (their direction is visible in one frame), growing or shrinking shapes show a faint outline
of their previous size, and in a two-event clip each frame shows both shapes' states together, so which event
came first is in the set (frames of the first event show the second shape still unchanged). Appear and
disappear are fades and stay mirror images of each other as sets; only their order with another event tells
them apart. Rendering is a pure function of (seed, split, clip index), and the frame count of a clip is drawn
apart from its content, so builds with other `frames` hold the very same clips and captions, only shorter or
longer: the test sets of a frame-count generalisation study.

Features: `efficientnet` runs the EfficientNet-Lite0 extractor of the openclipart and shapes sets
(`vsekit.features.extractor.LiteGridExtractor`) at the frames' 112 px and averages its 3x3 grid into one 1280-d vector per frame; `random-projection`
is a fixed random ReLU projection of the 28x28 frame pixels (256-d by default), milliseconds per clip, for
tests and smoke runs that must not run a CNN.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from vsekit.data.manifest import MANIFEST, write_manifest
from vsekit.data.precomp import CLIP_SPLIT_FILES, write_precomp_split
from vsekit.errors import VseInputError
from vsekit.utils.io import prepare_dataset_dir

log = logging.getLogger(__name__)

FORMAT = "vsekit-moving-shapes/1"
SPLITS = ("train", "dev", "test")
DEFAULT_CLIPS = {"train": 600, "dev": 150, "test": 150}
FEATURE_KINDS = ("efficientnet", "random-projection")
SPLIT_FILES = (*CLIP_SPLIT_FILES, "_clips.jsonl")
IMAGE_SIZE = 112
RANDOM_PROJECTION_DIM = 256
RANDOM_PROJECTION_SEED = 20240531  # fixed: every build's random-projection features live in one space
_SPLIT_CODE = {"train": 1, "dev": 2, "test": 3}

COLORS = {
    "red": (215, 35, 35),
    "green": (35, 155, 50),
    "blue": (35, 70, 215),
    "yellow": (230, 195, 20),
    "purple": (140, 50, 170),
    "orange": (240, 125, 20),
}
SHAPES = ("circle", "square", "triangle", "diamond")
SHAPE_WORDS = {
    "circle": ("circle", "disc", "round shape"),
    "square": ("square", "box", "square shape"),
    "triangle": ("triangle", "triangle", "triangular shape"),
    "diamond": ("diamond", "rhombus", "diamond shape"),
}
ACTIONS = ("left", "right", "up", "down", "grow", "shrink", "appear", "disappear")
VERBS = {
    "left": ("moves left", "slides to the left", "goes left", "travels leftward", "moves to the left"),
    "right": ("moves right", "slides to the right", "goes right", "travels rightward", "moves to the right"),
    "up": ("moves up", "rises", "goes up", "slides upward", "moves upward"),
    "down": ("moves down", "sinks", "goes down", "slides downward", "moves downward"),
    "grow": ("grows", "gets bigger", "expands", "grows larger", "increases in size"),
    "shrink": ("shrinks", "gets smaller", "contracts", "becomes smaller", "decreases in size"),
    "appear": ("appears", "fades in", "shows up", "comes into view", "materialises"),
    "disappear": ("disappears", "fades out", "vanishes", "goes out of view", "fades away"),
}
THEN = ("then", "and then", "after that", "next", "afterwards")
MOVES = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
MOVE_DIST = 0.4  # of the frame width
TRAIL = ((0.12, 0.35), (0.24, 0.15))  # (progress behind, opacity) of the motion-blur ghosts


@dataclass(frozen=True)
class Event:
    """One shape doing one thing; a clip's events happen one after another, in list order."""

    color: str
    shape: str
    action: str
    x: float  # start centre, in frame widths
    y: float
    size: float  # start radius, in frame widths


@dataclass(frozen=True)
class ClipScript:
    events: tuple[Event, ...]
    background: tuple[int, int, int]


def _rng(seed: int, split: str, index: int, stream: int) -> np.random.Generator:
    return np.random.default_rng([seed, _SPLIT_CODE[split], index, stream])


def sample_script(rng: np.random.Generator) -> ClipScript:
    """One or two shapes (different colour or shape), one action each, placed so every action stays in frame."""
    n = 1 if rng.random() < 0.35 else 2
    events: list[Event] = []
    used: set[tuple[str, str]] = set()
    for k in range(n):
        while True:
            color, shape = str(rng.choice(list(COLORS))), str(rng.choice(SHAPES))
            if (color, shape) not in used:
                break
        used.add((color, shape))
        action = str(rng.choice(ACTIONS))
        size = float(rng.uniform(0.09, 0.13)) if action != "shrink" else float(rng.uniform(0.15, 0.2))
        if action == "grow":
            size = float(rng.uniform(0.07, 0.09))
        lo, hi = 0.2, 0.8
        x, y = float(rng.uniform(lo, hi)), float(rng.uniform(lo, hi))
        if n == 2:  # two shapes: one in the upper half, one in the lower, so they rarely cover each other
            y = float(rng.uniform(0.22, 0.4)) if k == 0 else float(rng.uniform(0.6, 0.78))
        if action in MOVES:
            dx, dy = MOVES[action]
            if dx:
                x = float(rng.uniform(0.7, 0.8)) if dx < 0 else float(rng.uniform(0.2, 0.3))
            if dy:
                y = float(rng.uniform(0.7, 0.8)) if dy < 0 else float(rng.uniform(0.2, 0.3))
                if n == 2:  # vertical movers take the whole height; the other shape keeps to one side
                    x = float(rng.uniform(0.15, 0.3)) if k == 0 else float(rng.uniform(0.7, 0.85))
        events.append(Event(color, shape, action, x, y, size))
    if n == 2 and any(e.action in ("up", "down") for e in events):
        a, b = events
        if abs(a.x - b.x) < 0.35:  # keep the two columns apart
            events[1] = Event(b.color, b.shape, b.action, 1.0 - a.x, b.y, b.size)
    background = tuple(int(v) for v in 250 - rng.integers(0, 20, size=3))
    return ClipScript(tuple(events), background)  # type: ignore[arg-type]


def _state(e: Event, p: float) -> tuple[float, float, float, float]:
    """(x, y, radius, opacity) of an event's shape at progress p in [0, 1] (0 before it starts, 1 after)."""
    x, y, r, a = e.x, e.y, e.size, 1.0
    if e.action in MOVES:
        dx, dy = MOVES[e.action]
        x, y = x + dx * MOVE_DIST * p, y + dy * MOVE_DIST * p
    elif e.action == "grow":
        r = e.size * (1 + 1.2 * p)
    elif e.action == "shrink":
        r = e.size * (1 - 0.6 * p)
    elif e.action == "appear":
        a = p
    elif e.action == "disappear":
        a = 1 - p
    return x, y, r, a


def _polygon(shape: str, x: float, y: float, r: float) -> list[tuple[float, float]] | None:
    if shape == "square":
        return [(x - r, y - r), (x + r, y - r), (x + r, y + r), (x - r, y + r)]
    if shape == "triangle":
        return [(x, y - r), (x + r, y + r), (x - r, y + r)]
    if shape == "diamond":
        return [(x, y - r), (x + r, y), (x, y + r), (x - r, y)]
    return None


def _draw(
    d: ImageDraw.ImageDraw, shape: str, x: float, y: float, r: float, fill=None, outline=None, width=1
) -> None:
    poly = _polygon(shape, x, y, r)
    if poly is None:
        d.ellipse([x - r, y - r, x + r, y + r], fill=fill, outline=outline, width=width)
    else:
        d.polygon(poly, fill=fill, outline=outline, width=width)


def render_frame(script: ClipScript, t: float, size: int = IMAGE_SIZE) -> Image.Image:
    """The clip at time t in [0, 1]: event i runs during [i/n, (i+1)/n] of the clip."""
    img = Image.new("RGBA", (size, size), (*script.background, 255))
    n = len(script.events)
    for i, e in enumerate(script.events):
        p = float(np.clip(t * n - i, 0.0, 1.0))
        color = COLORS[e.color]
        layer = Image.new("RGBA", (size, size), (0, 0, 0, 0))
        d = ImageDraw.Draw(layer)
        if e.action in MOVES and 0.0 < p < 1.0:
            for back, opacity in TRAIL:  # fading ghosts where the shape just was
                gx, gy, gr, _ = _state(e, max(0.0, p - back))
                _draw(d, e.shape, gx * size, gy * size, gr * size, fill=(*color, int(255 * opacity)))
        x, y, r, a = _state(e, p)
        _draw(d, e.shape, x * size, y * size, r * size, fill=(*color, int(round(255 * a))))
        if e.action in ("grow", "shrink") and 0.0 < p < 1.0:
            _, _, pr, _ = _state(e, max(0.0, p - TRAIL[0][0]))  # faint outline of the size it just had
            _draw(d, e.shape, x * size, y * size, pr * size, outline=(*color, 110), width=2)
        img = Image.alpha_composite(img, layer)
    return img.convert("RGB")


def frame_times(n_frames: int) -> np.ndarray:
    """Frames sample the whole clip evenly, first and last instant included (one frame: the middle)."""
    return np.linspace(0.0, 1.0, n_frames) if n_frames > 1 else np.array([0.5])


def _phrase(e: Event, rng: np.random.Generator, definite: bool) -> str:
    noun = str(rng.choice(SHAPE_WORDS[e.shape]))
    art = "the" if definite else ("an" if e.color[0] in "aeiou" else "a")
    return f"{art} {e.color} {noun} {rng.choice(VERBS[e.action])}"


def make_captions(script: ClipScript, rng: np.random.Generator, n: int) -> list[str]:
    """`n` different paraphrases that name every event in its order ("..., then ...", "first ..., then ...",
    "... before ...", "... after ...")."""
    out: list[str] = []
    for _ in range(50 * n):
        if len(out) == n:
            break
        evs = script.events
        if len(evs) == 1:
            e = evs[0]
            form = int(rng.integers(3))
            cap = _phrase(e, rng, definite=False)
            if form == 1:
                cap = f"in this clip {cap}"
            elif form == 2:
                cap = f"{cap} on a plain background"
        else:
            a, b = evs
            form = int(rng.integers(4))
            if form == 0:
                cap = f"{_phrase(a, rng, False)}, {rng.choice(THEN)} {_phrase(b, rng, False)}"
            elif form == 1:
                cap = f"first {_phrase(a, rng, False)}, then {_phrase(b, rng, False)}"
            elif form == 2:
                cap = f"{_phrase(a, rng, False)} before {_phrase(b, rng, False)}"
            else:
                cap = f"{_phrase(b, rng, False)} after {_phrase(a, rng, False)}"
        if cap not in out:
            out.append(cap)
    return out


# --------------------------------------------------------------------------------------------- features


class RandomProjectionFeatures:
    """ReLU(W · pixels) of the 28x28 grey+colour frame, W fixed by RANDOM_PROJECTION_SEED: cheap, deterministic
    frame features that keep colour, shape and position (a stand-in for a CNN in tests)."""

    name = "moving_shapes_random_projection"

    def __init__(self, dim: int = RANDOM_PROJECTION_DIM) -> None:
        self.dim = dim
        side = 28
        rng = np.random.default_rng(RANDOM_PROJECTION_SEED)
        self.side = side
        self.w = (rng.normal(size=(side * side * 3, dim)) / np.sqrt(side * side * 3)).astype(np.float32)
        self.b = rng.normal(scale=0.5, size=dim).astype(np.float32)

    def __call__(self, frames: list[Image.Image]) -> np.ndarray:
        x = (
            np.stack(
                [
                    np.asarray(f.resize((self.side, self.side), Image.Resampling.BILINEAR), dtype=np.float32)
                    for f in frames
                ]
            )
            / 255.0
        )
        x = (x - 0.5).reshape(len(frames), -1)
        return np.maximum(x @ self.w + self.b, 0.0)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "dim": self.dim,
            "seed": RANDOM_PROJECTION_SEED,
            "layer": f"relu(W x + b), x = {self.side}x{self.side} RGB in [-0.5, 0.5]",
        }


class EfficientNetFrameFeatures:
    """The openclipart/shapes EfficientNet-Lite0 grid extractor, its grid averaged: one 1280-d vector a frame."""

    def __init__(self, batch_size: int = 16, device: str = "cpu") -> None:
        from vsekit.features.extractor import LiteGridExtractor

        # at the frames' own 112 px (a 3x3 grid): 9x faster on a CPU than openclipart's 224 px, and no upsampling
        self.extractor = LiteGridExtractor(device=device, image_size=IMAGE_SIZE, pooling="mean")
        self.batch_size = batch_size

    def __call__(self, frames: list[Image.Image]) -> np.ndarray:
        import torch

        out = []
        for start in range(0, len(frames), self.batch_size):
            batch = torch.stack([self.extractor.prepare(f) for f in frames[start : start + self.batch_size]])
            out.append(self.extractor.run(batch)[:, 0])  # (n, 1280)
        return np.concatenate(out)

    def describe(self) -> dict:
        spec = self.extractor.describe()  # efficientnet_lite0_grid_mean, one region
        spec.update(frame_size=IMAGE_SIZE)
        return spec


def feature_extractor(kind: str, device: str = "cpu") -> Callable[[list[Image.Image]], np.ndarray]:
    if kind == "efficientnet":
        return EfficientNetFrameFeatures(device=device)
    if kind == "random-projection":
        return RandomProjectionFeatures()
    raise VseInputError(f"unknown --features {kind!r}; choose one of {', '.join(FEATURE_KINDS)}")


# --------------------------------------------------------------------------------------------- build


def _check_args(clips: dict[str, int], frames: tuple[int, int], captions: tuple[int, int]) -> None:
    for split, n in clips.items():
        if split not in SPLITS:
            raise VseInputError(f"unknown split {split!r}; choose from {', '.join(SPLITS)}")
        if n < 1:
            raise VseInputError(f"{split}: needs at least 1 clip, got {n}")
    lo, hi = frames
    if not 1 <= lo <= hi:
        raise VseInputError(f"--frames MIN MAX needs 1 <= MIN <= MAX, got {lo} {hi}")
    lo, hi = captions
    if not 1 <= lo <= hi:
        raise VseInputError(f"--captions MIN MAX needs 1 <= MIN <= MAX, got {lo} {hi}")


def prepare_out_dir(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty folder unless `overwrite`; then remove only the files a moving-shapes build writes."""
    prepare_dataset_dir(out, overwrite, SPLITS, SPLIT_FILES, (MANIFEST,), (".partial",))


def build_moving_shapes(
    out_dir: str | Path,
    clips: dict[str, int] | None = None,
    frames: tuple[int, int] = (6, 16),
    captions: tuple[int, int] = (5, 10),
    features: str = "efficientnet",
    seed: int = 0,
    overwrite: bool = False,
    progress: bool = True,
    device: str = "cpu",
) -> dict:
    """Write the splits of `clips` (split -> clip count) to `out_dir` in the frames layout; returns the manifest.

    Clip i of a split is the same script and captions in every build with the same seed, whatever `frames`,
    `clips` of the other splits or `features`: only its frame count comes from `frames`.
    """
    from vsekit.utils.io import atomic_write_text
    from vsekit.utils.progress import progress_bar

    clips = dict(DEFAULT_CLIPS if clips is None else clips)
    _check_args(clips, frames, captions)
    if features not in FEATURE_KINDS:
        raise VseInputError(f"unknown features {features!r}; choose one of {', '.join(FEATURE_KINDS)}")
    out = Path(out_dir)
    prepare_out_dir(out, overwrite)
    extract = feature_extractor(features, device)
    total = sum(clips.values())
    bar = progress_bar(total=total, desc="moving shapes", unit="clip", enabled=progress)
    stats: dict[str, dict] = {}
    for split in SPLITS:
        if split not in clips:
            continue
        feats, caps, cap2img, ids, scripts = [], [], [], [], []
        n_frames_all = []
        for i in range(clips[split]):
            rng = _rng(seed, split, i, 0)
            script = sample_script(rng)
            k = int(rng.integers(captions[0], captions[1] + 1))
            clip_caps = make_captions(script, rng, k)
            n_frames = int(_rng(seed, split, i, 1).integers(frames[0], frames[1] + 1))
            images = [render_frame(script, float(t)) for t in frame_times(n_frames)]
            feats.append(np.asarray(extract(images), dtype=np.float32))
            caps += clip_caps
            cap2img += [i] * len(clip_caps)
            ids.append(f"{split}{i:05d}")
            n_frames_all.append(n_frames)
            scripts.append(
                {
                    "id": ids[-1],
                    "frames": n_frames,
                    "background": list(script.background),
                    "events": [asdict(e) for e in script.events],
                }
            )
            bar.update(1)
        write_precomp_split(
            out, split, captions=caps, cap2img=cap2img, image_ids=ids, clips=feats, clip_dtype=np.float16
        )
        atomic_write_text(
            out / f"{split}_clips.jsonl", "".join(json.dumps(s, sort_keys=True) + "\n" for s in scripts)
        )
        stats[split] = {"clips": len(ids), "captions": len(caps), "frames": int(sum(n_frames_all))}
        log.info("%s: %d clips, %d captions, %d frames", split, len(ids), len(caps), sum(n_frames_all))
    bar.close()
    manifest = {
        "format": FORMAT,
        "seed": seed,
        "splits": stats,
        "frames_per_clip": list(frames),
        "captions_per_clip": list(captions),
        "frame_size": IMAGE_SIZE,
        "features": features,
        "extractor": extract.describe(),  # type: ignore[attr-defined]
    }
    write_manifest(out, manifest)
    return manifest
