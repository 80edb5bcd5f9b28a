"""`flowfleet admit RUN_ROOT PKG --trusted KEYS`: the gate a contributed expert passes before it serves anyone.

The checks run in this order and the first failure refuses the package in one line naming the file or field
(Refused); nothing of the run changes until the last one passes:

  1. who      manifest.sig is a signature over manifest.json by a key on the owner's list; every file of the
              package is in the manifest, with the sha256 it says (nothing added, nothing changed after signing)
  2. what     safetensors and JSON only (nothing pickle-capable is read); config.json within the kit's parameter
              cap, counted on the meta device, and the weights' file size checked, before any weight is read;
              the weights in an allowed dtype and finite
  3. fits     the fleet's latent channels and size, text width and length, time convention, an accepted
              objective, only what an expert may change (EXPERT_OVERRIDABLE), the kit's fingerprint as this
              run computes it now; a sample and held-out slice that are not the fleet's own data
  4. learnt   on its own held-out slice: a lower flow-matching loss with flowfleet's time convention than with
              t = 0 as noise; below a share of an untrained expert's loss; neither far above nor far below its
              loss on its own latents sample (held out from the same data), which is close to the training loss
              it signed; its velocities on the fleet's held-out latents finite and bounded
  5. no harm  the grown fleet (the addition recorded, the router trained warm-started as add-expert does,
              assembled into model-candidate/): its routed flow-matching loss on the fleet's held-out data within
              `harm` of the fleet's before, and lower than the fleet's before on the contribution's held-out slice;
              where a judge reads the fleet's prompts (the built-in digits' or emoji's, or --judge), the images too:
              on the fleet's held-out prompts (against their images) its prompt accuracy falls by at most
              `accuracy_drop` and its judge's Fréchet distance rises by at most `fd_rise`; on the contribution's
              held-out prompts (those the judge names) both are better than the fleet's before

Then the expert joins: run.yaml records the contribution (signer, manifest digest), model/ is assembled with it,
its folder keeps the signed manifest (listed in SHA256SUMS), card.json names the signer. A refused package leaves
run.yaml, model/ and every job folder as they were.

The loss is the papers' training objective (velocity MSE, condition on) at fixed t bins and noise, the same for
every model compared on the same items; guidance is off (scale 1). It needs no image and no judge: only the
package's latents and the fleet's own held-out data (eval/, or data/ when the run holds none out). The judged
comparison samples both fleets as they serve (their default strategy and settings) on one draw of prompts and
noise (flowfleet.stages.evaluate.JudgedDraw), the real images of the contribution's slice decoded from its latents:
it too needs none of the contributor's images.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import posixpath
import tempfile
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator

import safetensors.torch
import torch

from flowfleet.config import EXPERT_OVERRIDABLE, Contribution, DataConfig, RunConfig, load_run_config
from flowfleet.data.shards import ShardSet, ShardSetManifest, ShardSetUnion
from flowfleet.device import resolve_device
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.views import captioned_grid_png
from flowfleet.flow.path import TIME_CONVENTION, interpolate, target_velocity
from flowfleet.layout import (
    CANDIDATE,
    CLUSTER_REPORT,
    CONTRIBUTION,
    CONTRIBUTION_SIG,
    CONTRIBUTIONS,
    DATA,
    EVAL_DATA,
    FINAL,
    MODEL,
    PACKAGE_EXPERT,
    PACKAGE_HELDOUT,
    PACKAGE_MANIFEST,
    PACKAGE_SAMPLE,
    PACKAGE_SIGNATURE,
    RUN_FILE,
    STATUS_FILE,
    addition,
    expert_job,
    partition,
)
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import WEIGHTS_NAME, validated
from flowfleet.sampling.index import read_model_index
from flowfleet.sampling.pipeline import FleetPipeline
from flowfleet.sampling.routing import Condition
from flowfleet.sampling.signing import read_trusted, signed_by
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.stages.assemble import assemble
from flowfleet.stages.contribute import PACKAGE_OWN, package_files, package_sha256, read_shard_file
from flowfleet.stages.evaluate import EvaluateOptions, JudgedDraw
from flowfleet.stages.kit import Kit, parameter_count, run_kit
from flowfleet.stages.train import train_job
from flowfleet.storage import RunRoot
from flowfleet.train.data import derive_seed
from flowfleet.train.loop import TrainOptions
from flowfleet.train.preview import condition_kwargs
from flowfleet.train.specs import run_routers
from flowfleet.train.status import JobStatus

log = logging.getLogger(__name__)

CONFIG_MAX_BYTES = 64 << 10
HEADER_MAX_BYTES = 1 << 20  # a safetensors header above this is not a DiT's
BYTES_PER_PARAM = {"float32": 4, "bfloat16": 2, "float16": 2}
CONDITION_FIELDS = ("text_tokens", "text_mask", "text_pooled", "labels")
GRID_ROW = 8  # samples per row of the judged comparison's picture


class Refused(FlowfleetError):
    """The gate's answer to a package it does not admit: one line, the check, the file or field, why."""

    def __init__(self, check: str, message: str):
        super().__init__(f"refused ({check}): {message}")
        self.check = check


