"""diffusers' First Block Cache (FBCache: `transformer.enable_cache(FirstBlockCacheConfig(threshold=...))`)
on a patch-parallel diffusers model.

The cache decides per call whether to run the blocks after the first one: it compares the first block's
residual with the one of the last fully computed call, |r - r_prev|.mean() / |r_prev|.mean() > threshold.
Split over ranks, each rank sees only its band's tokens (and, with CFG split, its half of the batch), so
its own ratio would differ from its neighbours': one rank would skip while another ran the attention
exchanges of the remaining blocks, and the collectives would stall. FBCacheSync makes every rank take the
whole image's decision instead: the two sums of the ratio are summed over all ranks (one all-reduce of
two numbers per call), which is the single-device decision up to float rounding (the counts cancel).

Hand-written: diffusers' hook has no notion of ranks. It patches the decision method of diffusers'
FBCHeadBlockHook instances found on the model (diffusers 0.35.2 and 0.42.1, flowfleet.parallel.registry's
tested range); restore() puts diffusers' own method back. The other cache hooks (pyramid attention
broadcast, FasterCache) decide from the timestep, which every rank shares, and are left as they are.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator

import torch
from diffusers.hooks.first_block_cache import FBCHeadBlockHook

from flowfleet.parallel.comm import CommManager


class FBCacheSync:
    """Every FBCache head hook of `model` decides on the statistics of all ranks (module docstring)."""

    def __init__(self, comm: CommManager):
        self.comm = comm
        self._patched: list[FBCHeadBlockHook] = []
        self._bypass = False
        self.decisions: list[bool] = []  # every call's "run the remaining blocks", in order (for tests, reports)

    def attach(self, model: Any) -> None:
        """Patch the head hooks not yet patched (call before every forward: a cache may be enabled later)."""
        for module in model.modules():
            registry = getattr(module, "_diffusers_hook", None)
            for hook in getattr(registry, "hooks", {}).values():
                if isinstance(hook, FBCHeadBlockHook) and hook not in self._patched:
                    hook._should_compute_remaining_blocks = self._decider(hook)  # an instance attribute
                    self._patched.append(hook)

    def _decider(self, hook: FBCHeadBlockHook):
        def should_compute(residual: torch.Tensor) -> bool:  # mirrors the hook's own method, summed over ranks
            if self._bypass:
                return True
            previous = hook.state_manager.get_state().head_block_residual
            if previous is None:  # the same call on every rank: nothing cached yet
                run = True
            else:
                sums = torch.stack([(residual - previous).abs().sum(), previous.abs().sum()]).double()
                sums = self.comm.sum_world(sums, what="first-block cache decision")
                run = bool((sums[0] / sums[1]).item() > hook.threshold)
            self.decisions.append(run)
            return run

        return should_compute

    @contextmanager
    def bypass(self) -> Iterator[None]:
        """A forward that is not a sampler call (PatchedModel's slot discovery): every block runs, nothing
        is decided or exchanged, and the cache's state is as it was before."""
        saved = []
        for hook in self._patched:
            try:
                state = hook.state_manager.get_state()
            except ValueError:  # no cache context set: the hook itself will say so
                continue
            saved.append((state, dict(vars(state))))
        self._bypass = True
        try:
            yield
        finally:
            self._bypass = False
            for state, values in saved:
                vars(state).update(values)

    def detach(self) -> None:
        for hook in self._patched:
            hook.__dict__.pop("_should_compute_remaining_blocks", None)  # diffusers' own method again
        self._patched = []
