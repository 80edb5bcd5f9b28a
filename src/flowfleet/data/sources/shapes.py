"""The built-in procedural shapes: RGB images of one shape each, captioned by shape, colour, size and place."""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np

from flowfleet.data.sources.base import RawItem, Source

SHAPES_COUNT = 4000  # data.count's default for shapes


class ShapesSource(Source):
    """`count` procedurally drawn shapes (see draw_shape); item i depends only on (seed, i)."""

    kind = "shapes"
    has_labels = True

    def __init__(self, count: int, size: int, seed: int) -> None:
        self.count, self.size, self.seed = count, size, seed
        self.label_names = SHAPES

    def __len__(self) -> int:
        return self.count

    def fingerprint(self) -> dict[str, Any]:
        return {"kind": self.kind, "count": self.count, "size": self.size, "seed": self.seed, "version": SHAPES_VERSION}

    def items(self, start: int = 0) -> Iterator[RawItem]:
        for i in range(start, self.count):
            img, caption, label = draw_shape(self.seed, i, self.size)
            yield RawItem(f"shape-{i:06d}", img, caption, label)


# Drawn by hand with PIL (no library draws captioned toy scenes); item i is a pure function of
# (seed, i), so any position can be regenerated without drawing the ones before it. Bump
# SHAPES_VERSION whenever a change alters the pixels, so old `data/` folders are not resumed.
SHAPES_VERSION = 1
SHAPES = ("circle", "square", "triangle", "diamond", "star", "cross")  # label = index
COLOURS = {
    "red": (220, 40, 40),
    "green": (40, 180, 60),
    "blue": (50, 80, 230),
    "yellow": (240, 220, 40),
    "purple": (150, 60, 200),
    "orange": (250, 140, 20),
    "white": (250, 250, 250),
    "cyan": (40, 210, 220),
}
BACKGROUNDS = {
    "black": (10, 10, 10),
    "gray": (128, 128, 128),
    "white": (245, 245, 245),
    "navy": (20, 30, 90),
    "beige": (225, 210, 170),
}
SIZES = {"small": 0.14, "medium": 0.22, "large": 0.32}  # radius as a fraction of the image side
POSITIONS = {
    "top left": (0.25, 0.25),
    "top": (0.5, 0.25),
    "top right": (0.75, 0.25),
    "left": (0.25, 0.5),
    "centre": (0.5, 0.5),
    "right": (0.75, 0.5),
    "bottom left": (0.25, 0.75),
    "bottom": (0.5, 0.75),
    "bottom right": (0.75, 0.75),
}
_SUPERSAMPLE = 4  # draw 4x larger, then box-filter down: antialiased edges


def _contrast(a: tuple[int, int, int], b: tuple[int, int, int]) -> int:
    return sum(abs(x - y) for x, y in zip(a, b))


def shape_polygon(shape: str, cx: float, cy: float, r: float) -> list[tuple[float, float]]:
    if shape == "square":
        return [(cx - r, cy - r), (cx + r, cy - r), (cx + r, cy + r), (cx - r, cy + r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + r, cy), (cx, cy + r), (cx - r, cy)]
    if shape == "triangle":
        return [(cx, cy - r), (cx + r * 0.95, cy + r * 0.8), (cx - r * 0.95, cy + r * 0.8)]
    if shape == "star":
        pts = []
        for k in range(10):
            a = -np.pi / 2 + k * np.pi / 5
            rad = r if k % 2 == 0 else r * 0.45
            pts.append((cx + rad * np.cos(a), cy + rad * np.sin(a)))
        return pts
    if shape == "cross":
        w = r * 0.35
        return [
            (cx - w, cy - r),
            (cx + w, cy - r),
            (cx + w, cy - w),
            (cx + r, cy - w),
            (cx + r, cy + w),
            (cx + w, cy + w),
            (cx + w, cy + r),
            (cx - w, cy + r),
            (cx - w, cy + w),
            (cx - r, cy + w),
            (cx - r, cy - w),
            (cx - w, cy - w),
        ]
    raise ValueError(shape)


def draw_shape(seed: int, index: int, size: int) -> tuple[np.ndarray, str, int]:
    """Item `index` of the shapes source: (uint8 [size, size, 3], caption, label = shape id)."""
    from PIL import Image, ImageDraw

    rng = np.random.default_rng([seed, index])
    label = int(rng.integers(len(SHAPES)))
    shape = SHAPES[label]
    colour = list(COLOURS)[rng.integers(len(COLOURS))]
    backgrounds = [b for b in BACKGROUNDS if _contrast(BACKGROUNDS[b], COLOURS[colour]) > 150]
    background = backgrounds[rng.integers(len(backgrounds))]
    size_name = list(SIZES)[rng.integers(len(SIZES))]
    position = list(POSITIONS)[rng.integers(len(POSITIONS))]
    s = size * _SUPERSAMPLE
    r = SIZES[size_name] * s
    fx, fy = POSITIONS[position]
    jitter = rng.uniform(-0.04, 0.04, size=2) * s
    cx = float(np.clip(fx * s + jitter[0], r, s - r))  # the whole shape stays inside the image
    cy = float(np.clip(fy * s + jitter[1], r, s - r))
    img = Image.new("RGB", (s, s), BACKGROUNDS[background])
    draw = ImageDraw.Draw(img)
    if shape == "circle":
        draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=COLOURS[colour])
    else:
        draw.polygon(shape_polygon(shape, cx, cy, r), fill=COLOURS[colour])
    img = img.reduce(_SUPERSAMPLE)  # [size, size] box-filtered
    where = "in the centre" if position == "centre" else f"at the {position}"
    caption = f"a {size_name} {colour} {shape} {where} on a {background} background"
    return np.asarray(img, dtype=np.uint8), caption, label
