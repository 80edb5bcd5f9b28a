"""Check 4, learning: on its own held-out slice a lower flow-matching loss with flowfleet's time convention than with
t = 0 as noise; below a share of an untrained expert's loss; neither far above nor far below its loss on its own
latents sample (held out from the same data), which is close to the training loss it signed; its velocities on the
fleet's held-out latents finite and bounded."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowfleet.layout import PACKAGE_EXPERT, PACKAGE_HELDOUT, PACKAGE_SAMPLE
from flowfleet.models.dit import DiTExpert
from flowfleet.stages.admit.losses import expert_velocity, flow_loss, noised, subset
from flowfleet.stages.admit.refusal import Refused

if TYPE_CHECKING:
    from flowfleet.stages.admit.gate import Gate


def check_learning(gate: Gate) -> None:
    s, cfg, f = gate.settings, gate.expert_cfg, gate.figures
    assert cfg is not None
    expert = DiTExpert.from_dit_config(cfg)
    expert.load_state_dict(gate.tensors, strict=True)
    expert = expert.to(gate.device).eval()
    held = subset(gate.items(PACKAGE_HELDOUT)[0], s.items, s.seed)
    sample = subset(gate.items(PACKAGE_SAMPLE)[0], s.items, s.seed)
    gate.reading = PACKAGE_HELDOUT
    f["heldout"] = flow_loss(expert_velocity(expert), held, s, gate.device)
    f["heldout_reversed_time"] = flow_loss(expert_velocity(expert), held, s, gate.device, reverse=True)
    if f["heldout_reversed_time"] < f["heldout"]:
        raise Refused(
            "learning",
            f"{PACKAGE_HELDOUT}: the expert's loss is lower with t = 0 as noise ({f['heldout_reversed_time']:.4f}) "
            f"than with t = 1 as noise ({f['heldout']:.4f}): trained with the time convention reversed",
        )
    with torch.random.fork_rng(devices=[]):  # the untrained reference is seeded; the caller's generator is not
        torch.manual_seed(s.seed)
        untrained = DiTExpert.from_dit_config(cfg).to(gate.device).eval()
    f["untrained_heldout"] = flow_loss(expert_velocity(untrained), held, s, gate.device)
    if not f["heldout"] < s.ceiling * f["untrained_heldout"]:
        raise Refused(
            "learning",
            f"{PACKAGE_HELDOUT}: loss {f['heldout']:.4f} is not below {s.ceiling} x an untrained "
            f"expert's ({f['untrained_heldout']:.4f}): it has not learnt",
        )
    gate.reading = PACKAGE_SAMPLE
    f["sample"] = flow_loss(expert_velocity(expert), sample, s, gate.device)
    if f["heldout"] > (1 + s.gap) * f["sample"]:
        raise Refused(
            "learning",
            f"{PACKAGE_HELDOUT}: loss {f['heldout']:.4f}, over {1 + s.gap} x its loss on its own "
            f"sample ({f['sample']:.4f}): it does not generalise to items it did not see",
        )
    if f["heldout"] * (1 + s.gap) < f["sample"]:  # held out from the same data, it cannot be far easier
        raise Refused(
            "learning",
            f"{PACKAGE_HELDOUT}: loss {f['heldout']:.4f}, under 1/{1 + s.gap} of its loss on its own sample "
            f"({f['sample']:.4f}): the held-out slice is not drawn from the data the sample is",
        )
    claimed = gate.sign.manifest.training.final_loss
    f["signed_training_loss"] = claimed
    if f["sample"] > (1 + s.claimed) * claimed:
        raise Refused(
            "learning",
            f"{PACKAGE_SAMPLE}: the expert's loss on it ({f['sample']:.4f}) is over {1 + s.claimed} x "
            f"the training loss it signed ({claimed:.4f}): the sample is not what it learnt from",
        )
    _bounded(gate, expert, subset(gate.fleet_heldout, s.items, s.seed))


def _bounded(gate: Gate, expert: DiTExpert, probe: dict[str, torch.Tensor]) -> None:
    s = gate.settings
    worst = 0.0
    gate.reading = f"{PACKAGE_EXPERT}/ on the fleet's held-out latents"
    with torch.no_grad():
        for x_t, t, target, cond in noised(probe, s, gate.device):
            v = expert_velocity(expert)(x_t, t, cond)
            if not torch.isfinite(v).all():
                raise Refused(
                    "learning",
                    f"{PACKAGE_EXPERT}: velocities on the fleet's held-out latents at t = {float(t[0]):.3f} are not "
                    "finite",
                )
            worst = max(worst, float(v.pow(2).mean().sqrt() / target.pow(2).mean().sqrt()))
    gate.figures["velocity_rms_over_target"] = worst
    if worst > s.velocity_bound:
        raise Refused(
            "learning",
            f"{PACKAGE_EXPERT}: velocity RMS on the fleet's held-out latents is {worst:.1f} x the targets', over "
            f"{s.velocity_bound}",
        )
