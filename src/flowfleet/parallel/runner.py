"""The per-step velocity function of a fleet split over N ranks (DistriFusion for routed DiT experts).

At every evaluation (x_t [B, C, H, W] identical on all ranks, t [B], sampler step):

  1. routing: route(x_t, t, step) on every rank, then rank 0's decision is broadcast, so all ranks run the
     same experts on the same samples even where kernels are not bit-reproducible (GPUs);
  2. every selected expert runs patch-parallel on its own samples: each rank embeds and denoises only
     its band of token rows (flowfleet.parallel.dit), self-attention seeing the other bands through the
     plan's ParallelMode. `displaced` runs `sync` on step 0 and `warmup` more steps, and also for an
     expert whose samples' keys/values were not refreshed at the previous evaluation (routing changed);
  3. classifier-free guidance: with N even (and plan.cfg_split), ranks [0, N/2) run the conditional rows
     and ranks [N/2, N) the unconditional rows, each half patch-parallel over N/2 ranks (paper §5.2),
     each with its own branch's experts (guidance over the mixture routes them apart); otherwise every
     rank runs both halves of its band;
  4. one all-gather of the band outputs gives every rank the full velocity for the sampler update.

Each branch's mixture is weighted band by band before the gather and the branches are combined after it
(flowfleet.flow.guided_mixture): ensemble weights and CFG are linear, so this equals the single-device
velocity (flowfleet.sampling.routing.run_selected) up to float rounding.

Each expert layer's comm slot holds every sample of the batch (both CFG halves when they are not
split), indexed by sample, so stale keys/values always belong to the same sample. An expert that runs
on a subset of the samples still all-gathers its whole slot: with per-sample top-k routing the bytes
per step are those of the full batch for every selected expert (the byte counter reports them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import torch

from flowfleet.config import SamplingConfig
from flowfleet.distributed import DistContext
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow.ensemble import dense_weights
from flowfleet.flow.sampler import cfg_combine
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.parallel.bands import BandLayout
from flowfleet.parallel.comm import CommManager
from flowfleet.parallel.dit import PatchParallelDiT, register_dit
from flowfleet.parallel.mode import DISPLACED_WARMUP, ParallelMode
from flowfleet.parallel.sequence import SequenceMesh, check_heads, ulysses_degree

UNGUIDED = SamplingConfig(guidance_scale=1.0)  # scale 1 at every step: no unconditional rows

# The experts of each guidance branch: global expert ids [B, k] int64 and weights [B, k] summing to 1 per sample,
# of the conditional rows, then of the unconditional rows (None, None where the conditional choice serves both: the
# same on every rank, as the settings are, so that nothing more is broadcast)
Routing = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]
RouteFn = Callable[[torch.Tensor, torch.Tensor, int], Routing]  # (x_t [B, C, H, W], t [B], step) -> Routing


@dataclass(frozen=True)
class ParallelPlan:
    """How one image is spread over the ranks."""

    mode: ParallelMode = ParallelMode.SYNC
    warmup: int = DISPLACED_WARMUP  # synchronous steps after the first one (displaced only)
    cfg_split: bool = True  # with guidance and an even rank count, split cond/uncond across rank groups
    # Asynchronous all-gathers are batched up to this many bytes. Small enough that the first layers'
    # keys/values leave early in a step and have long landed when the next step needs them.
    batch_bytes: int = 1 << 20
    ulysses_degree: int | None = None  # usp: Ulysses inside groups of this many bands (None: as many as divide)

    def __post_init__(self):
        object.__setattr__(self, "mode", ParallelMode.parse(self.mode))
        if self.warmup < 0:
            raise ParameterError("warmup", f"must be >= 0, got {self.warmup}")
        if self.batch_bytes < 1:
            raise FlowfleetError(f"batch_bytes: must be >= 1, got {self.batch_bytes}")
        if self.ulysses_degree is not None and self.mode is not ParallelMode.USP:
            raise ParameterError("ulysses_degree", f"only with --parallel usp (got {self.mode.value})")


class PatchParallelRunner:
    """Experts split over the ranks of `ctx` for batches of up to `batch` samples.

    configs: every expert that may run (id -> DiTConfig), so each layer's comm slot is registered once
    up front; get_expert(id) returns the loaded model when it is first needed (lazy stores welcome).
    """

    def __init__(
        self,
        ctx: DistContext,
        configs: Mapping[int, DiTConfig],
        get_expert: Callable[[int], DiTModel],
        plan: ParallelPlan,
        *,
        batch: int,
        guided: bool,
        dtype: torch.dtype = torch.float32,
    ):
        if not configs:
            raise FlowfleetError("no experts to run")
        ids = sorted(configs)
        ref = configs[ids[0]]
        for k in ids[1:]:
            c = configs[k]
            if (c.input_size, c.patch_size, c.in_channels) != (ref.input_size, ref.patch_size, ref.in_channels):
                raise FlowfleetError(
                    f"expert {k}: latent {c.in_channels}x{c.input_size} / patch {c.patch_size} "
                    f"differs from expert {ids[0]}'s {ref.in_channels}x{ref.input_size} / "
                    f"patch {ref.patch_size}"
                )
        self.ctx, self.plan, self.guided = ctx, plan, guided
        self.get_expert = get_expert
        self.batch = batch
        self.split = guided and plan.cfg_split and ctx.world_size % 2 == 0
        self.groups = 2 if self.split else 1
        bands = ctx.subgroups(ctx.world_size // self.groups) if ctx.world_size > 1 else ctx.world
        self.group_index = ctx.rank // bands.size  # 0: conditional rows, 1: unconditional (when split)
        self.layout = BandLayout.for_latent(ref.input_size, ref.patch_size, bands.size, bands.rank)
        self.comm = CommManager(
            bands, ctx.world, device=ctx.device, dtype=dtype, batch_bytes=plan.batch_bytes, timeout_s=ctx.timeout_s
        )
        # A band group of one rank owns the whole image: nothing to exchange, every mode is the plain model.
        self.mode = plan.mode if bands.size > 1 else ParallelMode.NAIVE
        for k in ids:
            check_heads(self.mode, configs[k].num_heads, bands.size, f"expert {k}")
        self.mesh = None  # the sequence-parallel modes' Ulysses x ring split of the bands
        if self.mode.sequence:
            heads = [configs[k].num_heads for k in ids]
            degree = ulysses_degree(self.mode, bands.size, heads, plan.ulysses_degree, "ulysses_degree")
            self.mesh = SequenceMesh.build(bands, degree, ctx.timeout_s)  # collective: every rank, same order
        self.split_text = describe_split(ctx.world_size, self.groups, bands.size, plan.mode, self.mesh)
        self.slot_rows = batch * (2 if guided and not self.split else 1)
        self.expert_ids = ids
        self.num_experts = ids[-1] + 1
        if self.mode.exchanges and not self.mode.sequence:  # sync / displaced: one key/value slot per layer
            for k in ids:
                register_dit(self.comm, expert_name(k), configs[k], self.layout, self.slot_rows)
        self.comm.allocate()
        self._wrapped: dict[int, tuple[DiTModel, PatchParallelDiT]] = {}

    def expert(self, k: int) -> PatchParallelDiT:
        model = self.get_expert(k)
        cached = self._wrapped.get(k)
        if cached is None or cached[0] is not model:  # (re)loaded by a lazy store
            cached = (model, PatchParallelDiT(model, self.comm, expert_name(k), self.layout, self.mesh))
            self._wrapped[k] = cached
        return cached[1]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's tensor on every rank (e.g. the starting noise)."""
        return self.comm.broadcast_world(x, what="starting noise")

    def velocity(
        self,
        cond: Mapping[str, torch.Tensor | None],
        *,
        guidance: SamplingConfig = UNGUIDED,
        route: RouteFn | None = None,
        steps: int | None = None,
        stats: Any = None,
    ) -> "ParallelVelocity":
        """The per-step velocity (x_t, t, step) -> v for one sampling run of up to `batch` samples.

        guidance: the run's guidance scale and the steps it applies to (SamplingConfig.guidance_at).
        steps: the run's step count, so the last step does not prefetch activations nobody will read.
        stats: optional object with .record(expert, rows) called for every expert run (rows incl. CFG)."""
        self.comm.drain()  # a previous run's last gathers must land before their slots are reused
        if route is None and len(self.expert_ids) != 1:
            raise FlowfleetError("a routing function is required for more than one expert")
        given = {k: v for k, v in cond.items() if v is not None}
        return ParallelVelocity(self, given, guidance, route, steps, stats)

    def close(self) -> None:
        self.comm.drain()


