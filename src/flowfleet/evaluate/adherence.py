"""Prompt adherence for the `shapes` source, measured from the pixels.

A shapes prompt reads "a {size} {colour} {shape} {where} on a {background} background"
(flowfleet.data.sources.draw_shape). For a generated image:

  background  the median colour of the border pixels
  foreground  the median colour of the pixels far from the background; its colour word is the nearest
              colour of the source's palette
  shape       the soft foreground mask (each pixel's position between background and foreground
              colour) is compared with each of the six shapes drawn by the source's own geometry, at the
              radius that matches the mask's area and the centre that matches its centroid; the shape
              with the highest soft IoU wins

A sample adheres when both its colour and its shape match the prompt. The score is the share of
samples that adhere (and, separately, the shares with the right colour and the right shape).

PIL is imported only to draw the reference shapes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

# The source's palette and geometry, so that templates are drawn exactly as the data was.
from flowfleet.data.sources.shapes import COLOURS, SHAPES, shape_polygon

_SUPERSAMPLE = 4
_FAR = 90  # L1 distance (0..765) from the background beyond which a pixel counts as foreground
_PROMPT = re.compile(r"\b(" + "|".join(COLOURS) + r")\s+(" + "|".join(SHAPES) + r")\b")


def parse_prompt(prompt: str) -> tuple[str, str] | None:
    """'a small red star at the top on a black background' -> ('red', 'star'); None if not a shapes prompt."""
    m = _PROMPT.search(prompt.lower())
    return (m.group(1), m.group(2)) if m else None


@dataclass(frozen=True)
class Reading:
    colour: str | None  # None: nothing stands out from the background
    shape: str | None
    iou: float


class ShapeReader:
    """Reads colour and shape off RGB images of the shapes source ([H, W, 3] uint8)."""

    def __init__(self, size: int):
        self.size = size
        self.palette = np.array(list(COLOURS.values()), dtype=np.float64)  # [P, 3]
        self.names = list(COLOURS)
        # Per shape: area / r^2 and the centroid offset / r of a unit drawing (measured from the drawing).
        self.unit = {shape: self._moments(self._draw(shape, 0.0, 0.0, 1.0, big=True)) for shape in SHAPES}

    def _draw(self, shape: str, cx: float, cy: float, r: float, big: bool = False) -> np.ndarray:
        """Soft mask [S, S] in [0, 1]: the shape drawn supersampled, then box-filtered (like the source).
        big: a 256-pixel canvas centred on the shape, for measuring its moments."""
        from PIL import Image, ImageDraw

        s = 256 if big else self.size * _SUPERSAMPLE
        scale = 100.0 if big else _SUPERSAMPLE
        ox = s / 2 if big else 0.0
        cx, cy, r = cx * scale + ox, cy * scale + ox, r * scale
        img = Image.new("L", (s, s), 0)
        draw = ImageDraw.Draw(img)
        if shape == "circle":
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=255)
        else:
            draw.polygon(shape_polygon(shape, cx, cy, r), fill=255)
        if not big:
            img = img.reduce(_SUPERSAMPLE)
        mask = np.asarray(img, dtype=np.float64) / 255.0
        if big:
            mask = mask / scale**2  # area in units of r^2 after the moments below
        return mask

    @staticmethod
    def _moments(mask: np.ndarray) -> tuple[float, float, float]:
        """(area, centroid x offset, centroid y offset) of a unit shape drawn by _draw(big=True)."""
        total = mask.sum()
        ys, xs = np.indices(mask.shape)
        c = mask.shape[0] / 2
        return (
            float(total),
            float((mask * (xs + 0.5 - c)).sum() / total / 100.0),
            float((mask * (ys + 0.5 - c)).sum() / total / 100.0),
        )

    def read(self, image: np.ndarray) -> Reading:
        px = image.reshape(-1, 3).astype(np.float64)  # [H*W, 3]
        h, w = image.shape[:2]
        border = np.concatenate([image[0], image[-1], image[:, 0], image[:, -1]]).astype(np.float64)
        bg = np.median(border, axis=0)  # [3]
        far = np.abs(px - bg).sum(axis=1) > _FAR
        if far.sum() < 2:
            return Reading(None, None, 0.0)
        fg = np.median(px[far], axis=0)  # [3]
        colour = self.names[int(np.argmin(((self.palette - fg) ** 2).sum(axis=1)))]
        d = fg - bg
        alpha = np.clip((px - bg) @ d / max(float(d @ d), 1e-9), 0.0, 1.0).reshape(h, w)  # soft mask [H, W]
        area = alpha.sum()
        ys, xs = np.indices((h, w))
        mx, my = (alpha * (xs + 0.5)).sum() / area, (alpha * (ys + 0.5)).sum() / area
        best, best_iou = None, -1.0
        for shape, (unit_area, ox, oy) in self.unit.items():
            r = float(np.sqrt(area / unit_area))
            tmpl = self._draw(shape, mx - ox * r, my - oy * r, r)  # [H, W]
            iou = float(np.minimum(tmpl, alpha).sum() / max(np.maximum(tmpl, alpha).sum(), 1e-9))
            if iou > best_iou:
                best, best_iou = shape, iou
        return Reading(colour, best, best_iou)


def prompt_adherence(images: torch.Tensor, prompts: Sequence[str]) -> dict[str, Any]:
    """images [N, 3, H, W] in [-1, 1] with their prompts -> shares with the right colour, shape, both.
    Prompts that are not shapes prompts are counted in `unparsed` and left out of the shares."""
    if images.ndim != 4 or images.shape[1] != 3:
        raise ValueError(f"prompt adherence needs RGB images [N, 3, H, W], got {tuple(images.shape)}")
    if len(prompts) != images.shape[0]:
        raise ValueError(f"{images.shape[0]} images but {len(prompts)} prompts")
    reader = ShapeReader(images.shape[-1])
    u8 = ((images.float().cpu().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).numpy()
    colour = shape = both = n = 0
    for img, prompt in zip(u8, prompts):
        want = parse_prompt(prompt)
        if want is None:
            continue
        got = reader.read(img)
        n += 1
        colour += got.colour == want[0]
        shape += got.shape == want[1]
        both += got.colour == want[0] and got.shape == want[1]
    share = (lambda c: c / n) if n else (lambda c: None)
    return {"both": share(both), "colour": share(colour), "shape": share(shape), "n": n, "unparsed": len(prompts) - n}
