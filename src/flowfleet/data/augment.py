"""Non-leaking augmentation (EDM, Karras et al. 2022, appendix C): more training images per expert
without teaching any model the augmented distribution.

`prepare` writes, beside every training item's latent, `data.augment.copies` latents of the same image
randomly shifted, rotated and scaled (field `aug_latents` [A, C, H, W]) and each copy's parameters (field
`aug_params` [A, AUGMENT_DIM]: dx, dy, angle, scale, each scaled to [-1, 1]). Training (train.augment_p)
replaces each drawn item by one of its copies with probability p and conditions the model on the copy's
parameters (zeros for an original, expert.augment_dim = AUGMENT_DIM); sampling passes none, which is the
unaugmented data's distribution. A copy keeps its original's caption, image features and cluster.

The geometric transform is torch's affine_grid / grid_sample; what is written here is only the draw of
the parameters (one seeded generator per item, so a resumed or split `prepare` writes the same bytes)
and the per-draw choice in training.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from flowfleet.config import AUGMENT_DIM

__all__ = ["AUGMENT_DIM", "choose", "draw_params", "transform"]


def draw_params(positions: list[int], copies: int, seed: int) -> torch.Tensor:
    """[B, copies, AUGMENT_DIM] uniform in [-1, 1]; item i's from its own generator, seeded by (seed, its
    source position), so that its copies do not depend on which batch, shard or part it was encoded in."""
    draws = [np.random.default_rng([seed, pos]).uniform(-1, 1, (copies, AUGMENT_DIM)) for pos in positions]
    return torch.from_numpy(np.stack(draws)).float()


def transform(images: torch.Tensor, params: torch.Tensor, shift: float, rotate: float, scale: float) -> torch.Tensor:
    """images [B, C, S, S] in [-1, 1], params [B, AUGMENT_DIM] -> the images shifted by dx, dy x `shift`
    pixels, rotated by angle x `rotate` degrees and scaled by 1 + scale x `scale` about their centre (the
    ranges of data.augment); what moves in from outside is background (-1)."""
    side = images.shape[-1]
    angle = params[:, 2] * rotate * math.pi / 180  # [B]
    zoom = 1 + params[:, 3] * scale  # [B]
    tx, ty = (params[:, i] * shift * 2 / side for i in range(2))  # [B] in grid units ([-1, 1] spans the side)
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)  # [B, 2, 3]
    grid = F.affine_grid(theta.to(images.dtype), list(images.shape), align_corners=False)
    return F.grid_sample(images + 1, grid, align_corners=False, padding_mode="zeros") - 1


def choose(
    latents: torch.Tensor, copies: torch.Tensor, params: torch.Tensor, p: float, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One training draw: latents [B, C, H, W], their copies [B, A, C, H, W] and parameters [B, A, P] ->
    (x0 [B, C, H, W], augment [B, P]): with probability p an item is replaced by one of its copies, drawn
    uniformly, and carries that copy's parameters; otherwise itself with zeros."""
    b, a = copies.shape[:2]
    dev = latents.device
    use = torch.rand(b, generator=gen, device=dev) < p  # [B]
    which = torch.randint(0, a, (b,), generator=gen, device=dev)  # [B]
    rows = torch.arange(b, device=dev)
    x0 = torch.where(use[:, None, None, None], copies[rows, which], latents)
    augment = torch.where(use[:, None], params[rows, which], torch.zeros((), device=dev))
    return x0, augment
