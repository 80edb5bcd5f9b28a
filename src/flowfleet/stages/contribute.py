"""`flowfleet contribute KIT --data PATH --out PKG`: a stranger's expert for an existing fleet, trained in isolation.

The contributor's images are prepared with the kit's encoders (its frozen latent space, its text encoder) in a
work folder of their own (PKG.work/, resumable like any run: prepare, cluster into one partition, train-expert),
then packed:

    PKG/
      expert/                config.json + diffusion_pytorch_model.safetensors (the EMA weights)
      latents.safetensors    a capped, seeded sample of the prepared items (latents, text, features, captions):
                             what the fleet's router learns the new expert's share from
      heldout.safetensors    prepared items the expert never trained on (data.holdout): the gate's test set
      manifest.json          every file's sha256, the kit's fingerprint and its fleet's identity, the training record
      manifest.sig           the contributor's Ed25519 signature over manifest.json
      signer.pub             the contributor's public key (the fleet trusts it only if its owner lists it)

No raw image leaves the contributor: the fleet's owner receives latents, text embeddings and the expert.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from typing import Any

import torch
import yaml
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from flowfleet.config import DataConfig, RunConfig
from flowfleet.data.shards import ShardSet, parse_shard, shard_bytes
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.layout import (
    AUTOENCODER,
    AUTOENCODER_RECIPE,
    DATA,
    EVAL_DATA,
    FINAL,
    KIT_RUN,
    METRICS_FILE,
    PACKAGE_EXPERT,
    PACKAGE_HELDOUT,
    PACKAGE_MANIFEST,
    PACKAGE_SAMPLE,
    PACKAGE_SIGNATURE,
    PACKAGE_SIGNER,
    expert_job,
)
from flowfleet.sampling.signing import key_id, load_private, public_line, sign
from flowfleet.stages.cluster import cluster
from flowfleet.stages.kit import Kit, read_kit
from flowfleet.stages.prepare import KIT_LATENT, prepare
from flowfleet.stages.train import train_expert
from flowfleet.storage import RunRoot
from flowfleet.train.loop import TrainOptions

log = logging.getLogger(__name__)

SKIPPED_FIELDS = ("aug_latents", "aug_params")  # augmented copies stay with the contributor
MANIFEST_FORMAT = 2  # 2: the kit's fleet identity signed (a package of format 1 predates it)
PACKAGE_OWN = (PACKAGE_MANIFEST, PACKAGE_SIGNATURE, PACKAGE_SIGNER)  # the files the manifest cannot list


@dataclass
class ContributeResult:
    package: str
    key_id: str
    items: int  # prepared training items
    steps: int
    final_loss: float | None


def contribution_config(kit_dir: RunRoot, kit: Kit, data: DataConfig, steps: int | None, heldout: int) -> RunConfig:
    """The work folder's run.yaml: the kit's run with the contributor's data, one cluster, no monolith."""
    raw = yaml.safe_load(kit_dir.read_bytes(KIT_RUN))
    if (data.image_size, data.channels) != (kit.image_size, kit.image_channels):
        raise ParameterError(
            "data",
            f"images of {data.image_size} px x {data.channels} channels; the kit's fleet draws "
            f"{kit.image_size} px x {kit.image_channels}",
        )
    raw.update(
        name=f"contribution-to-{kit.run_name}",
        data={**data.model_dump(mode="json"), "holdout": heldout},
        added=[],
        removed_experts=[],
        expert_overrides={},
        distill=None,
    )
    raw["cluster"] = {**raw["cluster"], "k": 1, "fine_k": 1, "min_share": 0.0, "caption_residual": False}
    raw["router"] = {**raw["router"], "num_outputs": 1}
    raw["monolith"] = {**raw.get("monolith", {}), "enabled": False}
    if steps is not None:
        raw["train"] = {**raw["train"], "steps": steps, "expert_steps": "equal"}
    return RunConfig.from_dict(raw, kit_dir.url_of(KIT_RUN) + " (with the contribution's data)")


@dataclass(frozen=True)
class ContributeOptions:
    steps: int | None = None  # training steps (None: the kit's run's)
    sample_cap: int = 1024  # items of the latents sample
    heldout: int = 100  # source items held out for the gate (the last ones, as run.yaml data.holdout)
    work: str | None = None  # the work folder (None: OUT.work)
    progress: bool = True