class _RefusedWhat(Refused):
    """A config.json that is not a DiT's (models.files.validated raises it with its one line)."""

    def __init__(self, message: str):
        super().__init__("what", message)


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
            raise FlowfleetError(f"--judge-n: a Fréchet distance needs at least 2 samples, got {self.judge_n}")
        for name in ("harm", "accuracy_drop", "fd_rise"):
            if not getattr(self, name) >= 0:
                raise FlowfleetError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(self, name)}")


@dataclass
class AdmitResult:
    expert: int  # its number in the grown fleet
    signer: str  # key id
    manifest_sha256: str
    model: str  # the re-assembled model folder
    figures: dict[str, float] = field(default_factory=dict)  # every loss the gate measured
    grid: str | None = None  # reports/contributions/expert_<k>.png: the judged samples before and after

    def lines(self) -> list[str]:
        return [f"{k}: {v:.4f}" for k, v in self.figures.items()]


# --------------------------------------------------------------------------------------------------
#                                        Losses
# --------------------------------------------------------------------------------------------------


@torch.no_grad()
def flow_loss(
    velocity: Callable[[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]], torch.Tensor],
    items: dict[str, torch.Tensor],
    settings: GateSettings,
    device: torch.device,
    reverse: bool = False,
) -> float:
    """Mean velocity MSE over t bins' midpoints, noise seeded per bin (the same for every model on the same items).
    reverse: as if t = 0 were noise (x_t = t x0 + (1 - t) eps, target x0 - eps), the convention flowfleet's is not."""
    total = 0.0
    for x_t, t, target, cond in noised(items, settings, device, reverse):
        total += float(((velocity(x_t, t, cond) - target) ** 2).mean())
    return total / settings.t_bins


def noised(
    items: dict[str, torch.Tensor], settings: GateSettings, device: torch.device, reverse: bool = False
) -> Iterator[tuple[torch.Tensor, torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]]:
    """Per t bin: (x_t [N, C, H, W], t [N] at the bin's midpoint, the target velocity, the condition) of the items,
    the noise seeded per bin. reverse: x_t and the target as t = 0 as noise would make them (see flow_loss)."""
    x0 = items["latents"].float().to(device)  # [N, C, H, W]
    cond = {k: v.to(device) for k, v in items.items() if k in CONDITION_FIELDS}
    for b in range(settings.t_bins):
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(derive_seed(settings.seed, b))).to(device)
        t = torch.full((x0.shape[0],), (b + 0.5) / settings.t_bins, device=device)  # [N]
        if reverse:
            yield interpolate(x0, eps, 1 - t), t, -target_velocity(x0, eps), cond
        else:
            yield interpolate(x0, eps, t), t, target_velocity(x0, eps), cond


