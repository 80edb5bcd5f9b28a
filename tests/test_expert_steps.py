"""train.expert_steps: the fleet's K x steps split equally or in proportion to the partitions' sizes; train.split
batch: the batch split instead (DDM's compute matching)."""

from __future__ import annotations

import pytest
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.config import ConfigError, RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.stages.train import describe_matching, train_all
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec, job_cost, monolith_steps, split_steps
from flowfleet.train.status import read_status
from flowfleet.train.tasks import planned_batch, planned_steps


def by_size(cfg: RunConfig, **changes) -> RunConfig:
    raw = cfg.to_dict()
    raw["train"]["expert_steps"] = "by_size"
    raw.update(changes)
    return RunConfig.from_dict(raw, where="test")


def test_split_is_proportional_and_adds_up_to_the_total_exactly():
    counts = [1516, 789, 822, 873]  # the demo's clusters
    shares = [split_steps(12000, counts, j) for j in range(4)]
    assert shares == [4548, 2367, 2466, 2619] and sum(shares) == 12000
    odd = [split_steps(10, [1, 1, 1], j) for j in range(3)]
    assert odd == [3, 3, 4]  # cumulative floors: the rounding lands on the last share, nothing is lost
    for total, sizes in ((7, [5, 2, 9, 1]), (1000, [3, 997]), (12, [1, 1, 1, 1, 1])):
        got = [split_steps(total, sizes, j) for j in range(len(sizes))]
        assert sum(got) == total
        assert all(abs(g - total * s / sum(sizes)) < 1 for g, s in zip(got, sizes))
    with pytest.raises(FlowfleetError, match=r"partition 1: no items"):
        split_steps(10, [4, 0, 6], 1)


def test_by_size_experts_train_their_share_and_the_monolith_the_same_total(run_root):
    equal = synthetic_config(k=3, steps=4, monolith=True)
    cfg = by_size(equal)
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg, per_cluster=[6, 18, 12])
    shares = [planned_steps(root, cfg, JobSpec("expert", k)) for k in range(3)]
    assert shares == [2, 6, 4]  # 3 x 4 steps split 6 : 18 : 12
    assert monolith_steps(cfg) == monolith_steps(equal)  # the same training FLOPs as the equal split
    assert train_all(str(run_root), parallel=1, progress=False).ok
    for k, steps in enumerate(shares):
        status = read_status(root, f"experts/{k}")
        assert status.state == "done" and status.step == status.total_steps == steps
    again = train_all(str(run_root), parallel=1, progress=False)  # done at their own share: nothing re-runs
    assert set(again.results.values()) == {"skipped"}


def test_partitions_without_counts_are_a_one_line_error_naming_the_manifest(run_root):
    cfg = by_size(synthetic_config(k=2))
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg)
    manifest = root.read_json("partitions", "1", "manifest.json")
    del manifest["partition_counts"]  # as an older flowfleet's cluster stage wrote it
    root.write_json(manifest, "partitions", "1", "manifest.json")
    with pytest.raises(FlowfleetError, match=r"partitions/1/manifest.json: no partition_counts .*flowfleet cluster"):
        planned_steps(root, cfg, JobSpec("expert", 1))
    assert planned_steps(root, cfg, JobSpec("expert", 0)) == cfg.train.steps  # equal partitions: equal shares


def test_by_size_with_expert_overrides_is_refused():
    cfg = synthetic_config(k=2)
    with pytest.raises(ConfigError, match=r"train.expert_steps: by_size .*expert_overrides"):
        by_size(cfg, expert_overrides={1: {"depth": 2}})


def split_batch(cfg: RunConfig, expert_steps: str = "equal", **train) -> RunConfig:
    raw = cfg.to_dict()
    raw["train"].update(split="batch", expert_steps=expert_steps, **train)
    return RunConfig.from_dict(raw, where="test")


@pytest.mark.parametrize("expert_steps, batches", [("equal", [4, 4, 4]), ("by_size", [2, 6, 4])])
def test_ddm_split_gives_each_expert_all_the_steps_at_its_share_of_the_batch(run_root, expert_steps, batches):
    """train.split batch (DDM's matching): every expert K x steps, at an equal share of the batch or its cluster's;
    the fleet's FLOPs and so the monolith's steps are Paris' matching's; the trainer draws the share per step."""
    paris = synthetic_config(k=3, steps=4, batch=12, monolith=True)
    cfg = split_batch(paris, expert_steps)
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg, per_cluster=[6, 18, 12])
    experts = [JobSpec("expert", k) for k in range(3)]
    assert [planned_steps(root, cfg, s) for s in experts] == [12, 12, 12]
    assert [planned_batch(root, cfg, s) for s in experts] == batches and sum(batches) == 12
    assert monolith_steps(cfg) == monolith_steps(paris)
    line = describe_matching(root, cfg)
    assert line.startswith("DDM's compute matching: each of the 3 experts") and "12 steps" in line
    assert describe_matching(root, paris).startswith("Paris' compute matching: each of the 3 experts the monolith's")
    # the fleet's FLOPs, counted job by job, equal the monolith's within one of its steps (else train-all refuses)
    fleet = sum(job_cost(cfg, s, planned_steps(root, cfg, s), planned_batch(root, cfg, s)) for s in experts)
    fleet += job_cost(cfg, JobSpec("router"))
    step = job_cost(cfg, JobSpec("monolith"), steps=1)
    assert abs(job_cost(cfg, JobSpec("monolith")) - fleet) < step
    assert train_all(str(run_root), parallel=1, progress=False).ok
    for k, b in enumerate(batches):
        status = read_status(root, f"experts/{k}")
        assert (status.step, status.samples_seen) == (12, 12 * b)


def test_a_batch_share_that_grad_accum_does_not_divide_is_one_line(run_root):
    cfg = split_batch(synthetic_config(k=3, steps=4, batch=12), grad_accum=3)  # shares of 4: not multiples of 3
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg)
    with pytest.raises(FlowfleetError, match=r"expert-0's share of 12 under train.split batch is 4, .*grad_accum 3"):
        planned_batch(root, cfg, JobSpec("expert", 0))
