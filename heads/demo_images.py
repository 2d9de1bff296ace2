"""Deterministic generated labelled images for the demo bots (nothing is downloaded).

Each kind is a folder `<root>/<kind>/<label>/*.png` that `multihead train` reads:
  colors - the dominant colour of the picture (5 classes), with grey distractor blobs;
  scenes - a crude landscape: beach, forest, night, snow (4 classes);
  light  - how bright the picture is: dark, dim, bright (3 classes), any pattern and hue.
Every image is a pure function of (kind, label, index, seed). These kinds were chosen because
the demo trunk has random weights: its pooled features keep colour and brightness statistics
but not shape (measured: circle/square/triangle reached 43% held-out accuracy, colours 100%).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 160
PER_CLASS = 40  # training images per class of a demo bot (80% fit, 20% early stopping)
COLORS = {"red": (220, 30, 30), "green": (30, 170, 50), "blue": (30, 60, 220),
          "yellow": (235, 215, 30), "purple": (140, 40, 170)}
# (sky, ground, accent) colours of each scene.
SCENES = {"beach": ((120, 190, 240), (230, 210, 150), (250, 240, 200)),
          "forest": ((150, 190, 150), (40, 110, 40), (90, 60, 30)),
          "night": ((15, 20, 60), (30, 30, 40), (240, 240, 200)),
          "snow": ((200, 210, 225), (245, 245, 250), (120, 130, 140))}
LIGHT = {"dark": (0.05, 0.25), "dim": (0.35, 0.6), "bright": (0.75, 1.0)}
KINDS = {"colors": tuple(COLORS), "scenes": tuple(SCENES), "light": tuple(LIGHT)}


def _jitter(rgb, rng: np.random.Generator, amount: int) -> tuple[int, int, int]:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in rgb)


def _blobs(draw: ImageDraw.ImageDraw, rng: np.random.Generator, colour_of, count) -> None:
    for _ in range(count):
        x, y = (int(v) for v in rng.integers(0, SIZE - 20, 2))
        r = int(rng.integers(6, 30))
        draw.ellipse([x, y, x + r, y + r], fill=colour_of())


def _colors(label: str, rng: np.random.Generator) -> Image.Image:
    image = Image.new("RGB", (SIZE, SIZE), _jitter(COLORS[label], rng, 35))

    def grey():
        g = int(rng.integers(60, 230))
        return (g, g, g)

    _blobs(ImageDraw.Draw(image), rng, grey, int(rng.integers(1, 4)))
    return image


def _scenes(label: str, rng: np.random.Generator) -> Image.Image:
    sky, ground, accent = SCENES[label]
    horizon = int(rng.integers(SIZE // 3, 2 * SIZE // 3))
    image = Image.new("RGB", (SIZE, SIZE), _jitter(sky, rng, 20))
    draw = ImageDraw.Draw(image)
    draw.rectangle([0, horizon, SIZE, SIZE], fill=_jitter(ground, rng, 20))
    _blobs(draw, rng, lambda: _jitter(accent, rng, 20), int(rng.integers(2, 6)))
    return image


def _light(label: str, rng: np.random.Generator) -> Image.Image:
    low, high = LIGHT[label]
    level = float(rng.uniform(low, high))
    hue = rng.uniform(0.6, 1.0, 3)
    image = Image.new("RGB", (SIZE, SIZE), tuple(int(255 * level * h) for h in hue))
    _blobs(ImageDraw.Draw(image), rng,
           lambda: tuple(int(255 * level * v) for v in rng.uniform(0.5, 1.0, 3)),
           int(rng.integers(2, 7)))
    return image


_MAKERS = {"colors": _colors, "scenes": _scenes, "light": _light}


def demo_image(kind: str, label: str, index: int, seed: int = 0) -> Image.Image:
    """One generated image of `label` for the demo bot `kind`."""
    rng = np.random.default_rng([seed, list(KINDS).index(kind), KINDS[kind].index(label), index])
    return _MAKERS[kind](label, rng)


def write_demo_images(root: str | Path, kind: str, per_class: int, *, seed: int = 0) -> Path:
    """Writes `<root>/<kind>/<label>/<i>.png` (missing files only); returns `<root>/<kind>`."""
    folder = Path(root) / kind
    for label in KINDS[kind]:
        (folder / label).mkdir(parents=True, exist_ok=True)
        for index in range(per_class):
            path = folder / label / f"{index:03d}.png"
            if not path.exists():
                demo_image(kind, label, index, seed).save(path)
    return folder