def expert_velocity(model: DiTExpert) -> Callable[..., torch.Tensor]:
    def v(x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        return model(x, t, **condition_kwargs(cond, model.cfg))

    return v


def fleet_velocity(pipe: FleetPipeline) -> Callable[..., torch.Tensor]:
    """The routed fleet's velocity (its strategy, router on every call, no guidance)."""
    settings = pipe.settings(cfg=1.0, route_every=1)

    def v(x: torch.Tensor, t: torch.Tensor, cond: dict[str, torch.Tensor]) -> torch.Tensor:
        given = {k: cond[k] for k in CONDITION_FIELDS if k in cond}
        if "text_mask" in given:
            given["text_mask"] = given["text_mask"].bool()
        condition = Condition(**given)
        return pipe.velocity_fn(condition, settings, RoutingTrace(pipe.num_experts))(x, t, 0)

    return v


def subset(items: dict[str, torch.Tensor], n: int, seed: int) -> dict[str, torch.Tensor]:
    count = items["latents"].shape[0]
    pick = torch.randperm(count, generator=torch.Generator().manual_seed(seed))[:n].sort().values
    return {k: v[pick] for k, v in items.items()}


# --------------------------------------------------------------------------------------------------
#                                        The gate
# --------------------------------------------------------------------------------------------------


class Gate:
    """One package against one run: the checks in order (each a method that returns or raises Refused)."""

    def __init__(self, root: RunRoot, pkg: RunRoot, trusted: str, settings: GateSettings):
        self.root, self.pkg, self.trusted, self.settings = root, pkg, trusted, settings
        self.cfg = load_run_config(root)
        self.kit: Kit = run_kit(root, self.cfg)
        self.device = resolve_device(settings.device)
        self.figures: dict[str, float] = {}
        self.manifest: dict[str, Any] = {}
        self.body = b""
        self.signer = ""
        self.expert_cfg: DiTConfig | None = None
        self.tensors: dict[str, torch.Tensor] = {}  # the expert's weights, once `what` has read them
        self._shards: dict[str, tuple[dict[str, torch.Tensor], list[str]]] = {}
        self.grid: bytes | None = None  # the judged comparison's samples (PNG), when a judge read them

    def checks(self) -> list[Callable[[], None]]:
        return [self.who, self.what, self.fits, self.learnt]

    # -- 1. who ---------------------------------------------------------------------------------------

    def who(self) -> None:
        pkg = self.pkg
        for name in (PACKAGE_MANIFEST, PACKAGE_SIGNATURE):
            if not pkg.exists(name):
                raise Refused("who", f"{pkg.url_of(name)}: missing (`flowfleet contribute` writes a signed package)")
        self.body = pkg.read_bytes(PACKAGE_MANIFEST)
        keys = read_trusted(self.trusted)
        signer = signed_by(keys, self.body, pkg.read_bytes(PACKAGE_SIGNATURE))
        if signer is None:
            raise Refused(
                "who",
                f"{PACKAGE_SIGNATURE}: not a signature over {PACKAGE_MANIFEST} by any of the {len(keys)} trusted "
                f"key(s) in {self.trusted} (an unknown signer, or a manifest changed after signing)",
            )
        self.signer = signer
        try:
            self.manifest = json.loads(self.body)
            files = dict(self.manifest["files"])
        except (ValueError, KeyError, TypeError):
            raise Refused("who", f"{PACKAGE_MANIFEST}: not a package manifest (no 'files')") from None
        present = package_files(pkg)
        for rel in present:
            if rel not in files and rel not in PACKAGE_OWN:
                raise Refused("who", f"{rel}: not in the signed manifest (added after signing)")
        for rel, sha in sorted(files.items()):
            if rel not in present:
                raise Refused("who", f"{rel}: missing, though the signed manifest lists it")
            if package_sha256(pkg, rel) != sha:
                raise Refused("who", f"{rel}: sha256 differs from the signed manifest's (changed after signing)")

    # -- 2. what --------------------------------------------------------------------------------------

    def what(self) -> None:
        for rel in self.manifest["files"]:
            if not rel.endswith((".safetensors", ".json")):
                raise Refused("what", f"{rel}: not safetensors or JSON; a pickle-capable file is never read")
            if rel.endswith(".safetensors"):
                _check_safetensors_header(self.pkg, rel)
        rel_config = f"{PACKAGE_EXPERT}/config.json"
        rel_weights = f"{PACKAGE_EXPERT}/{WEIGHTS_NAME}"
        for rel in (rel_config, rel_weights):
            if rel not in self.manifest["files"]:
                raise Refused("what", f"{rel}: missing from the package")
        if self.pkg.fs.size(self.pkg.path(rel_config)) > CONFIG_MAX_BYTES:
            raise Refused("what", f"{rel_config}: over {CONFIG_MAX_BYTES >> 10} KiB, not a DiT's config")
        raw = json.loads(self.pkg.read_bytes(*rel_config.split("/")))
        if isinstance(raw, dict):
            raw = {k: v for k, v in raw.items() if not k.startswith("_")}  # diffusers' _class_name, _diffusers_version
        cfg = validated(DiTConfig, raw, rel_config, _RefusedWhat)
        params, cap = parameter_count(cfg), self.kit.max_params
        if params > cap:
            raise Refused("what", f"{rel_config}: {params:,} parameters, over the kit's cap of {cap:,}")
        size = self.pkg.fs.size(self.pkg.path(rel_weights))
        if size > cap * max(BYTES_PER_PARAM.values()) + HEADER_MAX_BYTES:
            raise Refused("what", f"{rel_weights}: {size:,} bytes, more than {cap:,} parameters can take")
        tensors = safetensors.torch.load(self.pkg.read_bytes(*rel_weights.split("/")))
        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in DiTExpert.from_dit_config(cfg).state_dict().items()}
        for name in sorted(set(expected) | set(tensors)):
            got = tuple(tensors[name].shape) if name in tensors else None
            if got != expected.get(name):
                raise Refused(
                    "what", f"{rel_weights}: tensor {name} is {got}, config.json makes it {expected.get(name)}"
                )
        for name, tensor in tensors.items():
            dtype = str(tensor.dtype).removeprefix("torch.")
            if dtype not in self.kit.dtypes:
                raise Refused("what", f"{rel_weights}: tensor {name} is {dtype}; the kit takes {self.kit.dtypes}")
            if tensor.is_floating_point() and not torch.isfinite(tensor).all():
                raise Refused("what", f"{rel_weights}: tensor {name} holds NaN or inf")
        self.expert_cfg = cfg
        self.tensors = tensors

    # -- 3. fits --------------------------------------------------------------------------------------

    def fits(self) -> None:
        cfg, kit, where = self.expert_cfg, self.kit, f"{PACKAGE_EXPERT}/config.json"
        assert cfg is not None
        c, h, w = kit.latent_shape
        if cfg.in_channels != c:
            raise Refused("fits", f"{where}: in_channels {cfg.in_channels}, the fleet's latents have {c} channels")
        if tuple(cfg.input_size) != (h, w):
            raise Refused("fits", f"{where}: input_size {list(cfg.input_size)}, the fleet's latents are {h}x{w}")
        if cfg.objective not in kit.objectives:
            raise Refused("fits", f"{where}: objective {cfg.objective!r}; the fleet takes {kit.objectives}")
        declared = self.manifest.get("time_convention")
        if cfg.time_convention != TIME_CONVENTION or declared != TIME_CONVENTION:
            raise Refused(
                "fits", f"{PACKAGE_MANIFEST}: time convention {declared!r}, the fleet's is {TIME_CONVENTION!r}"
            )
        base = kit.expert_config().model_dump(exclude={"size"})
        mine = cfg.model_dump(exclude={"size"})
        for key, value in base.items():
            if key not in EXPERT_OVERRIDABLE and mine.get(key) != value:
                raise Refused(
                    "fits", f"{where}: {key} {mine.get(key)!r}, the fleet's is {value!r} (not an expert's to change)"
                )
        if self.manifest.get("kit") != kit.fingerprint:
            raise Refused(
                "fits",
                f"{PACKAGE_MANIFEST}: kit fingerprint {str(self.manifest.get('kit'))[:16]}... is not this "
                f"fleet's {kit.fingerprint[:16]}... (another fleet's kit, or this fleet changed its latent space)",
            )
        for rel in (PACKAGE_SAMPLE, PACKAGE_HELDOUT):
            tensors = self.shard(rel)[0]
            self._not_copied(rel, tensors)
            lat = tensors.get("latents")
            if lat is None or tuple(lat.shape[1:]) != kit.latent_shape or lat.shape[0] < 2:
                shape = None if lat is None else list(lat.shape)
                raise Refused("fits", f"{rel}: latents {shape}, expected [N >= 2, {c}, {h}, {w}]")
            if cfg.conditioning == "cross_attn":
                tok = tensors.get("text_tokens")
                if tok is None or tuple(tok.shape[1:]) != (cfg.text_len, cfg.text_dim):
                    raise Refused(
                        "fits",
                        f"{rel}: text_tokens {None if tok is None else list(tok.shape)}, expected "
                        f"[N, {cfg.text_len}, {cfg.text_dim}]",
                    )

    def _not_copied(self, rel: str, tensors: dict[str, torch.Tensor]) -> None:
        """Refuse a sample or held-out slice that is largely the fleet's own data, byte for byte: its router would
        learn to send the fleet's prompts to the newcomer (the poisoned contribution's lure)."""
        lat = tensors.get("latents")
        if lat is None or not lat.numel():
            return
        copies = sum(_row_digest(row) in self.own_rows for row in lat)
        self.figures[f"copied_share_{rel.split('.')[0]}"] = copies / lat.shape[0]
        if copies > self.settings.copied * lat.shape[0]:
            raise Refused(
                "fits",
                f"{rel}: {copies} of its {lat.shape[0]} items are copies of the fleet's own data "
                f"(at most {self.settings.copied:.0%}): data the fleet has is not a contribution",
            )

    # -- 4. learnt ------------------------------------------------------------------------------------

    def learnt(self) -> None:
        s, cfg = self.settings, self.expert_cfg
        assert cfg is not None
        expert = DiTExpert.from_dit_config(cfg)
        expert.load_state_dict(self.tensors, strict=True)
        expert = expert.to(self.device).eval()
        held = subset(self.shard(PACKAGE_HELDOUT)[0], s.items, s.seed)
        sample = subset(self.shard(PACKAGE_SAMPLE)[0], s.items, s.seed)
        f = self.figures
        f["heldout"] = flow_loss(expert_velocity(expert), held, s, self.device)
        f["heldout_reversed_time"] = flow_loss(expert_velocity(expert), held, s, self.device, reverse=True)
        if f["heldout_reversed_time"] < f["heldout"]:
            raise Refused(
                "learnt",
                f"{PACKAGE_HELDOUT}: the expert's loss is lower with t = 0 as noise "
                f"({f['heldout_reversed_time']:.4f}) than with t = 1 as noise ({f['heldout']:.4f}): trained with the "
                "time convention reversed",
            )
        with torch.random.fork_rng(devices=[]):  # the untrained reference is seeded; the caller's generator is not
            torch.manual_seed(s.seed)
            untrained = DiTExpert.from_dit_config(cfg).to(self.device).eval()
        f["untrained_heldout"] = flow_loss(expert_velocity(untrained), held, s, self.device)
        if not f["heldout"] < s.ceiling * f["untrained_heldout"]:
            raise Refused(
                "learnt",
                f"{PACKAGE_HELDOUT}: loss {f['heldout']:.4f} is not below {s.ceiling} x an untrained "
                f"expert's ({f['untrained_heldout']:.4f}): it has not learnt",
            )
        f["sample"] = flow_loss(expert_velocity(expert), sample, s, self.device)
        if f["heldout"] > (1 + s.gap) * f["sample"]:
            raise Refused(
                "learnt",
                f"{PACKAGE_HELDOUT}: loss {f['heldout']:.4f}, over {1 + s.gap} x its loss on its own "
                f"sample ({f['sample']:.4f}): it does not generalise to items it did not see",
            )
        if f["heldout"] * (1 + s.gap) < f["sample"]:  # held out from the same data, it cannot be far easier
            raise Refused(
                "learnt",
                f"{PACKAGE_HELDOUT}: loss {f['heldout']:.4f}, under 1/{1 + s.gap} of its loss on its own sample "
                f"({f['sample']:.4f}): the held-out slice is not drawn from the data the sample is",
            )
        training = self.manifest.get("training") or {}
        for key in ("steps", "items"):  # what run.yaml will record of it (config.Contribution)
            value = training.get(key)
            if not isinstance(value, int) or value < (1 if key == "steps" else 0):
                raise Refused("learnt", f"{PACKAGE_MANIFEST}: training.{key} missing or not a count, got {value!r}")
        claimed = training.get("final_loss")
        if not isinstance(claimed, (int, float)) or not math.isfinite(claimed):
            raise Refused("learnt", f"{PACKAGE_MANIFEST}: training.final_loss missing or not a number")
        f["signed_training_loss"] = float(claimed)
        if f["sample"] > (1 + s.claimed) * claimed:
            raise Refused(
                "learnt",
                f"{PACKAGE_SAMPLE}: the expert's loss on it ({f['sample']:.4f}) is over {1 + s.claimed} x "
                f"the training loss it signed ({claimed:.4f}): the sample is not what it learnt from",
            )
        probe = subset(self.fleet_heldout, s.items, s.seed)
        self._bounded(expert, probe)

    def _bounded(self, expert: DiTExpert, probe: dict[str, torch.Tensor]) -> None:
        s = self.settings
        worst = 0.0
        with torch.no_grad():
            for x_t, t, target, cond in noised(probe, s, self.device):
                v = expert_velocity(expert)(x_t, t, cond)
                if not torch.isfinite(v).all():
                    raise Refused(
                        "learnt",
                        f"{PACKAGE_EXPERT}: velocities on the fleet's held-out latents at t = "
                        f"{float(t[0]):.3f} are not finite",
                    )
                worst = max(worst, float(v.pow(2).mean().sqrt() / target.pow(2).mean().sqrt()))
        self.figures["velocity_rms_over_target"] = worst
        if worst > s.velocity_bound:
            raise Refused(
                "learnt",
                f"{PACKAGE_EXPERT}: velocity RMS on the fleet's held-out latents is {worst:.1f} x "
                f"the targets', over {s.velocity_bound}",
            )

    @functools.cached_property
    def fleet_heldout(self) -> dict[str, torch.Tensor]:
        """The fleet's held-out items (eval/, else data/): the fields its models read."""
        folder = EVAL_DATA if self.root.exists(EVAL_DATA) else DATA
        shards = ShardSet(self.root, folder)
        return shards.load(["latents", *CONDITION_FIELDS])

    @functools.cached_property
    def own_rows(self) -> set[str]:
        """The digests of the fleet's own latents (data/), one per item."""
        return {_row_digest(row) for row in ShardSet(self.root, DATA).load(["latents"])["latents"]}

    def shard(self, rel: str) -> tuple[dict[str, torch.Tensor], list[str]]:
        """A package shard (latents.safetensors, heldout.safetensors), read once."""
        if rel not in self._shards:
            self._shards[rel] = read_shard_file(self.pkg.read_bytes(rel))
        return self._shards[rel]

    # -- 5. no harm -----------------------------------------------------------------------------------

    def no_harm(self, progress: bool) -> int:
        """Stage the grown fleet, train its router, compare; on refusal undo everything staged. -> its expert."""
        root = self.root
        with tempfile.TemporaryDirectory() as tmp:
            draws = self._judged_draws(tmp)  # before anything is staged: the fleet's own items as they are
        before_yaml = root.read_bytes(RUN_FILE)
        staged = _Staged(root, self.cfg)
        try:
            k = staged.add(self.pkg, self.shard(PACKAGE_SAMPLE), self.manifest, self.body, self.signer, self.expert_cfg)
            for spec in run_routers(staged.cfg):
                staged.jobs.append(spec.dir)
                status = train_job(root, spec, options=TrainOptions(progress=progress))
                if status.state != "done":
                    raise FlowfleetError(f"{spec.dir}: {status.state} at step {status.step}; re-run admit")
            assemble(root.url, root.url_of(CANDIDATE), progress=progress)
            # the fleet before and the grown fleet, opened once for both comparisons (encoders where judged: shared)
            before = FleetPipeline.from_pretrained(root.url_of(MODEL), device=self.device, load_encoders=bool(draws))
            after = FleetPipeline.from_pretrained(
                root.url_of(CANDIDATE),
                device=self.device,
                text_encoder=before.text_encoder,
                latent_decoder=before.latent_decoder,
                load_encoders=False,
            )
            self._compare(before, after)
            if draws is not None:
                self._judged(before, after, *draws, progress=progress)
        except BaseException:
            root.write_bytes(before_yaml, RUN_FILE)
            staged.undo()
            raise
        root.remove(CANDIDATE, recursive=True)
        return k

    def _compare(self, before: FleetPipeline, after: FleetPipeline) -> None:
        """The fleet before and the grown fleet by their routed flow-matching loss (no image, no judge)."""
        s, f = self.settings, self.figures
        old = subset(self.fleet_heldout, s.items, s.seed)
        new = subset(self.shard(PACKAGE_HELDOUT)[0], s.items, s.seed)
        f["fleet_old_before"] = flow_loss(fleet_velocity(before), old, s, self.device)
        f["fleet_old_after"] = flow_loss(fleet_velocity(after), old, s, self.device)
        f["fleet_new_before"] = flow_loss(fleet_velocity(before), new, s, self.device)
        f["fleet_new_after"] = flow_loss(fleet_velocity(after), new, s, self.device)
        rise = f["fleet_old_after"] / f["fleet_old_before"] - 1
        if rise > s.harm:
            raise Refused(
                "no harm",
                f"the grown fleet's loss on the fleet's held-out data rises from {f['fleet_old_before']:.4f} to "
                f"{f['fleet_old_after']:.4f} ({rise:+.1%}; at most {s.harm:+.0%}): its router sends the fleet's "
                f"prompts to the new expert{self.router_hint}",
            )
        if not f["fleet_new_after"] < f["fleet_new_before"]:
            raise Refused(
                "no harm",
                f"{PACKAGE_HELDOUT}: the grown fleet's loss ({f['fleet_new_after']:.4f}) is not below the "
                f"fleet's before ({f['fleet_new_before']:.4f}): the contribution adds nothing there",
            )

    @property
    def router_hint(self) -> str:
        """What a refusal for harm to the fleet's own prompts adds when the fleet's router is prompt-blind (Paris'):
        a grown fleet under such a router sends a prompt by its noisy image alone, e.g. a four to the nines' expert."""
        if self.cfg.router.uses_text or self.cfg.encoders.text.name == "none":
            return ""
        return "; its router does not read the prompt (a router with run.yaml router.conditioning: pooled may take it)"

    def _judged_draws(self, tmp: str) -> tuple[JudgedDraw, JudgedDraw | None] | None:
        """The judged comparison's two draws: the fleet's held-out items (their prompts and images; data/'s when it
        holds none out), and the contribution's held-out slice (written to `tmp` as a shard set; None when the judge
        names none of its prompts). None: no judge reads the fleet's prompts."""
        s = self.settings
        if s.judge is None:
            return None
        conditioning = read_model_index(RunRoot(self.root.url_of(MODEL))).conditioning
        options = EvaluateOptions(
            n=s.judge_n, seed=s.seed, diagnostics=False, device=s.device, judge=None if s.judge == "auto" else s.judge
        )
        own = JudgedDraw.open(self.root.url, options, conditioning, held_out=True)
        if own is None:
            log.info("admit: no judge reads the fleet's prompts: no harm is judged by the loss alone")
            return None
        slice_root = RunRoot(tmp)
        _write_shards(slice_root, DATA, *self.shard(PACKAGE_HELDOUT), {})
        data = ShardSetUnion([ShardSet(slice_root, DATA)])
        new = JudgedDraw.open(self.root.url, replace(options, judge=own.judge), conditioning, data=data)
        return own, new

    def _judged(
        self, before: FleetPipeline, after: FleetPipeline, own: JudgedDraw, new: JudgedDraw | None, progress: bool
    ) -> None:
        """The fleet before and the grown fleet, sampled as they serve on the same prompts and noise, judged."""
        s, f = self.settings, self.figures
        fleets = {"fleet before": before, "grown fleet": after}
        got = {
            which: tuple(draw.score(pipe, name=name, progress=progress, keep=True) for name, pipe in fleets.items())
            for which, draw in (("old", own), ("new", new))
            if draw is not None
        }
        for which, pair in got.items():
            for when, scores in zip(("before", "after"), pair):
                for key in ("prompt_accuracy", "classifier_fd"):
                    if scores.get(key) is not None:
                        f[f"judged_{which}_{key}_{when}"] = float(scores[key])
        self.grid = _grid(got, own.judge)  # (before any verdict: a refusal's picture shows why)
        (b, a) = got["old"]
        if a["prompt_accuracy"] < b["prompt_accuracy"] - s.accuracy_drop:
            worst = min(a["per_class"], key=lambda c: a["per_class"][c] - b["per_class"].get(c, 0.0))
            raise Refused(
                "no harm",
                f"the grown fleet's prompt accuracy on the fleet's held-out prompts falls from "
                f"{b['prompt_accuracy']:.3f} to {a['prompt_accuracy']:.3f} (at most {s.accuracy_drop} lower; "
                f"{worst!r}: {b['per_class'].get(worst, 0.0):.3f} -> {a['per_class'][worst]:.3f}), by {own.judge}"
                f"{self.router_hint}",
            )
        if b.get("classifier_fd") is not None and a["classifier_fd"] > (1 + s.fd_rise) * b["classifier_fd"]:
            raise Refused(
                "no harm",
                f"the grown fleet's classifier FD on the fleet's held-out prompts rises from {b['classifier_fd']:.2f} "
                f"to {a['classifier_fd']:.2f} (at most {s.fd_rise:+.0%}), by {own.judge}{self.router_hint}",
            )
        if new is None:
            return
        (b, a) = got["new"]
        if not a["prompt_accuracy"] > b["prompt_accuracy"]:
            raise Refused(
                "no harm",
                f"{PACKAGE_HELDOUT}: the grown fleet's prompt accuracy on the contribution's prompts "
                f"({a['prompt_accuracy']:.3f}) is not above the fleet's before ({b['prompt_accuracy']:.3f}), by "
                f"{own.judge}: the contribution adds nothing there",
            )
        if b.get("classifier_fd") is not None and not a["classifier_fd"] < b["classifier_fd"]:
            raise Refused(
                "no harm",
                f"{PACKAGE_HELDOUT}: the grown fleet's classifier FD on the contribution's prompts "
                f"({a['classifier_fd']:.2f}) is not below the fleet's before ({b['classifier_fd']:.2f}), by "
                f"{own.judge}: the contribution adds nothing there",
            )