def contribute(
    kit_dir: str, data: DataConfig, out: str, key: str, options: ContributeOptions = ContributeOptions()
) -> ContributeResult:
    """Prepare `data` with the kit's encoders, train one expert on it, and write the signed package to `out`."""
    private = load_private(key)  # before any work: a wrong key is a one-line error now, not after training
    kit_root = RunRoot(kit_dir)
    kit = read_kit(kit_root)
    work_root = RunRoot(options.work or out.rstrip("/") + ".work")
    progress, sample_cap = options.progress, min(options.sample_cap, kit.sample_rows)  # the kit's cap: admit's
    cfg = contribution_config(kit_root, kit, data, options.steps, options.heldout)
    cfg.save(work_root)
    for name in kit.latent_weights:  # the fleet's latent space, frozen (prepare trains none)
        work_root.write_bytes(kit_root.read_bytes(AUTOENCODER, name), AUTOENCODER, name)
    if kit.latent_weights:
        work_root.write_json({KIT_LATENT: kit.fingerprint}, AUTOENCODER, AUTOENCODER_RECIPE)
    manifest = prepare(work_root, progress=progress)
    cluster(work_root, progress=progress)
    status = train_expert(work_root, 0, options=TrainOptions(progress=progress))
    if status.state != "done":
        raise FlowfleetError(f"{work_root.url_of(expert_job(0))}: {status.state}; re-run contribute to resume")
    pkg = RunRoot(out)
    final_loss = _final_loss(work_root)
    _pack(work_root, pkg, sample_cap, cfg.train.seed)
    training = {
        "steps": status.step,
        "items": manifest.count,
        "final_loss": final_loss,
        "objective": cfg.expert.objective,
    }
    signer = sign_package(pkg, private, kit, training)
    return ContributeResult(pkg.url, signer, manifest.count, status.step, final_loss)


def sign_package(pkg: RunRoot, key: Ed25519PrivateKey, kit: Kit, training: dict[str, Any]) -> str:
    """manifest.json for the package's files as they are (their sha256), the kit's fingerprint and the training
    record; manifest.sig over it with `key`; signer.pub. -> the key id. Run again after changing a file, it signs
    the package as it now is."""
    files = {rel: package_sha256(pkg, rel) for rel in package_files(pkg) if rel not in PACKAGE_OWN}
    record = {
        "format": MANIFEST_FORMAT,
        "kit": kit.fingerprint,
        "fleet_id": kit.fleet_id,
        "fleet": kit.run_name,
        "time_convention": TIME_CONVENTION,
        "files": files,
        "training": training,
    }
    body = json.dumps(record, indent=1, sort_keys=True).encode()
    pkg.write_bytes(body, PACKAGE_MANIFEST)
    pkg.write_bytes(sign(key, body), PACKAGE_SIGNATURE)
    pkg.write_bytes(public_line(key.public_key(), "contributor").encode(), PACKAGE_SIGNER)
    return key_id(key.public_key())


def package_files(pkg: RunRoot) -> list[str]:
    """Every file of a package, relative paths ('expert/config.json'), sorted."""
    base = pkg.path().rstrip("/") + "/"
    return sorted(p.removeprefix(base) for p in pkg.fs.find(pkg.path()))


def package_sha256(pkg: RunRoot, rel: str) -> str:
    return hashlib.sha256(pkg.read_bytes(*rel.split("/"))).hexdigest()


def _final_loss(work: RunRoot) -> float | None:
    """The mean of the last logged losses of the expert (the last tenth of its log lines)."""
    lines = work.read_bytes(expert_job(0), METRICS_FILE).decode().splitlines()
    losses = [json.loads(line)["loss"] for line in lines if '"loss"' in line]
    tail = losses[-max(1, len(losses) // 10) :]
    return sum(tail) / len(tail) if tail else None


def _pack(work: RunRoot, pkg: RunRoot, sample_cap: int, seed: int) -> None:
    """The expert, the sample and the held-out slice into the package."""
    for name in work.ls(expert_job(0), FINAL):
        pkg.write_bytes(work.read_bytes(expert_job(0), FINAL, name), PACKAGE_EXPERT, name)
    pkg.write_bytes(_shard_bytes(work, DATA, sample_cap, seed), PACKAGE_SAMPLE)
    if not work.exists(EVAL_DATA):
        raise FlowfleetError(f"{work.url_of(EVAL_DATA)}: missing; --heldout must leave items the expert never saw")
    pkg.write_bytes(_shard_bytes(work, EVAL_DATA, sample_cap, seed), PACKAGE_HELDOUT)


def _shard_bytes(work: RunRoot, folder: str, cap: int, seed: int) -> bytes:
    """Up to `cap` seeded-random items of a prepared shard set as one shard (the fields a fleet reads)."""
    shards = ShardSet(work, folder)
    fields = [f for f in shards.manifest().fields if f not in SKIPPED_FIELDS]
    tensors, captions = shards.load(fields, with_captions=True)
    n = len(captions)
    pick = torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:cap].sort().values
    return shard_bytes({k: v[pick] for k, v in tensors.items()}, [captions[i] for i in pick.tolist()])


def read_shard_file(blob: bytes) -> tuple[dict[str, torch.Tensor], list[str]]:
    """A package's latents.safetensors or heldout.safetensors: (tensors, captions)."""
    tensors, captions = parse_shard(blob)
    rows = len(next(iter(tensors.values()))) if tensors else 0
    return tensors, captions if len(captions) == rows else [""] * rows  # (captions are for people, not the gate)
