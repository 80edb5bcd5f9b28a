"""GroupNorm on one band of rows, with the statistics of the whole image (DistriFusion, Li et al. 2024, §4, §5.3).

GroupNorm normalises each (sample, group) over all channels of the group and ALL spatial positions, so
a band alone does not know its statistics. Each band computes its own [B, G, 2] (mean, variance) and
the NormStats member of the current mode decides what it normalises with:

    EXACT      gather every band's fresh statistics now (blocking) and pool them
    CORRECTED  stale global statistics + this band's change since the previous step (paper Eq. 2, for
               the mean and the second moment); the fresh statistics are gathered asynchronously
    STALE      the previous step's pooled statistics as they are (gathered asynchronously)
    SEPARATE   this band's own statistics. They (and sync-gn's EXACT ones) are still enqueued (a few
               hundred bytes per layer, never read) so that the batch of comm slots they share with
               convolution halos and attention keys/values leaves as soon as its last layer has run.
    LOCAL      this band's own statistics, no comm slot at all (the naive baseline)

Variances are BIASED (divide by the element count), exactly like torch.nn.GroupNorm, so EXACT equals
the single-device layer up to float rounding. Pooling is the size-weighted mean of the band means and
of (band variance + squared deviation of the band mean), which is the biased variance of the union
without forming E[x^2] - E[x]^2 (no cancellation when |mean| >> std); uneven bands weigh by their sizes.
Statistics are computed in float32 whatever the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from flowfleet.parallel.mode import NormStats, ParallelMode
from flowfleet.parallel.step import BandStep

# --------------------------------------------------------------------------------------------------
#                                 Statistics (pure functions)
# --------------------------------------------------------------------------------------------------


def band_stats(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, C, *spatial] -> [B, G, 2]: each group's (mean, biased variance) over this band, float32."""
    xg = x.reshape(x.shape[0], groups, -1).float()  # [B, G, C/G * spatial]
    var, mean = torch.var_mean(xg, dim=-1, correction=0)  # [B, G] each
    return torch.stack((mean, var), dim=-1)  # [B, G, 2]


def pooled(stats: torch.Tensor, sizes: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """Every band's statistics [N, B, G, 2] -> the whole image's (mean, biased var), [B, G]; bands weighted
    by their sizes (any unit proportional to their element counts; () = equal)."""
    means, variances = stats[..., 0], stats[..., 1]  # [N, B, G]
    w = torch.tensor(sizes or [1] * stats.shape[0], dtype=means.dtype, device=means.device)
    w = (w / w.sum()).view(-1, 1, 1)  # [N, 1, 1]
    mean = (w * means).sum(dim=0)  # [B, G]
    var = (w * (variances + (means - mean).square())).sum(dim=0)  # [B, G]
    return mean, var


def corrected(
    stale: torch.Tensor, fresh: torch.Tensor, me: int, sizes: tuple[int, ...] = ()
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paper Eq. 2 applied to the mean and the second moment, with the negative-variance fallback.

    stale: every band's previous-step statistics [N, B, G, 2]; fresh: this band's [B, G, 2]; me: this band.

        E[A_t]   ~ E[A_t+1]   + (E[A_t^i]   - E[A_t+1^i])                       (mean)
        E[A_t^2] ~ E[A_t+1^2] + (E[A_t^i^2] - E[A_t+1^i^2])                     (second moment)
        Var      = E[A_t^2] - E[A_t]^2

    Writing E[x^2] = Var + mean^2 and d = E[A_t^i] - E[A_t+1^i], the variance simplifies exactly to
        Var ~ Var_t+1 + (Var_t^i - Var_t+1^i) + 2 d (E[A_t+1^i] - E[A_t+1])
    which is what is computed (the same number without subtracting two large second moments).
    Where that estimate is negative, the band's own fresh variance is used (paper §4)."""
    g_mean, g_var = pooled(stale, sizes)  # [B, G]: previous step, whole image
    o_mean, o_var = stale[me, ..., 0], stale[me, ..., 1]  # [B, G]: previous step, this band
    f_mean, f_var = fresh[..., 0], fresh[..., 1]  # [B, G]: this step, this band
    d = f_mean - o_mean
    mean = g_mean + d
    var = g_var + (f_var - o_var) + 2.0 * d * (o_mean - g_mean)
    var = torch.where(var < 0, f_var, var)
    return mean, var


def normalize(x: torch.Tensor, mean: torch.Tensor, var: torch.Tensor, norm: nn.GroupNorm) -> torch.Tensor:
    """torch.nn.GroupNorm's output for x [B, C, *spatial] given its statistics [B, G]."""
    b, g = x.shape[0], norm.num_groups
    xg = x.reshape(b, g, -1).float()  # [B, G, C/G * spatial]
    y = (xg - mean[..., None]) * torch.rsqrt(var[..., None] + norm.eps)  # [B, G, C/G * spatial]
    y = y.reshape(x.shape)  # [B, C, *spatial]
    if norm.affine:
        shape = (1, -1) + (1,) * (x.dim() - 2)
        y = y * norm.weight.float().view(shape) + norm.bias.float().view(shape)
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------------
#                                        The wrapper
# --------------------------------------------------------------------------------------------------


class GroupNormBand:
    """Replaces an nn.GroupNorm's forward: x band [B, C, h, W] (or [B, C, n]) -> normalised band.

    One comm slot of [B, G, 2] per layer; one method per NormStats member."""

    def __init__(self, norm: nn.GroupNorm, name: str, step: BandStep):
        self.norm = norm
        self.slot = f"{name}.stats"
        self.step = step
        self._paths = {
            NormStats.EXACT: self._exact,
            NormStats.CORRECTED: self._corrected,
            NormStats.STALE: self._stale,
            NormStats.SEPARATE: self._separate,
            NormStats.LOCAL: self._local,
        }

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        g = self.norm.num_groups
        self.step.declare(self.slot, (g, 2))
        fresh = band_stats(x, g)  # [B, G, 2]
        mean, var = self._paths[self.step.norm](fresh)  # [B, G] each
        return normalize(x, mean, var, self.norm)

    def _exact(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean_var = pooled(self.step.comm.gather(self.slot, fresh).float(), self.step.sizes)  # blocks: all bands
        if self.step.exchange is ParallelMode.DISPLACED:  # sync-gn: the batch this slot shares must still leave
            self.step.comm.enqueue(self.slot, fresh)  # during the forward (a few hundred bytes, never read)
        return mean_var

    def _corrected(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        stale = self.step.comm.wait(self.slot)[:, : fresh.shape[0]].float()  # [N, B, G, 2], previous step
        mean, var = corrected(stale, fresh, self.step.index, self.step.sizes)  # new tensors: buffer reusable
        self.step.comm.enqueue(self.slot, fresh)  # this step's statistics, for the next step
        return mean, var

    def _stale(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        mean, var = pooled(self.step.comm.wait(self.slot)[:, : fresh.shape[0]].float(), self.step.sizes)  # previous
        self.step.comm.enqueue(self.slot, fresh)
        return mean, var

    def _separate(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.step.comm.enqueue(self.slot, fresh)  # keeps the shared batch on time; nobody reads it
        return fresh[..., 0], fresh[..., 1]

    def _local(self, fresh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return fresh[..., 0], fresh[..., 1]