class _Staged:
    """What admission writes into the run before its last check, and how to take it back."""

    def __init__(self, root: RunRoot, cfg: RunConfig):
        self.root, self.before = root, cfg
        self.cfg = cfg
        self.folders: list[str] = []
        self.jobs: list[str] = []

    def add(
        self,
        pkg: RunRoot,
        sample: tuple[dict[str, torch.Tensor], list[str]],
        manifest: dict[str, Any],
        body: bytes,
        signer: str,
        expert: DiTConfig | None,
    ) -> int:
        """The contribution as addition n of the run: run.yaml, added/<n>/ (its sample as data/ and one partition),
        experts/<K>/ (its weights, finished at its signed steps, and the signed manifest). -> K."""
        assert expert is not None
        root, cfg = self.root, self.before
        k, n = cfg.num_experts, len(cfg.added) + 1
        training = manifest.get("training") or {}
        contribution = Contribution(
            signer=signer,
            manifest_sha256=hashlib.sha256(body).hexdigest(),
            package=pkg.url,
            steps=int(training.get("steps", 0)),
            items=int(training.get("items", 0)),
        )
        raw = cfg.to_dict()
        data = DataConfig(source="folder", path=pkg.url, image_size=cfg.data.image_size, channels=cfg.data.channels)
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
        _write_items(sub, *sample)
        job = RunRoot(root.url_of(expert_job(k)))
        for name in pkg.ls(PACKAGE_EXPERT):
            job.write_bytes(pkg.read_bytes(PACKAGE_EXPERT, name), FINAL, name)
        job.write_bytes(body, FINAL, CONTRIBUTION)
        job.write_bytes(pkg.read_bytes(PACKAGE_SIGNATURE), FINAL, CONTRIBUTION_SIG)
        status = JobStatus(
            job=expert_job(k),
            state="done",
            step=contribution.steps,
            total_steps=contribution.steps,
            last_loss=training.get("final_loss"),
            message=f"contributed, signed by {signer}",
        )
        job.write_json(status.to_dict(), STATUS_FILE)
        self.cfg.save(root)
        return k

    def undo(self) -> None:
        for folder in [*self.folders, *self.jobs, CANDIDATE]:
            self.root.remove(folder, recursive=True)


