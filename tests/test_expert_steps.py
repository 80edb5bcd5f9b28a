"""train.expert_steps: the fleet's K x steps split equally or in proportion to the partitions' sizes."""

from __future__ import annotations

import pytest
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.config import ConfigError, RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.stages.train import train_all
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec, monolith_steps, split_steps
from flowfleet.train.status import read_status
from flowfleet.train.tasks import planned_steps


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
