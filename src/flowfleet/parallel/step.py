"""What every layer wrapper of one patched model (U-Net, transformer, VAE decoder) reads: its band, its mode.

diffusers' block forwards cannot carry extra arguments down to a convolution or a GroupNorm, so the
wrappers share one `BandStep` owned by their ParallelUNet (one per model, never module-level), which
sets `mode` and `batch` before each evaluation.

Slots are discovered, not computed: the first evaluation runs once with `recording` set, every wrapper
declares the [per-sample shape] it will exchange, and ParallelUNet registers those slots in forward
order with the CommManager (so its batches follow the order in which layers enqueue them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flowfleet.errors import FlowfleetError
from flowfleet.parallel.bands import band_counts, band_span
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.mode import NormStats, ParallelMode, UNetMode
from flowfleet.parallel.sequence import SequenceMesh


@dataclass
class BandStep:
    comm: CommManager
    index: int  # this rank's band, 0 = top rows
    bands: int  # number of bands (ranks splitting the image)
    mode: UNetMode = UNetMode.SYNC  # the mode of the current evaluation (after warm-up / fallbacks)
    batch: int = 0  # samples in the current evaluation
    recording: "dict[str, tuple[int, ...]] | None" = None  # slot name -> per-sample shape, during recording
    full: "torch.Tensor | None" = None  # the whole latent of this evaluation (layers that embed it: transformers)
    text_tokens: int = 0  # Flux: text tokens ahead of the image tokens in a single-stream block's sequence
    mesh: "SequenceMesh | None" = None  # ulysses / ring / usp: the bands' Ulysses x ring split
    # Uneven bands: every band's size in some unit (tokens, rows, groups of rows) proportional to its size
    # in every layer, so a layer holding n of this band's items finds band r's as sizes[r] * n // sizes[index].
    # () = equal bands.
    sizes: tuple[int, ...] = ()

    def counts(self, n: int) -> list[int]:
        """Every band's item count in a layer where this band has n (uneven bands), in band order."""
        return band_counts(self.sizes or (1,) * self.bands, self.index, n)

    def span(self, total: int) -> tuple[int, int]:
        """(first index, length) of this band's share of `total` rows or tokens of the whole image."""
        return band_span(self.sizes or (1,) * self.bands, self.index, total)

    def cut(self, whole: torch.Tensor, dim: int = -2) -> torch.Tensor:
        """This band's share of a whole-image tensor along `dim` (rows at any level, or tokens): a view."""
        start, length = self.span(whole.shape[dim])
        return whole.narrow(dim, start, length)

    @property
    def exchange(self) -> ParallelMode:
        return self.mode.exchange

    @property
    def norm(self) -> NormStats:
        return self.mode.norm

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.bands - 1

    def declare(self, name: str, shape: tuple[int, ...]) -> None:
        """Note that layer `name` exchanges [batch, *shape] per rank (only while recording)."""
        if self.recording is None:
            return
        if name in self.recording:
            raise FlowfleetError(
                f"U-Net layer {name!r} runs twice in one forward; patch parallelism needs "
                f"one call per layer and evaluation"
            )
        self.recording[name] = tuple(int(s) for s in shape)