def _write_items(sub: RunRoot, tensors: dict[str, torch.Tensor], captions: list[str]) -> None:
    """A package's sample as an addition's prepared data/, its one cluster and its one partition."""
    from flowfleet.cluster.assignments import write_assignments

    n = len(captions)
    for folder, extra in ((DATA, {}), (partition(0), {"partition": 0, "partition_counts": [n]})):
        _write_shards(sub, folder, tensors, captions, extra)
    write_assignments(sub, torch.zeros(n, dtype=torch.long), torch.zeros(n, dtype=torch.long))
    sub.write_json({"k": 1, "count": n, "sizes": [n], "examples": {"0": captions[:5]}}, *CLUSTER_REPORT)


def changed_first(before: list[bool | None], after: list[bool | None], n: int) -> list[int]:
    """n sample indices: those the judge read differently before and after, then the first others, in order."""
    changed = [i for i, (x, y) in enumerate(zip(before, after)) if x != y]
    same = [i for i in range(len(before)) if before[i] == after[i]]
    return (changed + same)[:n]


def _grid(got: dict[str, tuple[dict[str, Any], ...]], judge: str) -> bytes:
    """The judged comparison's samples, a row each: the fleet before and the grown fleet on the fleet's held-out
    prompts, then (where judged) on the contribution's. Each pair of rows shows the same prompts and noise: first
    those the judge read differently before and after (what the contribution changed), then the first others. The
    title gives each pair's prompt accuracy."""
    images, prompts = [], []
    for b, a in got.values():
        pick = changed_first(b["hits"], a["hits"], GRID_ROW)
        for scores in (b, a):
            images.append(scores["images"][pick])
            prompts += [scores["prompts"][i] for i in pick]
    names = {"old": "fleet's prompts", "new": "new prompts"}
    accuracy = ", ".join(
        f"{names[which]} {b['prompt_accuracy']:.2f} -> {a['prompt_accuracy']:.2f}" for which, (b, a) in got.items()
    )
    return captioned_grid_png(
        torch.cat(images), prompts, cols=GRID_ROW, title=f"before/after: {accuracy} (by {judge}), changed first"
    )


