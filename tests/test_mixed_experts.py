"""Experts of different widths and depths in one fleet (run.yaml expert_overrides): configuration,
training jobs, assemble's interface check, sampling with every strategy. The 2-rank DistriFusion runs of
a mixed fleet are in test_parallel_dit.py."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.random_fleet import HashTextEncoder, randomize_, tiny_run_config, write_random_fleet

from flowfleet.config import ConfigError, RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import save_model
from flowfleet.sampling import FleetPipeline
from flowfleet.stages.assemble import assemble
from flowfleet.train.specs import JobSpec, job_cost, monolith_steps

pytestmark = pytest.mark.usefixtures("one_thread")

WIDE = {"hidden_size": 64, "num_heads": 4}  # twice the width of tiny_run_config's experts (32)


def mixed_config(k: int = 3, overrides: dict | None = None) -> RunConfig:
    raw = tiny_run_config(k).model_dump()
    raw["expert_overrides"] = {1: WIDE} if overrides is None else overrides
    return RunConfig.from_dict(raw)


def test_expert_config_applies_the_overrides_to_that_expert_only():
    cfg = mixed_config(3, {1: WIDE, 2: {"depth": 3}})
    assert cfg.expert_config(0) == cfg.expert
    wide, deep = cfg.expert_config(1), cfg.expert_config(2)
    assert (wide.hidden_size, wide.num_heads, wide.depth) == (64, 4, 1)
    assert (deep.hidden_size, deep.depth) == (32, 3)
    for other in (wide, deep):  # the interface every expert shares
        for name in ("input_size", "in_channels", "patch_size", "conditioning", "text_dim", "text_len"):
            assert getattr(other, name) == getattr(cfg.expert, name)
    # A size preset replaces width, depth and heads (but not the patch grid).
    sized = mixed_config(2, {1: {"size": "tiny"}}).expert_config(1)
    assert (sized.hidden_size, sized.depth, sized.num_heads, sized.patch_size) == (128, 4, 4, 2)
    # run.yaml round trip: the keys come back as ints
    again = RunConfig.from_dict(json.loads(json.dumps(cfg.to_dict())))
    assert again.expert_config(1) == wide


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({1: {"patch_size": 4}}, "expert_overrides.1.patch_size: an expert may change only"),
        ({1: {"text_dim": 8}}, "expert_overrides.1.text_dim: an expert may change only"),
        ({5: WIDE}, "expert_overrides.5: no such expert"),
        ({1: {"size": "B/4"}}, r"expert_overrides.1.patch_size: 2 contradicts size 'B/4' \(patch_size 4\)"),
        ({1: {"hidden_size": 62}}, "expert_overrides.1.hidden_size: head dimension must be even"),
    ],
)
def test_bad_overrides_are_one_line_errors_naming_expert_and_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        mixed_config(3, overrides)


def test_jobs_train_each_expert_at_its_own_size_and_the_monolith_matches_their_sum():
    cfg, uniform = mixed_config(3), tiny_run_config(3)
    assert job_cost(cfg, JobSpec("expert", 1)) > 2 * job_cost(cfg, JobSpec("expert", 0))
    assert job_cost(cfg, JobSpec("expert", 0)) == job_cost(uniform, JobSpec("expert", 0))
    assert monolith_steps(cfg, match_compute=True) > monolith_steps(uniform, match_compute=True)


def test_a_mixed_fleet_assembles_and_samples_with_every_strategy(run_root):
    cfg = mixed_config(3)
    write_random_fleet(str(run_root), cfg)
    result = assemble(str(run_root))
    assert result.present == [0, 1, 2]
    configs = [json.loads((run_root / "model" / f"expert_{k}" / "config.json").read_text()) for k in range(3)]
    assert [c["hidden_size"] for c in configs] == [32, 64, 32]
    pipe = FleetPipeline.from_pretrained(result.out, text_encoder=HashTextEncoder(384, 4))
    outs = {}
    for strategy in ("top1", "top2", "full"):
        out = pipe(["a digit", "another digit"], n=2, strategy=strategy, steps=2, seed=3)
        assert out.images.shape == (2, 1, 8, 8) and torch.isfinite(out.images).all()
        outs[strategy] = out.images
    assert 1 in pipe.experts.loads  # the wide expert ran
    assert not torch.equal(outs["top1"], outs["full"])


def test_assemble_refuses_an_expert_whose_interface_differs_naming_expert_and_field(run_root):
    cfg = mixed_config(3)
    write_random_fleet(str(run_root), cfg)
    wide_wrong_text = DiTConfig(**{**cfg.expert_config(1).model_dump(), "text_len": 6})
    save_model(randomize_(DiTExpert.from_dit_config(wide_wrong_text), seed=1), str(run_root), "experts", "1", "final")
    with pytest.raises(FlowfleetError, match=r"expert 1 \(.*\): text_len 6 differs from run.yaml expert.text_len 4"):
        assemble(str(run_root))
