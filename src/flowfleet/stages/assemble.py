"""Stage `assemble`: the finished experts (EMA weights) + router -> one diffusers-style model folder.

Reads RUN_ROOT/run.yaml, experts/k/{status.json,final/} and router/{status.json,final/} (contract in
docs/contracts.md) and writes RUN_ROOT/model (or --out) as described in flowfleet.sampling.folder.
Every component's config is checked against run.yaml before anything is written: an expert trained
elsewhere with another latent shape, patch size, text width or time convention is refused with a line
naming the expert and the field. With allow_partial, experts that are not finished are left out (a
warning); the router's probabilities are then renormalised over the present experts at sampling time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Sequence, cast

from tqdm.auto import tqdm

from flowfleet import __version__
from flowfleet.config import RunConfig, load_run_config
from flowfleet.data.autoencoder import load_autoencoder
from flowfleet.errors import FlowfleetError, ParameterError
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.layout import (
    AUTOENCODER,
    DILOCO_MODEL,
    EXPERTS,
    FINAL,
    MODEL,
    MODEL_VAE,
    MONOLITH,
    MONOLITH_MODEL,
    ROUTERS,
    RUN_FILE,
    STUDENT,
    STUDENT_MODEL,
    expert_job,
)
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert, DiTModel, DiTRouter
from flowfleet.models.files import WEIGHTS_NAME, ModelFileError, load_model, read_dit_config
from flowfleet.sampling.card import (
    CARD_FOLDER,
    ExpertCard,
    FleetCard,
    ModelKind,
    cluster_facts,
    cluster_preview,
    preview_name,
    router_card,
    write_card,
)
from flowfleet.sampling.folder import (
    INDEX_FILE,
    PIPELINE_MODULE,
    PIPELINE_MODULE_FILE,
    PIXEL_NOTE,
    ModelIndex,
    SchedulerConfig,
    expert_folder,
    write_checksums,
)
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobKind, JobSpec, diloco_jobs, router_of_folder
from flowfleet.train.status import JobStatus, job_finished


@dataclass
class AssembleResult:
    out: str  # URL of the model folder
    num_experts: int
    present: list[int]
    missing: dict[int, str] = field(default_factory=dict)  # expert -> why it was left out
    warnings: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------------
#                                    Compatibility checks
# --------------------------------------------------------------------------------------------------


def _check_shape(who: str, where: str, cfg: DiTConfig, run: RunConfig) -> None:
    c, h, w = run.latent_shape
    if cfg.in_channels != c or tuple(cfg.input_size) != (h, w):
        raise FlowfleetError(
            f"{who} ({where}): latent shape {(cfg.in_channels, *cfg.input_size)} (in_channels, "
            f"input_size) differs from the run's latent shape {(c, h, w)}"
        )


def check_expert(k: int | str, where: str, cfg: DiTConfig, run: RunConfig) -> None:
    """Refuse an expert that cannot be sampled with the others; names the expert and the field."""
    who = f"expert {k}" if isinstance(k, int) else k
    ref = run.expert
    _check_shape(who, where, cfg, run)
    if cfg.num_outputs:
        raise FlowfleetError(f"{who} ({where}): num_outputs {cfg.num_outputs}: a router head, not a velocity expert")
    if cfg.out_ch != cfg.in_channels:
        raise FlowfleetError(
            f"{who} ({where}): out_channels {cfg.out_ch} differs from in_channels "
            f"{cfg.in_channels} (learned-sigma heads cannot be sampled as velocities)"
        )
    if cfg.patch_size != ref.patch_size:
        raise FlowfleetError(
            f"{who} ({where}): patch_size {cfg.patch_size} differs from run.yaml expert.patch_size {ref.patch_size}"
        )
    if cfg.conditioning != ref.conditioning:
        raise FlowfleetError(
            f"{who} ({where}): conditioning {cfg.conditioning!r} differs from run.yaml "
            f"expert.conditioning {ref.conditioning!r}"
        )
    if cfg.uses_text and cfg.text_dim != ref.text_dim:
        raise FlowfleetError(
            f"{who} ({where}): text_dim (text width) {cfg.text_dim} differs from run.yaml "
            f"expert.text_dim {ref.text_dim} ({run.encoders.text.name})"
        )
    if cfg.conditioning == "cross_attn" and cfg.text_len != ref.text_len:
        raise FlowfleetError(
            f"{who} ({where}): text_len {cfg.text_len} differs from run.yaml expert.text_len {ref.text_len}"
        )
    if cfg.conditioning == "class" and cfg.num_classes != ref.num_classes:
        raise FlowfleetError(
            f"{who} ({where}): num_classes {cfg.num_classes} differs from run.yaml expert.num_classes {ref.num_classes}"
        )


def check_router(where: str, cfg: DiTConfig, run: RunConfig) -> None:
    _check_shape("router", where, cfg, run)
    if cfg.num_outputs != run.num_experts:
        raise FlowfleetError(
            f"router ({where}): num_outputs {cfg.num_outputs} differs from K = "
            f"{run.num_experts} experts (run.yaml cluster.k" + (" + added)" if run.added else ")")
        )


def _read_config(who: str, root: RunRoot, *parts: str) -> DiTConfig:
    """A component's config.json, validated; the time convention is checked first and named as such."""
    where = root.url_of(*parts, "config.json")
    if root.exists(*parts, "config.json"):
        try:
            raw = root.read_json(*parts, "config.json")
        except ValueError:
            raw = None  # read_dit_config below reports the corrupted JSON
        convention = raw.get("time_convention", TIME_CONVENTION) if isinstance(raw, dict) else TIME_CONVENTION
        if convention != TIME_CONVENTION:
            raise FlowfleetError(
                f"{who} ({where}): time_convention {convention!r} differs from flowfleet's {TIME_CONVENTION!r}"
            )
    try:
        return read_dit_config(root, *parts)
    except ModelFileError as err:
        raise FlowfleetError(f"{who}: {err}") from None