def _write_shards(
    root: RunRoot, folder: str, tensors: dict[str, torch.Tensor], captions: list[str], extra: dict[str, Any]
) -> None:
    """A package's items (its sample, its held-out slice) as a complete shard set root/folder."""
    shards = ShardSet(root, folder)
    manifest = ShardSetManifest(extra={"contributed": True, **extra})
    shards.append(manifest, {**tensors, "index": torch.arange(len(captions))}, captions)
    manifest.complete = True
    shards.write_manifest(manifest)


def _row_digest(row: torch.Tensor) -> str:
    return hashlib.sha256(row.float().contiguous().numpy().tobytes()).hexdigest()


def _check_safetensors_header(pkg: RunRoot, rel: str) -> None:
    """A safetensors file begins with its header's length and a JSON header; anything else (a pickle renamed) is
    refused before torch reads a byte of it."""
    with pkg.fs.open(pkg.path(rel), "rb") as f:
        head = f.read(8)
        size = int.from_bytes(head, "little") if len(head) == 8 else -1
        if not 0 < size <= HEADER_MAX_BYTES:
            raise Refused("what", f"{rel}: not a safetensors file (no header)")
        try:
            json.loads(f.read(size))
        except ValueError:
            raise Refused("what", f"{rel}: not a safetensors file (its header is not JSON)") from None


