"""Turning whatever a source yields (encoded bytes, a PIL image, a uint8 array) into model input.

Every image goes through the same two steps: `open_image` decodes it completely (so a truncated
file fails here, where prepare can skip and list it, not later inside an encoder), and `to_tensor`
centre-crops it to a square, resizes it with PIL's antialiased bicubic filter and scales it to
[-1, 1]. Batched resizes for the feature networks (`resize_batch`) run in torch.
"""

from __future__ import annotations

import io
import warnings

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


class ImageDecodeError(Exception):
    """One item's image cannot be used; prepare skips the item and lists it with this reason."""


def open_image(data: bytes | np.ndarray | Image.Image) -> Image.Image:
    """Fully decoded PIL image from encoded bytes, a uint8 array [H, W] / [H, W, C] or a PIL image."""
    try:
        if isinstance(data, Image.Image):
            img = data
        elif isinstance(data, np.ndarray):
            if data.ndim not in (2, 3) or data.size == 0:
                raise ImageDecodeError(f"array of shape {data.shape} is not an image")
            img = Image.fromarray(np.ascontiguousarray(data.astype(np.uint8, copy=False)))
        elif isinstance(data, (bytes, bytearray, memoryview)):
            if not data:
                raise ImageDecodeError("empty file")
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                img = Image.open(io.BytesIO(bytes(data)))
        else:
            raise ImageDecodeError(f"unsupported image value of type {type(data).__name__}")
        img.load()  # decode now: truncated or corrupt data raises here
    except ImageDecodeError:
        raise
    except UnidentifiedImageError:
        raise ImageDecodeError("not an image in a format PIL can read") from None
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombWarning, Image.DecompressionBombError) as err:
        raise ImageDecodeError(f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}") from None
    if img.width < 1 or img.height < 1:
        raise ImageDecodeError(f"image of size {img.width}x{img.height}")
    return img


BACKGROUND = (255, 255, 255)  # what transparent pixels become: white, as a viewer shows them


def opaque(img: Image.Image) -> Image.Image:
    """The image with any transparency (RGBA, LA, a palette's transparent index) composited over BACKGROUND."""
    if img.mode in ("RGBA", "LA", "PA") or (img.mode == "P" and "transparency" in img.info):
        rgba = img.convert("RGBA")
        return Image.alpha_composite(Image.new("RGBA", rgba.size, (*BACKGROUND, 255)), rgba)
    return img


def square(img: Image.Image, size: int) -> Image.Image:
    """Centre crop to a square, then PIL's antialiased bicubic resize to size x size."""
    w, h = img.size
    side = min(w, h)
    left, top = (w - side) // 2, (h - side) // 2
    img = img.crop((left, top, left + side, top + side))
    return img.resize((size, size), Image.Resampling.BICUBIC) if side != size else img


def to_tensor(img: Image.Image, size: int, channels: int) -> torch.Tensor:
    """[channels, size, size] float32 in [-1, 1]: transparency over white, centre crop to a square, antialiased
    bicubic resize."""
    img = square(opaque(img).convert("L" if channels == 1 else "RGB"), size)
    arr = np.asarray(img, dtype=np.uint8)  # [H, W] or [H, W, 3]
    x = torch.from_numpy(arr.copy()).float()
    x = x.unsqueeze(0) if x.ndim == 2 else x.permute(2, 0, 1)  # [C, H, W]
    return x / 127.5 - 1.0


def resize_batch(images: torch.Tensor, size: int) -> torch.Tensor:
    """[B, C, H, W] -> [B, C, size, size], bilinear (antialiased when shrinking)."""
    if tuple(images.shape[-2:]) == (size, size):
        return images
    shrink = size < min(images.shape[-2:])
    return F.interpolate(images, size=(size, size), mode="bilinear", align_corners=False, antialias=shrink)


def to_rgb(images: torch.Tensor) -> torch.Tensor:
    """[B, 1 | 3, H, W] -> [B, 3, H, W] (grayscale repeated)."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected images [B, 1 or 3, H, W], got shape {tuple(images.shape)}")
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


def to_uint8(images: torch.Tensor) -> torch.Tensor:
    """[-1, 1] floats -> uint8 0..255 (what the FID Inception interface takes)."""
    return ((images.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
