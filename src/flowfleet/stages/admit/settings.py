"""How strict the gate is (GateSettings): its tolerances, the judge of its last check, its seeds and device."""

from __future__ import annotations

from dataclasses import dataclass

from flowfleet.errors import ParameterError


@dataclass(frozen=True)
class GateSettings:
    """How strict the gate is (docs/contributing-experts.md says what each guards against)."""

    ceiling: float = 0.8  # held-out loss below this share of an untrained expert's of the same size
    gap: float = 0.5  # held-out loss at most (1 + gap) x its loss on its own sample
    claimed: float = 0.5  # its loss on its own sample at most (1 + claimed) x the training loss it signed
    velocity_bound: float = 10.0  # velocity RMS on the fleet's held-out latents at most this x the targets'
    harm: float = 0.05  # the grown fleet's loss on the fleet's held-out data may rise by this share, no more
    # The judged no-harm check: "auto" the run's built-in judge where it has one (digits, emoji), a judge by name
    # ("digits", "emoji", MODULE:FACTORY as evaluate --judge takes), or None: the loss alone.
    judge: str | None = "auto"
    judge_n: int = 300  # prompts per judged comparison (the same prompts and noise before and after)
    accuracy_drop: float = 0.02  # on the fleet's held-out prompts its prompt accuracy may fall by this, no more
    fd_rise: float = 0.10  # and its judge's Fréchet distance may rise by this share, no more
    copied: float = 0.1  # the share of a package's items that may be byte-for-byte the fleet's own
    items: int = 256  # items per loss (seeded)
    t_bins: int = 8
    seed: int = 0
    device: str = "auto"

    def validate(self) -> None:
        if self.judge_n < 2:
            raise ParameterError("judge_n", f"a Fréchet distance needs at least 2 samples, got {self.judge_n}")
        for name in ("harm", "accuracy_drop", "fd_rise"):
            if not getattr(self, name) >= 0:
                raise ParameterError(name, f"must be >= 0, got {getattr(self, name)}")