# --------------------------------------------------------------------------------------------------
#                                          The stage
# --------------------------------------------------------------------------------------------------


def assemble(
    run_root: str,
    out: str | None = None,
    *,
    allow_partial: bool = False,
    monolith: bool = False,
    student: bool = False,
    diloco: bool = False,
    router: str = "router",
    progress: bool = False,
) -> AssembleResult:
    """Check, then copy experts + router into a model folder; model_index.json is written last.
    router: the router job folder ("router", or a comparison router: "router-paris", Paris' prompt-blind one,
    or "router-prompt", a prompt-aware one).
    monolith=True: the monolith alone as a one-expert model with no router (default out RUN_ROOT/model-monolith),
    which generate and evaluate open like a fleet; student=True: the distilled student the same way
    (default out RUN_ROOT/model-student); diloco=True: the model of run.yaml diloco's workers (their final/ folders
    are equal: the first finished one's, default out RUN_ROOT/model-diloco)."""
    root = RunRoot(run_root)
    run = load_run_config(root)
    if sum([monolith, student, diloco]) > 1:
        raise FlowfleetError("assemble: one of --monolith, --student, --diloco")
    if diloco:
        return _assemble_single(root, run, _diloco_job(root, run), out, progress)
    if monolith or student:
        return _assemble_single(root, run, STUDENT if student else MONOLITH, out, progress)
    num_experts = run.num_experts

    # 1. Everything is checked before anything is written.
    if router not in ROUTERS:
        raise ParameterError("router", f"{router!r} is not a router job (expected one of {', '.join(ROUTERS)})")
    router_dir = router_of_folder(run, router).dir  # after add/remove-expert: that fleet's router
    ok, why, router_status = job_finished(root, router_dir)
    if not ok or router_status is None:
        raise FlowfleetError(f"{router_dir}: not finished ({why}); train it with `{_command(router, root)}`")
    router_cfg = _read_config(router_dir, root, router_dir, FINAL)
    check_router(root.url_of(router_dir, FINAL, "config.json"), router_cfg, run)

    present: list[int] = []
    missing: dict[int, str] = {}
    statuses: dict[int, JobStatus] = {}
    for k in run.fleet_experts:
        job = expert_job(k)
        ok, why, status = job_finished(root, job)
        if not ok or status is None:
            missing[k] = why
            continue
        cfg = _read_config(f"expert {k}", root, job, FINAL)
        check_expert(k, root.url_of(job, FINAL, "config.json"), cfg, run)
        present.append(k)
        statuses[k] = status
    if missing and not allow_partial:
        first = next(iter(missing))
        raise FlowfleetError(
            f"expert {first} is not finished ({missing[first]}); {len(missing)} of {num_experts} "
            f"experts missing — wait for them or pass --allow-partial"
        )
    if not present:
        raise FlowfleetError(f"no finished expert among the {num_experts} in {root.url_of(EXPERTS)}")
    warnings = [
        f"partial fleet: expert {k} left out ({why}); router probabilities are renormalised over experts {present}"
        for k, why in missing.items()
    ]
    components = [("router", (router_dir, FINAL), DiTRouter)] + [
        (expert_folder(k), (expert_job(k), FINAL), DiTExpert) for k in present
    ]
    source = {
        "router": {"job": router_dir, "step": router_status.step, "samples_seen": router_status.samples_seen},
        "experts": {str(k): {"step": s.step, "samples_seen": s.samples_seen} for k, s in statuses.items()},
        "missing_experts": {str(k): why for k, why in missing.items()},
        "removed_experts": run.removed_experts,
    }
    out_root = RunRoot(out) if out else RunRoot(root.url_of(MODEL))
    card = _fleet_card(root, run, "fleet", present, {k: s.step for k, s in statuses.items()}, router_dir)
    _write_model(
        root, run, out_root, components, num_experts, present, source, router=True, card=card, progress=progress
    )
    return AssembleResult(out_root.url, num_experts, present, missing, warnings)


