"""`flowfleet remove-expert`: take an expert out of a trained fleet.

A contributor leaves, or the data of one cluster must be forgotten. Because the experts never exchanged
anything, only the router saw that data besides the expert itself. So the stage
  1. records the removal in run.yaml (`removed_experts`: the one place every later stage reads it from),
  2. trains a new router from scratch (a warm start would carry the removed data) on the data that is
     left, into its own job folder beside the old one (flowfleet.layout.router_job: router-without-K/),
     with the usual checkpoints, status and resume,
  3. re-assembles the model folder from the remaining experts and the new router,
  4. reports what the fleet can no longer draw (the removed clusters' labels and example captions).

The guarantee: no file of the new model folder depends on the removed expert's data. Its experts never
saw it, its router was trained without it, and the removed expert's weights are not copied. The run root
still holds the removed expert, its partition and the old router until `--purge` deletes them (and the
monolith baseline, trained on all data, until you delete monolith/ and model-monolith/).

Interrupted, the same command resumes: the removal is already in run.yaml and the router job continues
from its newest checkpoint.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from flowfleet.config import RunConfig, load_run_config
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.layout import CLUSTER_REPORT, MONOLITH, ROUTER, ROUTERS, expert_job, origin_partition
from flowfleet.stages.assemble import assemble
from flowfleet.stages.train import train_job
from flowfleet.storage import RunRoot
from flowfleet.train.loop import TrainOptions
from flowfleet.train.specs import router_of_folder, run_routers

log = logging.getLogger(__name__)


@dataclass
class RemoveResult:
    removed: list[int]  # every expert removed from the fleet so far
    model: str  # the re-assembled model folder
    routers: list[str]  # the new router job folders
    lost: dict[str, Any]  # expert -> {"labels": {label: items}, "examples": [captions]} of the removed clusters
    purged: list[str] = field(default_factory=list)  # folders deleted by --purge


def remove_expert(
    run_root: str | RunRoot,
    expert: int,
    *,
    purge: bool = False,
    options: TrainOptions | None = None,
    progress: bool = True,
) -> RemoveResult:
    """Remove `expert` from the fleet: run.yaml, a router trained from scratch without its data, the model
    folder re-assembled. `purge` also deletes its job folder, its partition and the routers that saw it."""
    root = run_root if isinstance(run_root, RunRoot) else RunRoot(run_root)
    cfg = load_run_config(root)
    k_total = cfg.num_experts
    if not 0 <= expert < k_total:
        raise ParameterError(f"expert {expert}", f"run.yaml has {k_total} experts (0..{k_total - 1})")
    before = list(cfg.removed_experts)
    if expert in before:
        log.info(f"remove-expert: expert {expert} is already out of the fleet; finishing its removal")
    else:
        if len(cfg.fleet_experts) == 1:
            raise ParameterError(f"expert {expert}", "the last expert of the fleet cannot be removed")
        cfg = RunConfig.from_dict({**cfg.to_dict(), "removed_experts": sorted([*before, expert])}, root.url)
        cfg.save(root)
        log.info(f"remove-expert: run.yaml removed_experts = {cfg.removed_experts}")

    folders = []
    for spec in run_routers(cfg):
        status = train_job(root, spec, options=options or TrainOptions(progress=progress))
        if status.state != "done":
            raise FlowfleetError(
                f"{status.job}: {status.state} at step {status.step}/{status.total_steps}; "
                f"re-run `flowfleet remove-expert {root.url} --expert {expert}` to resume"
            )
        folders.append(spec.dir)
    result = assemble(root.url, progress=progress)
    lost = _lost(root, cfg, cfg.removed_experts)
    purged = _purge(root, cfg) if purge else []
    if root.exists(MONOLITH):
        log.warning(
            f"remove-expert: {root.url_of(MONOLITH)} (the baseline) was trained on all data, the removed "
            f"experts' too; delete it and model-monolith/ if that data must be gone from the run root"
        )
    return RemoveResult(cfg.removed_experts, result.out, folders, lost, purged)


def _lost(root: RunRoot, cfg: RunConfig, removed: list[int]) -> dict[str, Any]:
    """The removed clusters' label counts and example captions (clusters/report.json), when it has them."""
    lost = {}
    for k in removed:
        n, j = cfg.expert_origin(k)
        sub = root.origin(n)
        report = sub.read_json(*CLUSTER_REPORT) if sub.exists(*CLUSTER_REPORT) else {}
        mix, examples = report.get("label_mix") or [], report.get("examples") or {}
        lost[str(k)] = {"labels": mix[j] if j < len(mix) else {}, "examples": examples.get(str(j), [])}
    return lost


def _purge(root: RunRoot, cfg: RunConfig) -> list[str]:
    """Delete what still holds the removed experts' data: their job folders and partitions, and every
    router folder trained with it (those of an earlier fleet)."""
    keep = {router_of_folder(cfg, name).dir for name in ROUTERS}
    gone = [expert_job(k) for k in cfg.removed_experts]
    for k in cfg.removed_experts:
        gone.append(origin_partition(*cfg.expert_origin(k)))
    gone += [name for name in root.ls() if name.startswith(ROUTER) and name not in keep]
    deleted = []
    for folder in gone:
        if root.exists(folder):
            root.remove(folder, recursive=True)
            deleted.append(folder)
            log.info(f"remove-expert: deleted {root.url_of(folder)}")
    return deleted
