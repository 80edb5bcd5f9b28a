"""How the image bands of a patch-parallel forward see each other (DistriFusion, Li et al. 2024, §4).

    sync       every self-attention layer blocks on an all-gather of this step's keys/values: exact
               (equals the single-device output up to float rounding), pays the full communication.
    displaced  the other bands' keys/values come from the previous step; this step's are gathered
               asynchronously while later layers compute (the paper's displaced patch parallelism).
               The first step and `warmup` more steps run as `sync`.
    naive      bands never exchange activations (the paper's "naive patch" baseline; seams).
    ulysses    exact sequence parallelism (DeepSpeed-Ulysses): an all-to-all turns every band's tokens of
               all heads into every token of heads/N heads, attention runs on the whole sequence, and an
               all-to-all turns it back (flowfleet.parallel.sequence). Heads must divide by N.
    ring       exact sequence parallelism (Ring attention): queries stay, keys/values travel around the
               ring of bands, each block's attention merged by its log-sum-exp. Any split.
    usp        both (xDiT's Unified Sequence Parallelism): Ulysses inside groups of U consecutive bands,
               ring across the N / U groups. U (the Ulysses degree) must divide N and the heads.

The key/value exchange of every band-parallel self-attention (flowfleet.parallel.attention.BandKV) has
exactly one code path per mode, chosen by this enum.

UNetMode, below, names the patched diffusers models' modes (U-Net, VAE decoder, transformers). The
transformers (PixArt, SD3, Flux) also take `ulysses`, `ring` and `usp`: exact, with no warm-up and no stale
buffers. A U-Net's convolutions need halo rows, so it takes the six modes of the paper's ablation:

A U-Net has three kinds of layers that look across bands: convolutions (halo rows), self-attention
(keys/values) and GroupNorm (statistics). `UNetMode` names one row of the paper's ablation and maps it
onto two smaller enums, each driving one wrapper kind with one code path per member:

    mode          conv halos / self-attention K,V      GroupNorm statistics
    sync          fresh, blocking (ParallelMode.SYNC)   exact, blocking          = single-device model
    displaced     previous step's (DISPLACED)           corrected asynchronous   (the paper's method)
    sync-gn       previous step's (DISPLACED)           exact, blocking          (the paper's "Sync. GN")
    stale-gn      previous step's (DISPLACED)           previous step's global   (the paper's "Stale GN")
    separate-gn   previous step's (DISPLACED)           this band's own          (the paper's "Separate GN")
    naive         none, zero padding (NAIVE)            this band's own, local   (the paper's "naive patch")
    ulysses       transformers only: ULYSSES            (no GroupNorm)           exact sequence parallelism
    ring          transformers only: RING               (no GroupNorm)           exact sequence parallelism
    usp           transformers only: USP                (no GroupNorm)           exact sequence parallelism

Every stale-activation mode (all but `naive` and the sequence-parallel three) runs as `sync` on the first step and
on `warmup` steps after it.
"""

from __future__ import annotations

from enum import Enum
from types import MappingProxyType

from flowfleet.errors import ParameterError


def _parse(cls, text, parameter: str, what: str):
    """A member of the mode enum `cls` from its name (case and - or _ alike), or a one-line FlowfleetError."""
    if isinstance(text, cls):
        return text
    try:
        return cls(str(text).strip().lower().replace("_", "-"))
    except ValueError:
        names = ", ".join(m.value for m in cls)
        raise ParameterError(parameter, f"{what} {text!r} (expected one of {names})") from None


class ParallelMode(str, Enum):
    SYNC = "sync"
    DISPLACED = "displaced"
    NAIVE = "naive"
    ULYSSES = "ulysses"
    RING = "ring"
    USP = "usp"

    @classmethod
    def parse(cls, text: "str | ParallelMode") -> "ParallelMode":
        """'sync' | 'displaced' | 'naive' | 'ulysses' | 'ring' | 'usp' -> ParallelMode; else a one-line
        FlowfleetError."""
        return _parse(cls, text, "parallel", "unknown mode")

    def at_step(self, step: int, warmup: int) -> "ParallelMode":
        """The mode a step actually runs in: `displaced` is `sync` on step 0 and the `warmup` steps after it."""
        if self is ParallelMode.DISPLACED and step < 1 + warmup:
            return ParallelMode.SYNC
        return self

    @property
    def exchanges(self) -> bool:
        """Whether layers exchange activations at all (False for the naive baseline)."""
        return self is not ParallelMode.NAIVE

    @property
    def sequence(self) -> bool:
        """Exact sequence parallelism (ulysses, ring, usp): collectives inside attention, no comm slots."""
        return self in (ParallelMode.ULYSSES, ParallelMode.RING, ParallelMode.USP)


