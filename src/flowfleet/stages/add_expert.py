"""`flowfleet add-expert`: grow a trained fleet with new data.

New data arrives after the fleet is trained (another source, folder or shard set, or classes the run left
out). Because the experts never exchanged anything, none of them has to change:
  1. run.yaml records the addition (`added`: its data block and how many experts it becomes) and the
     router's new number of outputs; this is the one place later stages read it from;
  2. the data is prepared with the run's encoders and clustered into k partitions in added/<n>/, a run
     root of its own (run.yaml, data/, clusters/, partitions/), resumable like `prepare` and `cluster`;
  3. experts K .. K+k-1 train on those partitions, each an isolated job in experts/<k>/ as usual;
  4. the router of the grown fleet (router-k<K+k>/) trains on all data, warm-started from the previous
     router (every weight of equal shape, and its head's rows for the old experts);
  5. the model folder is re-assembled. The old experts' files are never written.

Interrupted, the same command resumes every step where it stopped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from flowfleet.config import Addition, DataConfig, RunConfig, load_run_config
from flowfleet.errors import FlowfleetError
from flowfleet.layout import CLUSTER_REPORT, RUN_FILE
from flowfleet.stages.assemble import assemble
from flowfleet.stages.cluster import cluster
from flowfleet.stages.prepare import prepare
from flowfleet.stages.train import train_expert, train_job
from flowfleet.storage import RunRoot
from flowfleet.train.loop import TrainOptions
from flowfleet.train.specs import run_routers
from flowfleet.train.status import JobStatus

log = logging.getLogger(__name__)


@dataclass
class AddResult:
    addition: int  # n of added/<n>/
    experts: list[int]  # the new experts
    items: int  # items the added data holds
    routers: list[str]  # the grown fleet's router job folders
    model: str  # the re-assembled model folder


def add_expert(
    run_root: str | RunRoot,
    data: DataConfig,
    *,
    k: int = 1,
    options: TrainOptions | None = None,
    progress: bool = True,
    expert: dict[str, Any] | None = None,
) -> AddResult:
    """Prepare `data` with the run's encoders, cluster it into k partitions, train k new experts on them,
    the grown fleet's router, and re-assemble. Re-running with the same data resumes that addition.
    expert: what the new experts change of run.yaml `expert` (its expert_overrides fields), e.g.
    {"objective": "ddpm", "schedule": "linear"}: a ddpm expert added to a flow-matching fleet."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    options = options or TrainOptions(progress=progress)
    if cfg.added and cfg.added[-1] == Addition(data=data, k=k):
        n = len(cfg.added)
        log.info(f"add-expert: resuming addition {n} ({root.origin(n).url})")
    else:
        raw = cfg.to_dict()
        raw["added"] = [*raw["added"], Addition(data=data, k=k).model_dump(mode="json")]
        raw["router"] = {**raw["router"], "num_outputs": cfg.num_experts + k}
        if expert:  # the new experts' own settings, kept in run.yaml like any expert's
            overrides = {int(j): dict(v) for j, v in raw.get("expert_overrides", {}).items()}
            for j in range(cfg.num_experts, cfg.num_experts + k):
                overrides[j] = {**overrides.get(j, {}), **expert}
            raw["expert_overrides"] = overrides
        cfg = RunConfig.from_dict(raw, root.url_of(RUN_FILE) + " (with the addition)")
        n = len(cfg.added)
        cfg.save(root)
        log.info(f"add-expert: run.yaml: addition {n}, experts {cfg.num_experts - k}..{cfg.num_experts - 1}")
    first = cfg.cluster.k + sum(a.k for a in cfg.added[: n - 1])
    new = list(range(first, first + k))

    sub = root.origin(n)
    cfg.addition_config(n).save(sub)
    manifest = prepare(sub, progress=progress)
    if not sub.exists(*CLUSTER_REPORT):
        cluster(sub, progress=progress)

    for e in new:
        _done(train_expert(root, e, options=options))
    routers = []
    for spec in run_routers(cfg):
        _done(train_job(root, spec, options=options))
        routers.append(spec.dir)
    result = assemble(root.url, progress=progress)
    return AddResult(n, new, manifest.count, routers, result.out)


def _done(status: JobStatus) -> None:
    if status.state != "done":
        raise FlowfleetError(
            f"{status.job}: {status.state} at step {status.step}/{status.total_steps}; re-run the same "
            f"`flowfleet add-expert` command to resume"
        )