def admit(
    run_root: str,
    package: str,
    trusted: str,
    *,
    settings: GateSettings = GateSettings(),
    progress: bool = True,
    picture: str | None = None,
) -> AdmitResult:
    """Check a contributed expert's package against the run (the module docstring's five checks, in order), and
    on success grow the fleet with it; a Refused names the first check that failed.
    picture: a PNG file to write the judged samples to as well, on a refusal too (the run stays unchanged then)."""
    settings.validate()
    root, pkg = RunRoot(run_root), RunRoot(package)
    if not root.exists(MODEL):
        raise FlowfleetError(f"{root.url_of(MODEL)}: missing; the gate compares against the assembled fleet")
    gate = Gate(root, pkg, trusted, settings)
    try:
        for check in gate.checks():
            check()
            log.info(f"admit: {check.__name__}: passed")
        k = gate.no_harm(progress)
    finally:
        if picture and gate.grid is not None:
            folder, name = posixpath.split(picture)
            RunRoot(folder or ".").write_bytes(gate.grid, name)
    log.info("admit: no harm: passed")
    result = assemble(root.url, progress=progress)
    grid = None
    if gate.grid is not None:
        root.write_bytes(gate.grid, *CONTRIBUTIONS, f"expert_{k}.png")
        grid = root.url_of(*CONTRIBUTIONS, f"expert_{k}.png")
    return AdmitResult(k, gate.signer, hashlib.sha256(gate.body).hexdigest(), result.out, dict(gate.figures), grid)
