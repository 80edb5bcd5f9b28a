"""The run folder: every name a stage reads or writes under RUN_ROOT, written once.

    RUN_ROOT/
      run.yaml                          init          the run's configuration (flowfleet.config)
      data/                             prepare       shards + manifest.json (flowfleet.data.shards), NOTICE.md
      eval/                             prepare       the held-out items (data.holdout): evaluate's reference
      data-parts/<i>-of-<N>/            prepare --part  one slice of the source each, joined into data/ by --merge
      autoencoder/                      prepare       the latent space it trained (encoders.latent autoencoder)
      clusters/                         cluster       assignments.safetensors, centroids.safetensors,
                                                      report.json, preview-<k>.png
      partitions/<k>/                   cluster       expert k's items (shards)
      experts/<k>/  router/  router-paris/  monolith/  diloco/worker-<w>/
                                        train-*       one job each: status.json, metrics.jsonl, train.log,
                                                      checkpoints/, final/ (the EMA weights), samples/,
                                                      report.json (routers)
      backends/                         train-all     submissions.json (job -> backend job id), slurm/*.sbatch
      plan/                             plan, probe   plan.json (each expert's machine, steps, batch, finish),
                                                      probe-<machine>.json (a machine's measured speed)
      diloco/rounds/<r>/                train-diloco  worker-<w>.safetensors (a pseudo-gradient), decision.json
      model/  model-monolith/           assemble      diffusers-style model folders (model-diloco/: DiLoCo's)
      reports/                          evaluate      evaluation.json, samples/, FID reference statistics,
                                        report        report.html, plots/, showcase/, timings.json

Names are plain strings, or tuples of path parts for RunRoot (`root.exists(*ASSIGNMENTS)`); a job is
named by its folder ("experts/3", "router"). Whether a job is finished is decided by
flowfleet.train.status.job_finished; whether data/ or a partition is complete by
flowfleet.data.shards.open_complete.
"""

from __future__ import annotations

from typing import Final, Sequence

RUN_FILE = "run.yaml"

# prepare and cluster
DATA = "data"
EVAL_DATA = "eval"  # data.holdout's items: no training job reads them; evaluate's reference and floor
AUTOENCODER = "autoencoder"  # encoders.latent autoencoder: the AutoencoderKL prepare trained (a model folder)
AUTOENCODER_RECIPE = "recipe.json"  # in autoencoder/: the data and settings it was trained with
NOTICE = "NOTICE.md"  # in data/: the licences and attribution the source asks to be carried (Source.notice)
MANIFEST = "manifest.json"  # in every shard folder (data/, partitions/<k>/): what is written, and whether all
DATA_PARTS = "data-parts"  # prepare --part i/N: data-parts/<i>-of-<N>/, joined into data/ by prepare --merge
CLUSTERS = "clusters"
CLUSTER_PARTS = "cluster-parts"  # cluster --part i/N: cluster-parts/<i>-of-<N>/, joined by cluster --merge N
ASSIGNMENTS = (CLUSTERS, "assignments.safetensors")
CENTROIDS = (CLUSTERS, "centroids.safetensors")
CLUSTER_REPORT = (CLUSTERS, "report.json")
PARTITIONS = "partitions"
ADDED = "added"  # added/<n>/: the data `add-expert` brought, prepared and clustered like the run's
# `demo --caption-fleet`: a run root of its own inside the demo's (its data/ and autoencoder/ copied), a fleet of
# caption clusters routed by the prompt, evaluated beside Paris' fleet as the rows STRATEGY@caption
CAPTION_FLEET = "caption-fleet"

# training jobs
EXPERTS = "experts"
ROUTER: Final = "router"  # the run's router (prompt-aware or Paris', per run.yaml router)
PARIS_ROUTER: Final = "router-paris"  # Paris' prompt-blind router, trained beside a prompt-aware one for comparison
PROMPT_ROUTER: Final = "router-prompt"  # a prompt-aware router, trained beside Paris' for comparison ("beyond Paris")
ROUTERS = (ROUTER, PARIS_ROUTER, PROMPT_ROUTER)
MONOLITH: Final = "monolith"  # the compute-matched single-model baseline
STUDENT: Final = "student"  # `distill`: one DiT trained on the fleet's guided velocity
DILOCO: Final = "diloco"  # run.yaml diloco: one model by K workers that exchange through the run root
DILOCO_ROUNDS: Final = (DILOCO, "rounds")  # rounds/<r>/: each worker's pseudo-gradient, the round's decision
DILOCO_DECISION = "decision.json"  # in a round's folder: the workers whose pseudo-gradients it averages
REFLOW_PAIRS = (STUDENT, "reflow-pairs.safetensors")  # distill method reflow: the teacher's (noise, sample) pairs

# inside a job folder
STATUS_FILE = "status.json"
METRICS_FILE = "metrics.jsonl"
LOG_FILE = "train.log"
CHECKPOINTS = "checkpoints"
FINAL = "final"  # the finished job's model folder (EMA weights)
SAMPLES = "samples"  # preview grids during training; per-model samples in reports/
JOB_REPORT = "report.json"  # what a finished job measured (the router: its accuracy per t)
EMA_SNAPSHOTS = "ema"  # train.posthoc_ema: step-<step>.safetensors, each tracked power EMA's weights at that step
FINAL_TRAINED = "final-ema"  # `flowfleet ema`: final/ as training wrote it (train.ema_decay's EMA), kept once
POSTHOC_RECORD = "posthoc_ema.json"  # `flowfleet ema`: the length final/ was reconstructed at, and from what