def _diloco_job(root: RunRoot, run: RunConfig) -> str:
    """The folder of the first DiLoCo worker that finished (every worker's final/ holds the same outer weights)."""
    if run.diloco is None:
        raise FlowfleetError(f"{root.url_of(RUN_FILE)}: no diloco block; nothing for --diloco to assemble")
    workers = diloco_jobs(run)
    for spec in workers:
        if job_finished(root, spec.dir)[0]:
            return spec.dir
    return workers[0].dir  # unfinished: _assemble_single says why, and how to train it


def _assemble_single(root: RunRoot, run: RunConfig, job: str, out: str | None, progress: bool) -> AssembleResult:
    """The monolith, the distilled student or DiLoCo's model (`job`: its job folder) as a one-expert model with no
    router (model-monolith/, model-student/, model-diloco/); the student samples without guidance (it learned the
    guided velocity)."""
    ok, why, status = job_finished(root, job)
    if not ok or status is None:
        how = f"flowfleet distill {root.url}" if job == STUDENT else _command(job, root, run)
        raise FlowfleetError(f"{job}: not finished ({why}); train it with `{how}`")
    cfg = _read_config(job, root, job, FINAL)
    check_expert(job, root.url_of(job, FINAL, "config.json"), cfg, run)
    source: dict[str, Any] = {job: {"step": status.step, "samples_seen": status.samples_seen}}
    if job == STUDENT and run.distill is not None:
        source[job]["distill"] = run.distill.model_dump(mode="json")
    default = STUDENT_MODEL if job == STUDENT else MONOLITH_MODEL if job == MONOLITH else DILOCO_MODEL
    out_root = RunRoot(out) if out else RunRoot(root.url_of(default))
    kind: ModelKind = "student" if job == STUDENT else "monolith"
    card = _fleet_card(root, run, kind, [0], {0: status.step}, None)
    _write_model(
        root,
        run,
        out_root,
        [(expert_folder(0), (job, FINAL), DiTExpert)],
        1,
        [0],
        source,
        router=False,
        card=card,
        guidance=1.0 if job == STUDENT else None,
        progress=progress,
    )
    return AssembleResult(out_root.url, 1, [0], {}, [])


