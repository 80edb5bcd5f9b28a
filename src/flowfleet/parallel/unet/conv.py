"""Convolutions on one band of rows: halo rows from the neighbouring bands (DistriFusion, Li et al. 2024, §4).

A convolution with kernel k, stride s, padding p and dilation d along the height computes output row o
from input rows o*s - p + j*d (j < k). A band owning input rows [r0, r1) (r0, r1 multiples of s) owns
output rows [r0/s, r1/s), which read

    `top`    = p                            rows above the band   (the band above's last p rows)
    `bottom` = max(0, d*(k-1) - p - s + 1)  rows below the band   (the band below's first rows)

so the band input is extended by those halo rows and convolved with zero height padding (width padding
unchanged). At the image's top and bottom edge the halo is zeros, which is the layer's own zero padding.
Every band sends its [first `bottom` rows; last `top` rows] = [B, C, top + bottom, W] in one comm slot;
ParallelMode decides whether the halo is this step's (sync, blocking), the previous step's (displaced)
or zeros (naive: each band padded as if it were the whole image).

The U-Net's first convolution reads the latent itself, which every rank holds in full, so it takes its
halo straight from the input: exact in every mode, no communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from flowfleet.errors import FlowfleetError
from flowfleet.parallel.mode import ParallelMode
from flowfleet.parallel.step import BandStep


@dataclass(frozen=True)
class RowHalo:
    """Input rows a convolution needs above (`top`) and below (`bottom`) a band, and its height stride."""

    top: int
    bottom: int
    stride: int

    @classmethod
    def of(cls, conv: nn.Conv2d) -> "RowHalo":
        k, s, p, d = conv.kernel_size[0], conv.stride[0], _padding(conv)[0], conv.dilation[0]
        return cls(top=p, bottom=max(0, d * (k - 1) - p - s + 1), stride=s)

    @property
    def rows(self) -> int:
        return self.top + self.bottom


def conv_band(conv: nn.Conv2d, x: torch.Tensor) -> torch.Tensor:
    """The convolution of a band already extended by its halo rows: no height padding, the layer's width padding."""
    return F.conv2d(x, conv.weight, conv.bias, conv.stride, (0, _padding(conv)[1]), conv.dilation, conv.groups)


def _padding(conv: nn.Conv2d) -> tuple[int, int]:
    """(rows, columns) of zero padding; "same"/"valid" (a string) would hide how many rows a band needs."""
    if isinstance(conv.padding, str):
        raise ValueError(f"a convolution with padding={conv.padding!r} cannot be split into bands; give row counts")
    return conv.padding[0], conv.padding[1]


def _zeros(x: torch.Tensor, rows: int) -> torch.Tensor:
    return x.new_zeros(*x.shape[:-2], rows, x.shape[-1])  # [B, C, rows, W]


class FirstConvBand:
    """Replaces the U-Net's conv_in: the full latent [B, C, H, W] -> this band's output rows [B, C', h, W]
    (h = H/N, or this band's share of step.sizes for uneven bands)."""

    def __init__(self, conv: nn.Conv2d, step: BandStep):
        self.conv = conv
        self.halo = RowHalo.of(conv)
        self.step = step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        s, halo = self.step, self.halo
        height = x.shape[-2]
        r0, rows = s.span(height)
        r1 = r0 + rows  # this band's input rows
        lo, hi = max(0, r0 - halo.top), min(height, r1 + halo.bottom)
        parts = [_zeros(x, lo - (r0 - halo.top)), x[..., lo:hi, :], _zeros(x, r1 + halo.bottom - hi)]
        return conv_band(self.conv, torch.cat(parts, dim=-2))  # [B, C', rows / stride, W']


class HaloConvBand:
    """Replaces an nn.Conv2d's forward inside the U-Net: band [B, C, h, W] -> [B, C', h/s, W'].

    One comm slot of [B, C, top + bottom, W] per layer; one method per ParallelMode."""

    def __init__(self, conv: nn.Conv2d, name: str, step: BandStep):
        self.conv = conv
        self.name = name
        self.slot = f"{name}.halo"
        self.halo = RowHalo.of(conv)
        self.step = step
        self._paths = {
            ParallelMode.SYNC: self._sync,
            ParallelMode.DISPLACED: self._displaced,
            ParallelMode.NAIVE: self._naive,
        }

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        halo, h = self.halo, x.shape[-2]
        if h < max(halo.top, halo.bottom) or h % halo.stride:
            raise FlowfleetError(
                f"U-Net layer {self.name}: a band of {h} rows cannot feed a convolution needing "
                f"{halo.top} rows above, {halo.bottom} below and stride {halo.stride}; use fewer "
                f"ranks or a larger latent"
            )
        self.step.declare(self.slot, (x.shape[1], halo.rows, x.shape[-1]))
        above, below = self._paths[self.step.exchange](x)  # [B, C, top, W], [B, C, bottom, W]
        return conv_band(self.conv, torch.cat((above, x, below), dim=-2))

    def _edges(self, x: torch.Tensor) -> torch.Tensor:
        """What the neighbours need from this band: [first `bottom` rows; last `top` rows], [B, C, top+bottom, W]."""
        h = x.shape[-2]
        return torch.cat((x[..., : self.halo.bottom, :], x[..., h - self.halo.top :, :]), dim=-2)

    def _split(self, x: torch.Tensor, edges: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every band's edges [N, B, C, top+bottom, W] -> this band's (above, below), zeros at the image edge."""
        s, bottom = self.step, self.halo.bottom
        above = _zeros(x, self.halo.top) if s.first else edges[s.index - 1, :, :, bottom:].to(x.dtype, copy=True)
        below = _zeros(x, bottom) if s.last else edges[s.index + 1, :, :, :bottom].to(x.dtype, copy=True)
        return above, below

    def _sync(self, x):
        return self._split(x, self.step.comm.gather(self.slot, self._edges(x)))  # this step's halos (blocking)

    def _displaced(self, x):
        halos = self._split(x, self.step.comm.wait(self.slot)[:, : x.shape[0]])  # previous step's (copied)
        self.step.comm.enqueue(self.slot, self._edges(x))  # this step's, gathered while later layers compute
        return halos

    def _naive(self, x):
        return _zeros(x, self.halo.top), _zeros(x, self.halo.bottom)
