"""Which part of the image a rank owns: N contiguous, patch-aligned bands of token rows.

A DiT's tokens are the (H/p) x (W/p) patch grid in row-major order, so a band of whole token rows is
a contiguous slice of the token sequence and a contiguous slice of p-pixel rows of the latent:

    latent rows   [S_r * p, (S_r + R_r) * p)        R_r token rows of band r, S_r = R_0 + ... + R_{r-1}
    tokens        [S_r * W/p, (S_r + R_r) * W/p)

Any N up to H/p: band sizes differ by at most one row (band_sizes). Concatenating the bands of ranks
0..N-1 in order restores the full image and the full sequence.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowfleet.errors import FlowfleetError, ParameterError


@dataclass(frozen=True)
class BandLayout:
    grid_h: int  # token rows of the whole latent (H / p)
    grid_w: int  # token columns (W / p)
    patch: int  # p
    bands: int  # N
    index: int  # this rank's band, 0..N-1

    @classmethod
    def for_latent(cls, input_size: tuple[int, int], patch: int, bands: int, index: int) -> "BandLayout":
        h, w = input_size
        grid_h, grid_w = h // patch, w // patch
        if bands < 1 or not 0 <= index < bands:
            raise FlowfleetError(f"band {index} of {bands}: invalid band layout")
        if grid_h < bands:
            raise ParameterError(
                "nproc",
                f"the latent's {grid_h} token rows ({h} px / patch {patch}) cannot be split into "
                f"{bands} bands; use at most {grid_h} image bands",
            )
        return cls(grid_h, grid_w, patch, bands, index)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Token rows of every band (differing by at most one)."""
        return band_sizes(self.grid_h, self.bands)

    @property
    def rows(self) -> int:
        """Token rows of this band."""
        return self.sizes[self.index]

    @property
    def tokens(self) -> int:
        """Tokens of this band."""
        return self.rows * self.grid_w

    @property
    def token_counts(self) -> list[int]:
        """Tokens of every band; comm slots hold the largest."""
        return [r * self.grid_w for r in self.sizes]

    @property
    def start(self) -> int:
        """This band's first token row."""
        return band_span(self.sizes, self.index, self.grid_h)[0]

    @property
    def token_slice(self) -> slice:
        return slice(self.start * self.grid_w, (self.start + self.rows) * self.grid_w)

    @property
    def pixel_slice(self) -> slice:
        """This band's rows of the latent (dimension -2)."""
        return slice(self.start * self.patch, (self.start + self.rows) * self.patch)

    def split(self, x: torch.Tensor) -> torch.Tensor:
        """[B, C, H, W] -> this band [B, C, R*p, W] (a view)."""
        return x[..., self.pixel_slice, :]


def band_sizes(total: int, bands: int) -> tuple[int, ...]:
    """Split `total` rows (or tokens) into `bands` contiguous bands whose sizes differ by at most one (the
    first total % bands are one larger), in order: any number of bands up to the number of rows."""
    if not 1 <= bands <= total:
        raise FlowfleetError(f"cannot split {total} rows into {bands} bands (at most one band per row)")
    base, extra = divmod(total, bands)
    return tuple(base + (1 if i < extra else 0) for i in range(bands))


def band_span(sizes: tuple[int, ...], index: int, total: int) -> tuple[int, int]:
    """(first index, length) of band `index`'s share of `total` rows or tokens, where `sizes` are every band's
    sizes in any unit proportional to its share (rows of a coarser level, tokens): the one rule every layer of
    a band-parallel model cuts by, so that the cuts of all levels line up."""
    cut = [s * total // sum(sizes) for s in sizes]  # multiply first: exact whatever the unit of sizes
    return sum(cut[:index]), cut[index]


def band_counts(sizes: tuple[int, ...], index: int, n: int) -> list[int]:
    """Every band's item count in a layer where band `index` holds n, in band order (`sizes` as in band_span)."""
    return [s * n // sizes[index] for s in sizes]