def _fleet_card(
    root: RunRoot, run: RunConfig, kind: ModelKind, present: list[int], steps: dict[int, int], router_dir: str | None
) -> tuple[FleetCard, dict[int, bytes]]:
    """The model folder's card (flowfleet.sampling.card) from the run root: each expert's size and
    steps, its cluster's size, labels and preview; the router's accuracy per t. Parameter counts are
    filled in by _write_model, which loads every component anyway."""
    experts, previews = [], {}
    for k in present:
        cfg = run.student_config() if kind == "student" else run.expert_config(k) if kind == "fleet" else run.expert
        facts: dict[str, Any] = {"steps": steps.get(k)}
        if kind == "fleet":
            n, j = run.expert_origin(k)
            clusters = cluster_facts(root, n)
            if clusters.get("sizes"):
                facts["cluster_size"] = int(clusters["sizes"][j])
            if clusters.get("label_mix"):
                facts["label_mix"] = dict(clusters["label_mix"][j])
            facts["examples"] = list(clusters.get("examples", {}).get(str(j), []))[:5]
            contribution = run.added[n - 1].contribution if n else None
            if contribution is not None:
                facts["contributed"] = contribution.model_dump(include={"signer", "manifest_sha256", "package"})
            png = cluster_preview(root, n, j)
            if png is not None:
                previews[k] = png
                facts["preview"] = f"{CARD_FOLDER}/{preview_name(k)}"
        elif kind == "monolith":
            facts["cluster_size"] = cluster_facts(root, 0).get("count")
        experts.append(ExpertCard(k, cfg.hidden_size, cfg.depth, cfg.num_heads, cfg.patch_size, **facts))
    card = FleetCard(
        name=run.name,
        kind=kind,
        num_experts=run.num_experts if kind == "fleet" else 1,
        present=list(present),
        conditioning=run.expert.conditioning,
        latent_shape=list(run.latent_shape),
        experts=experts,
        router=router_card(root, router_dir) if router_dir is not None else None,
    )
    return card, previews


def _command(job: str, root: RunRoot, run: RunConfig | None = None) -> str:
    """The CLI command that trains one of the run's jobs (router, router-paris, monolith, a DiLoCo worker's folder)."""
    spec = next((s for s in diloco_jobs(run) if s.dir == job), None) if run else None
    return "flowfleet " + " ".join((spec or JobSpec(cast(JobKind, job))).cli_args(root.url))


def _write_model(
    root: RunRoot,
    run: RunConfig,
    out_root: RunRoot,
    components: Sequence[tuple[str, tuple[str, ...], type[DiTModel]]],
    num_experts: int,
    present: list[int],
    source: dict[str, Any],
    *,
    router: bool,
    card: tuple[FleetCard, dict[int, bytes]],
    progress: bool,
    guidance: float | None = None,
) -> None:
    """Copy the components (strictly loaded first), the card, the encoder references and run.yaml; index last."""
    out_root.remove(INDEX_FILE)  # the folder stops being a model until the new index lands
    for name in out_root.ls():
        if name.startswith("expert_") and name.removeprefix("expert_") not in {str(k) for k in present}:
            out_root.remove(name, recursive=True)  # stale expert of an earlier assembly
    if not router:
        out_root.remove("router", recursive=True)
    params = _copy_components(root, out_root, components, progress)
    fleet_card, previews = card
    for e in fleet_card.experts:
        e.params = params.get(expert_folder(e.expert))
    write_card(out_root, fleet_card, previews)
    out_root.write_bytes(root.read_bytes(RUN_FILE), RUN_FILE)
    _write_encoders(root, run, out_root)
    index = _model_index(root, run, num_experts, present, source, router=router, guidance=guidance)
    write_checksums(out_root)  # every weight file's sha256, checked whenever the folder is opened
    out_root.write_bytes(PIPELINE_MODULE.encode(), PIPELINE_MODULE_FILE)  # what diffusers' loader imports
    out_root.write_json(index.to_json_dict(), INDEX_FILE)