def describe_split(
    ranks: int, groups: int, bands: int, requested: ParallelMode, mesh: SequenceMesh | None = None
) -> str:
    """How an image is spread, in one line for the user: CFG groups x bands, and the mode that runs."""
    halves = "the 2 CFG halves on 2 rank groups" if groups == 2 else "both CFG halves (or none) on every rank"
    text = f"{ranks} ranks: {halves}, each image in {bands} band(s)"
    if bands == 1:
        one = "one band holds every token: --guidance-scale 1 or twice the ranks splits it"
        return f"{text}; no {requested.value} split ({one})"
    if requested is ParallelMode.USP and mesh is not None:
        return f"{text} (usp: {mesh.describe()})"
    return f"{text} ({requested.value})"


def expert_name(k: int) -> str:
    return f"expert{k}"


class ParallelVelocity:
    """(x_t, t, step) -> v for the sampler; see the module docstring for what one call does."""

    def __init__(
        self,
        runner: PatchParallelRunner,
        cond: dict[str, torch.Tensor],
        guidance: SamplingConfig,
        route: RouteFn | None,
        steps: int | None,
        stats: Any = None,
    ):
        self.r = runner
        self.stats = stats
        self.cond = cond
        self.guidance = guidance
        # This evaluation's scale (guidance.guidance_at). The bands' layout is fixed for the run, so with guidance
        # an unguided step (outside the guided interval) still runs the unconditional rows, combined at scale 1.
        self.guidance_scale = float(guidance.guidance_scale)
        self.route = route
        self.steps = steps
        self.evals = 0
        # Per expert and slot row: the evaluation whose keys/values the receive buffer holds.
        self._fresh_at: dict[int, torch.Tensor] = {}
        self.modes: list[dict[int, ParallelMode]] = []  # per evaluation: the mode each expert ran in

    def __call__(self, x: torch.Tensor, t: torch.Tensor, step: int) -> torch.Tensor:
        r = self.r
        b = x.shape[0]
        if b > r.batch:
            raise FlowfleetError(f"batch of {b} samples exceeds the parallel runner's {r.batch}")
        self.evals += 1
        self.guidance_scale = self.guidance.guidance_at(float(t[0]))
        r.comm.begin_step(step)
        mode = r.mode.at_step(step, r.plan.warmup)
        routing = self._routing(x, t, step)
        x_band = r.layout.split(x)  # [B, C, R*p, W]
        # the branches this rank runs: its CFG half's (split), both, or (unguided) the conditional one
        branches = [r.group_index] if r.split else [0, 1] if r.guided else [0]
        selections = [(routing[2 * i], routing[2 * i + 1]) for i in branches]
        dense = [dense_weights(e, w, r.num_experts) for e, w in selections]  # [B, K] per branch
        accs = [torch.zeros_like(x_band) for _ in branches]
        ran: dict[int, ParallelMode] = {}
        used = torch.unique(torch.cat([e.flatten() for e, _ in selections])).tolist()
        for k in used:  # ascending: the same order on every rank of a band group
            rows = [(e == k).any(dim=1).nonzero(as_tuple=True)[0] for e, _ in selections]  # [n_k] per branch
            v, ran[k] = self._run_expert(k, x_band, t, rows, mode, step)
            if self.stats is not None:
                self.stats.record(k, sum(int(rk.numel()) for rk in rows))
            for acc, w, rk, vk in zip(accs, dense, rows, v.split([int(rk.numel()) for rk in rows])):
                acc.index_add_(0, rk, w[rk, k].to(vk.dtype).reshape(-1, 1, 1, 1) * vk)
        self.modes.append(ran)
        acc = cfg_combine(accs[0], accs[1], self.guidance_scale) if len(accs) == 2 else accs[0]
        halves = r.comm.gather_image(acc, [rows * r.layout.patch for rows in r.layout.sizes], what="step output")
        if r.split:
            return cfg_combine(halves[0], halves[1], self.guidance_scale)
        return halves[0]

    # ----------------------------------------------------------------------------------------------

    def _routing(self, x: torch.Tensor, t: torch.Tensor, step: int) -> tuple[torch.Tensor, ...]:
        """Rank 0's routing on every rank: (experts, weights) of the conditional, then of the unconditional rows."""
        b = x.shape[0]
        if self.route is None:
            only = torch.full((b, 1), self.r.expert_ids[0], dtype=torch.long, device=x.device)
            one = torch.ones(b, 1, dtype=x.dtype, device=x.device)
            return only, one, only, one
        parts = [p for p in self.route(x, t, step) if p is not None]
        widths = [part.shape[1] for part in parts]
        packed = torch.cat([part.double() for part in parts], dim=1)  # [B, 2k (+ 2k')]: one broadcast
        packed = self.r.comm.broadcast_world(packed, what="routing decision")
        got = packed.split(widths, dim=1)
        experts, weights = [e.round().long() for e in got[::2]], [w.to(x.dtype) for w in got[1::2]]
        return experts[0], weights[0], experts[-1], weights[-1]

    def _run_expert(
        self, k: int, x_band: torch.Tensor, t: torch.Tensor, rows: list[torch.Tensor], mode: ParallelMode, step: int
    ) -> tuple[torch.Tensor, ParallelMode]:
        """Expert k on this rank's rows of each branch it runs ([conditional; unconditional] when both, or its
        CFG half's), patch-parallel -> the band velocities of those rows, in that order."""
        r = self.r
        both = torch.cat(rows)  # [n_c + n_u]
        xk, tk = x_band[both], t[both]
        ck = {name: c[both] for name, c in self.cond.items()}
        drop = None
        slot_rows = both
        if r.guided and not r.split:  # [cond rows; uncond rows] in one batch; uncond rows live in the slot's 2nd half
            slot_rows = torch.cat([rows[0], rows[1] + r.batch])
            drop = torch.arange(both.numel(), device=xk.device) >= rows[0].numel()
        elif r.guided:  # this rank group runs one half of the CFG batch
            drop = torch.full((both.numel(),), r.group_index == 1, dtype=torch.bool, device=xk.device)
        fresh = self._fresh_at.setdefault(k, torch.full((r.slot_rows,), -2, dtype=torch.long))
        if mode is ParallelMode.DISPLACED and not bool((fresh[slot_rows.cpu()] == self.evals - 1).all()):
            mode = ParallelMode.SYNC  # no previous-step keys/values for (some of) these rows
        prefetch = self.steps is None or step < self.steps - 1
        v = r.expert(k)(xk, tk, mode=mode, rows=slot_rows, prefetch=prefetch, drop=drop, **ck)
        if mode is ParallelMode.SYNC or (mode is ParallelMode.DISPLACED and prefetch):
            fresh[slot_rows.cpu()] = self.evals
        return v, mode
