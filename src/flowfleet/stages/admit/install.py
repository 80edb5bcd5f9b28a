"""What admission writes into the run, from the private copy only (the bytes the checks read), before its last check
and how it is taken back: run.yaml's addition with its signed contribution, added/<n>/ (the sample as the addition's
data and one partition), experts/<K>/ (the weights, finished at the signed steps, the signed manifest)."""

from __future__ import annotations

import hashlib

import torch

from flowfleet.config import EXPERT_OVERRIDABLE, Contribution, DataConfig, RunConfig
from flowfleet.data.shards import ShardSet, ShardSetManifest
from flowfleet.layout import (
    CANDIDATE,
    CLUSTER_REPORT,
    CONTRIBUTION,
    CONTRIBUTION_SIG,
    DATA,
    FINAL,
    PACKAGE_EXPERT,
    RUN_FILE,
    STATUS_FILE,
    addition,
    expert_job,
    partition,
)
from flowfleet.models.config import DiTConfig
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.stages.admit.signature import Signed
from flowfleet.storage import RunRoot
from flowfleet.train.status import JobStatus

EXPERT_FILES = ("config.json", WEIGHTS_NAME)


class Installed:
    """The contribution staged into the run as addition n, expert K; undo() takes all of it back."""

    def __init__(self, root: RunRoot, cfg: RunConfig):
        self.root, self.before = root, cfg
        self.cfg = cfg
        self.folders: list[str] = []
        self.jobs: list[str] = []

    def add(
        self,
        source: str,
        staged: RunRoot,
        sample: tuple[dict[str, torch.Tensor], list[str]],
        signed: Signed,
        expert: DiTConfig,
    ) -> int:
        """run.yaml with the addition, added/<n>/, experts/<K>/ from the private copy `staged`; -> K. `source`: where
        the package came from (run.yaml records it)."""
        root, cfg = self.root, self.before
        k, n = cfg.num_experts, len(cfg.added) + 1
        training = signed.manifest.training
        contribution = Contribution(
            signer=signed.signer,
            manifest_sha256=hashlib.sha256(signed.body).hexdigest(),
            package=source,
            steps=training.steps,
            items=training.items,
        )
        raw = cfg.to_dict()
        data = DataConfig(source="folder", path=source, image_size=cfg.data.image_size, channels=cfg.data.channels)
        raw["added"] = [
            *raw["added"],
            {"data": data.model_dump(mode="json"), "k": 1, "contribution": contribution.model_dump()},
        ]
        raw["router"] = {**raw["router"], "num_outputs": k + 1}
        base, mine = cfg.expert.model_dump(exclude={"size"}), expert.model_dump(exclude={"size"})
        changes = {key: v for key, v in mine.items() if key in EXPERT_OVERRIDABLE and v != base.get(key)}
        if changes:
            raw["expert_overrides"] = {**raw.get("expert_overrides", {}), k: changes}
        self.cfg = RunConfig.from_dict(raw, root.url_of(RUN_FILE) + " (with the contribution)")
        self.folders += [addition(n), expert_job(k)]
        sub = root.origin(n)
        self.cfg.addition_config(n).save(sub)
        write_items(sub, *sample)
        job = RunRoot(root.url_of(expert_job(k)))
        for name in EXPERT_FILES:  # what `what` checked, nothing else of the package
            job.write_bytes(staged.read_bytes(PACKAGE_EXPERT, name), FINAL, name)
        job.write_bytes(signed.body, FINAL, CONTRIBUTION)
        job.write_bytes(signed.signature, FINAL, CONTRIBUTION_SIG)
        status = JobStatus(
            job=expert_job(k),
            state="done",
            step=training.steps,
            total_steps=training.steps,
            last_loss=training.final_loss,
            message=f"contributed, signed by {signed.signer}",
        )
        job.write_json(status.to_dict(), STATUS_FILE)
        self.cfg.save(root)
        return k

    def undo(self) -> None:
        for folder in [*self.folders, *self.jobs, CANDIDATE]:
            self.root.remove(folder, recursive=True)


def write_items(sub: RunRoot, tensors: dict[str, torch.Tensor], captions: list[str]) -> None:
    """A package's sample as an addition's prepared data/, its one cluster and its one partition."""
    from flowfleet.cluster.assignments import write_assignments

    n = len(captions)
    for folder, extra in ((DATA, {}), (partition(0), {"partition": 0, "partition_counts": [n]})):
        write_shards(sub, folder, tensors, captions, extra)
    write_assignments(sub, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    sub.write_json({"k": 1, "count": n, "sizes": [n], "examples": {"0": captions[:5]}}, *CLUSTER_REPORT)


def write_shards(
    root: RunRoot, folder: str, tensors: dict[str, torch.Tensor], captions: list[str], extra: dict
) -> None:
    """A package's items (its sample, its held-out slice) as a complete shard set root/folder."""
    shards = ShardSet(root, folder)
    manifest = ShardSetManifest(extra={"contributed": True, **extra})
    shards.append(manifest, {**tensors, "index": torch.arange(len(captions))}, captions)
    manifest.complete = True
    shards.write_manifest(manifest)