def _copy_components(
    root: RunRoot,
    out_root: RunRoot,
    components: Sequence[tuple[str, tuple[str, ...], type[DiTModel]]],
    progress: bool,
) -> dict[str, int]:
    """Every component's files into its folder of the model, each loaded strictly first (a corrupted file is
    refused now); -> its parameter count by folder."""
    params = {}
    for dest, src, cls in tqdm(components, desc="assemble", unit="model", leave=False, disable=not progress):
        model = load_model(cls, root, *src)  # strict: weights match config.json (refuse a corrupted file now)
        params[dest] = sum(p.numel() for p in model.parameters())
        for name in root.ls(*src):
            out_root.write_bytes(root.read_bytes(*src, name), dest, name)
    return params


def _write_encoders(root: RunRoot, run: RunConfig, out_root: RunRoot) -> None:
    """The text encoder's reference and the latent space: a note (pixels), the run's own autoencoder (vae/), or
    a reference to a pretrained VAE."""
    text_cfg = run.encoders.text if run.expert.uses_text else None
    if text_cfg is not None:
        out_root.write_json(
            {
                **text_cfg.model_dump(mode="json"),
                "width": text_cfg.width,
                "_note": "a reference: flowfleet.data.encoders.build_text_encoder loads it; "
                "the encoder itself is not copied",
            },
            "text_encoder",
            "config.json",
        )
    latent_cfg = run.encoders.latent
    if latent_cfg.name == "pixels":
        out_root.write_bytes(
            b"This fleet works in pixel space: its 'latents' are images in [-1, 1], "
            b"so there is no vae/ folder and generate does not decode.\n",
            PIXEL_NOTE,
        )
    elif latent_cfg.name == "autoencoder":
        # the run's own latent space travels with the model: vae/ is its diffusers AutoencoderKL folder
        load_autoencoder(root, AUTOENCODER)  # strict: refuse a corrupted file now
        for name in (WEIGHTS_NAME, "config.json"):  # weights first: config.json names a finished folder
            out_root.write_bytes(root.read_bytes(AUTOENCODER, name), MODEL_VAE, name)
    else:
        out_root.write_json(
            {
                **latent_cfg.model_dump(mode="json"),
                "_note": "a reference: flowfleet.data.encoders.build_latent_encoder loads it",
            },
            MODEL_VAE,
            "config.json",
        )


def _model_index(
    root: RunRoot,
    run: RunConfig,
    num_experts: int,
    present: list[int],
    source: dict[str, Any],
    *,
    router: bool,
    guidance: float | None,
) -> ModelIndex:
    """model_index.json: the experts, the latent and text interfaces, the default sampling, where it came from."""
    ref = run.expert
    text_cfg = run.encoders.text if ref.uses_text else None
    latent_cfg = run.encoders.latent
    return ModelIndex(
        flowfleet_version=__version__,
        num_experts=num_experts,
        present_experts=present,
        latent_shape=run.latent_shape,
        image_channels=run.data.channels,
        conditioning=ref.conditioning,
        num_classes=ref.num_classes,
        text_width=ref.text_dim if ref.uses_text else 0,
        text_len=ref.text_len if ref.conditioning == "cross_attn" else 0,
        latent_encoder=latent_cfg.model_dump(mode="json"),
        text_encoder_config=text_cfg.model_dump(mode="json") if text_cfg is not None else None,
        # a model without a router has one expert to run: top1
        scheduler=SchedulerConfig(
            **{
                **run.sampling.model_dump(),
                **({} if router else {"strategy": "top1"}),
                **({} if guidance is None else {"guidance_scale": guidance}),
            }
        ),
        router=("flowfleet", "DiTRouter") if router else (None, None),
        text_encoder=("flowfleet", "TextEncoderReference") if text_cfg is not None else (None, None),
        vae=("flowfleet", "LatentEncoderReference") if latent_cfg.name != "pixels" else (None, None),
        source={
            "run_root": root.url,
            "run_name": run.name,
            "assembled_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            **source,
        },
        **{expert_folder(k): ["flowfleet", "DiTExpert"] for k in present},
    )