PARALLEL_MODES = tuple(m.value for m in ParallelMode)
# How a fleet's image is split when nothing says (the command line, the server and the library's generate alike):
# the paper's displaced patch parallelism
DEFAULT_PARALLEL = ParallelMode.DISPLACED.value

# The fleet's displaced warm-up: synchronous steps after the first one, wherever a fleet is sampled in
# parallel (generate, serve, ParallelPlan). At the fleet's 20 steps, 2 of 20 synchronous is about the
# paper's share (4 of 50). Diffusers pipelines patched by parallelize() keep the paper's 4 (their 50 steps).
DISPLACED_WARMUP = 1


class NormStats(str, Enum):
    """Which statistics a band's GroupNorm normalises with."""

    EXACT = "exact"  # all bands' fresh statistics, gathered now (blocking)
    CORRECTED = "corrected"  # previous step's global statistics + this band's fresh-minus-previous change
    STALE = "stale"  # previous step's global statistics
    SEPARATE = "separate"  # this band's fresh statistics only (still sent along, never read: see norm.py)
    LOCAL = "local"  # this band's fresh statistics only, no comm slot at all (naive)


class UNetMode(str, Enum):
    SYNC = "sync"
    DISPLACED = "displaced"
    SYNC_GN = "sync-gn"
    STALE_GN = "stale-gn"
    SEPARATE_GN = "separate-gn"
    NAIVE = "naive"
    ULYSSES = "ulysses"
    RING = "ring"
    USP = "usp"

    @classmethod
    def parse(cls, text: "str | UNetMode") -> "UNetMode":
        """'sync' | 'displaced' | 'sync-gn' | 'stale-gn' | 'separate-gn' | 'naive' | 'ulysses' | 'ring' | 'usp'
        -> UNetMode."""
        return _parse(cls, text, "mode", "unknown U-Net parallel mode")

    @property
    def exchange(self) -> ParallelMode:
        """How convolution halos and self-attention keys/values cross bands."""
        return _EXCHANGE[self]

    @property
    def norm(self) -> NormStats:
        """Which statistics GroupNorm uses."""
        return _NORM[self]

    def at_step(self, step: int, warmup: int) -> "UNetMode":
        """The mode sampler step `step` (0-based) runs in: every exchanging mode is `sync` on step 0 and the
        `warmup` steps after it, so the previous-step buffers hold real activations before they are used
        (the exact sequence-parallel modes have no such buffers)."""
        if self.exchange.exchanges and not self.exchange.sequence and step < 1 + warmup:
            return UNetMode.SYNC
        return self


_EXCHANGE = MappingProxyType(
    {
        UNetMode.SYNC: ParallelMode.SYNC,
        UNetMode.DISPLACED: ParallelMode.DISPLACED,
        UNetMode.SYNC_GN: ParallelMode.DISPLACED,
        UNetMode.STALE_GN: ParallelMode.DISPLACED,
        UNetMode.SEPARATE_GN: ParallelMode.DISPLACED,
        UNetMode.NAIVE: ParallelMode.NAIVE,
        UNetMode.ULYSSES: ParallelMode.ULYSSES,
        UNetMode.RING: ParallelMode.RING,
        UNetMode.USP: ParallelMode.USP,
    }
)
# The six rows of the paper's ablation: what a U-Net (and any model with convolutions) takes.
UNET_MODES = tuple(m.value for m in UNetMode if not _EXCHANGE[m].sequence)

_NORM = MappingProxyType(
    {
        UNetMode.SYNC: NormStats.EXACT,
        UNetMode.DISPLACED: NormStats.CORRECTED,
        UNetMode.SYNC_GN: NormStats.EXACT,
        UNetMode.STALE_GN: NormStats.STALE,
        UNetMode.SEPARATE_GN: NormStats.SEPARATE,
        UNetMode.NAIVE: NormStats.LOCAL,
        UNetMode.ULYSSES: NormStats.EXACT,  # never read: only transformers (no GroupNorm) take these modes
        UNetMode.RING: NormStats.EXACT,
        UNetMode.USP: NormStats.EXACT,
    }
)