# where train-all handed jobs to a backend (flowfleet.backends): job -> {backend, id, submitted}
BACKENDS = "backends"
SUBMISSIONS = (BACKENDS, "submissions.json")
# `flowfleet plan`: which machine (run.yaml machines) trains each expert, its steps, batch and expected finish
PLAN_DIR = "plan"
PLAN = (PLAN_DIR, "plan.json")


def probe_file(machine: str) -> tuple[str, str]:
    """`flowfleet probe --machine NAME`: the speed measured on that machine."""
    return PLAN_DIR, f"probe-{machine}.json"


# assembled models and reports
MODEL = "model"
MODEL_VAE = "vae"  # in a model folder: the latent decoder's reference, or (autoencoder) its weights
INDEX_FILE = "model_index.json"  # the model folder's index (flowfleet.sampling.folder)
CHECKSUMS = "SHA256SUMS"  # the model folder's weight checksums, sha256sum's format (flowfleet.sampling.folder)
VERIFIED = ".verified.json"  # weight files whose checksum matched, by size and mtime (the check's cache)
MONOLITH_MODEL = "model-monolith"  # `assemble --monolith`: the monolith as a one-expert model
DILOCO_MODEL = "model-diloco"  # `assemble --diloco`: DiLoCo's model as a one-expert model

# contributed experts: a kit (flowfleet kit), a package (flowfleet contribute), its admission (flowfleet admit)
KIT_FILE = "kit.json"  # in a kit: the contract and its fingerprint (flowfleet.stages.kit)
KITS = "kits"  # in a run root: the fleet's identity and every kit issued for it (flowfleet.stages.kit)
FLEET_IDENTITY: Final = (KITS, "fleet.json")  # {"fleet_id"}: random, made with the run's first kit
KITS_ISSUED: Final = (KITS, "issued")  # <fingerprint>.json: each kit as `flowfleet kit` wrote it
KIT_RUN = "run.yaml"  # in a kit: the run's configuration, which `contribute` trains with (its data replaced)
KIT_CENTROIDS = "centroids.safetensors"  # in a kit: the fleet's cluster centroids in semantic-feature space
PACKAGE_MANIFEST = "manifest.json"  # in a package: every file's sha256, the kit's fingerprint, the training record
PACKAGE_SIGNATURE = "manifest.sig"  # in a package: Ed25519 over manifest.json's bytes
PACKAGE_SIGNER = "signer.pub"  # in a package: the signer's public key (trusted only if the owner lists it)
PACKAGE_EXPERT = "expert"  # in a package: the expert folder (config.json + safetensors)
PACKAGE_SAMPLE = "latents.safetensors"  # in a package: a capped sample of its prepared items (one shard)
PACKAGE_HELDOUT = "heldout.safetensors"  # in a package: prepared items its expert never trained on (one shard)
CONTRIBUTION = "contribution.json"  # in an admitted expert's folder: the signed manifest (SHA256SUMS lists it)
CONTRIBUTION_SIG = "contribution.sig"
CANDIDATE = "model-candidate"  # `admit`: the grown fleet, assembled for the gate's last check
STUDENT_MODEL = "model-student"  # `distill`: the student as a one-expert model (sampled without guidance)
REPORTS = "reports"
CONTRIBUTIONS: Final = (REPORTS, "contributions")  # `admit`: expert_<k>.png, the fleet before and after, judged
SHOWCASE = "showcase"  # reports/showcase/: the demo's labelled grids, one prompt per digit
POSTHOC_CHOICE: Final = (REPORTS, "posthoc_ema.json")  # `ema --choose`: every length's validation scores, the choices


def evaluation_folder(model_url: str, run_url: str) -> str:
    """Where `evaluate` writes, relative to reports/: "" for the run's own model/ (what `report` reads),
    the model folder's name for any other (model-partial, a student...), so that one never overwrites another."""
    model_url, run_url = model_url.rstrip("/"), run_url.rstrip("/")
    return "" if model_url == f"{run_url}/{MODEL}" else model_url.rsplit("/", 1)[-1]


def router_job(router: str, without: Sequence[int] = (), num_experts: int | None = None) -> str:
    """A router's job folder: router/ or router-paris/; once `add-expert` grew the fleet to K experts,
    router-kK/; once `remove-expert` took experts out, router[-kK]-without-1-3/. Each is a new router
    beside the old ones (a grown fleet's is warm-started from the previous router, a shrunk one's is
    trained from scratch)."""
    name = router if num_experts is None else f"{router}-k{num_experts}"
    return f"{name}-without-{'-'.join(str(k) for k in without)}" if without else name


def data_part(i: int, n: int) -> str:
    """Part i (0-based) of n of a sharded `prepare`: a shard set of its own, joined by `prepare --merge`."""
    return f"{DATA_PARTS}/{i}-of-{n}"


def addition(n: int) -> str:
    """Addition n's folder (`add-expert`): a run root of its own with run.yaml, data/, clusters/, partitions/."""
    return f"{ADDED}/{n}"


def origin_partition(n: int, j: int) -> str:
    """Partition j of the run's data (n = 0) or of addition n: where an expert's job reads (RunConfig.expert_origin)."""
    return partition(j) if n == 0 else f"{addition(n)}/{partition(j)}"


def expert_job(k: int) -> str:
    """Expert k's job folder."""
    return f"{EXPERTS}/{k}"


def partition(k: int) -> str:
    """Expert k's partition of data/ (what its job reads, and nothing else)."""
    return f"{PARTITIONS}/{k}"


def diloco_worker(w: int) -> str:
    """DiLoCo worker w's job folder (run.yaml diloco)."""
    return f"{DILOCO}/worker-{w}"


def diloco_round(r: int) -> tuple[str, ...]:
    """Round r's folder (0-based): each worker's pseudo-gradient of the round and the round's decision."""
    return (*DILOCO_ROUNDS, f"{r:06d}")
