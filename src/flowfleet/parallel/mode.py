"""How the image bands of a patch-parallel forward see each other (DistriFusion, Li et al. 2024, §4).

    sync       every self-attention layer blocks on an all-gather of this step's keys/values: exact
               (equals the single-device output up to float rounding), pays the full communication.
    displaced  the other bands' keys/values come from the previous step; this step's are gathered
               asynchronously while later layers compute (the paper's displaced patch parallelism).
               The first step and `warmup` more steps run as `sync`.
    naive      bands never exchange activations (the paper's "naive patch" baseline; seams).

Each wrapper in flowfleet.parallel.dit has exactly one code path per mode, chosen by this enum.
"""

from __future__ import annotations

from enum import Enum

from flowfleet.errors import FlowfleetError


class ParallelMode(str, Enum):
    SYNC = "sync"
    DISPLACED = "displaced"
    NAIVE = "naive"

    @classmethod
    def parse(cls, text: "str | ParallelMode") -> "ParallelMode":
        """'sync' | 'displaced' | 'naive' -> ParallelMode; anything else is a one-line FlowfleetError."""
        if isinstance(text, ParallelMode):
            return text
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            names = ", ".join(m.value for m in cls)
            raise FlowfleetError(f"--parallel: unknown mode {text!r} (expected one of {names})") from None

    def at_step(self, step: int, warmup: int) -> "ParallelMode":
        """The mode a step actually runs in: `displaced` is `sync` on step 0 and the `warmup` steps after it."""
        if self is ParallelMode.DISPLACED and step < 1 + warmup:
            return ParallelMode.SYNC
        return self

    @property
    def exchanges(self) -> bool:
        """Whether layers exchange activations at all (False for the naive baseline)."""
        return self is not ParallelMode.NAIVE
