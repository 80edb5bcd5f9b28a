"""run.yaml's train, router_train, monolith and diloco sections: how each job trains."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flowfleet.config.base import Strict


class TrainConfig(Strict):
    steps: int = Field(1000, ge=1)
    # Experts only: how the fleet's K x steps are split. "equal": `steps` each. "by_size": in proportion to
    # each partition's items, so that every expert passes over its data as often as the monolith passes over
    # all of it (decentralized flow matching weights each cluster's loss by its share of the data).
    expert_steps: Literal["equal", "by_size"] = "equal"
    # Experts only: what of the monolith's budget each expert takes its share of (expert_steps says the share). "steps"
    # (Paris' convention): every expert the monolith's batch, for its share of K x steps. "batch" (DDM's: its
    # experts split the monolith's batch of 256 into 8 of 32 and each trains the monolith's 800k steps): every expert
    # K x steps, at its share of batch_size. The same FLOPs either way, another optimisation.
    split: Literal["steps", "batch"] = "steps"
    batch_size: int = Field(64, ge=1)  # per optimiser step, across accumulation and DDP ranks
    grad_accum: int = Field(1, ge=1)
    lr: float = Field(1e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    # After the warm-up: constant; cosine to 0 over the rest; or "wsd" (warmup-stable-decay: constant, then
    # linear to 0 over the last `cooldown` fraction of the steps; Hägele et al. 2024), the final iterate annealed.
    schedule: Literal["constant", "cosine", "wsd"] = "constant"
    cooldown: float = Field(0.2, gt=0, le=1)  # wsd: the fraction of the steps after the warm-up that decays
    warmup_steps: int = Field(0, ge=0)
    ema_decay: float = Field(0.9999, ge=0, le=1)
    ema_warmup: bool = True  # decay min(ema_decay, (1 + n) / (10 + n)) after n updates, so short runs average too
    # Post-hoc EMA (EDM2): the relative lengths of the power-function EMAs tracked beside `ema_decay`'s (e.g. [0.05,
    # 0.1]), and every how many steps their weights are kept (the job's ema/ folder), from which an EMA of any
    # length between is reconstructed after training (flowfleet.train.phema). Empty: none tracked.
    posthoc_ema: tuple[float, ...] = ()
    posthoc_every: int = Field(500, ge=1)
    grad_clip: float | None = Field(None, gt=0)
    precision: Literal["fp32", "fp16", "bf16"] = "fp32"  # autocast on CUDA only; CPU runs fp32
    # torch.compile the model as it trains (its forward and backward: fused kernels, fewer passes over memory) after a
    # one-off compile at the first step, which a later job of the same shape reads from the compiler's cache. Needs a
    # C++ compiler on a CPU, Triton on a GPU; where there is none the job warns and trains eagerly
    compile: bool = False
    time_sampling: Literal["uniform", "logit_normal"] = "uniform"
    # logit_normal: t = sigmoid(time_mean + time_std * n), n ~ N(0, 1) (SD3's 0 and 1; a positive mean draws noisier t)
    time_mean: float = 0.0
    time_std: float = Field(1.0, gt=0)
    # Experts and the monolith: each item's velocity error weighted over t (flowfleet.flow.loss.loss_weight): "none",
    # or "min_snr", Min-SNR-gamma's min(SNR, min_snr_gamma) on the clean estimate's error (Hang et al. 2023)
    loss_weighting: Literal["none", "min_snr"] = "none"
    min_snr_gamma: float = Field(5.0, gt=0)
    # Experts and the monolith: the dispersive loss (flowfleet.flow.loss.dispersive_loss) of one block's output
    # tokens added to the regression loss with this weight (0: off; its authors' code adds it at 0.25), at temperature
    # dispersive_tau, after block dispersive_block (from 0; negative counts from the last block)
    dispersive_weight: float = Field(0.0, ge=0)
    dispersive_tau: float = Field(1.0, gt=0)
    dispersive_block: int = -1
    # Experts and the monolith with expert.repa_dim > 0: REPA's alignment (Yu et al. 2025) of one block's hidden
    # tokens, through the model's projector, with a frozen encoder's tokens of the same item that prepare stores
    # (flowfleet.flow.loss.alignment_loss), added at this weight (REPA's 0.5) after block repa_block (from 0;
    # negative counts from the last; None: depth // 3, REPA's block 8 of SiT-XL's 28 and 4 of SiT-B's 12)
    repa_weight: float = Field(0.5, ge=0)
    repa_block: int | None = None
    ckpt_every: int = Field(500, ge=1)
    # Rank 0 writes each checkpoint in a thread of its own while training goes on (its tensors copied to host memory
    # at the step); False: the step waits for the write
    async_checkpoint: bool = True
    # After a SIGTERM, the seconds the job has before it is killed (a scheduler's grace): the stop's own checkpoint is
    # written only where the last write took less; else the job ends on its newest complete checkpoint
    stop_grace_s: float = Field(30.0, gt=0)
    sample_every: int = Field(500, ge=1)
    log_every: int = Field(10, ge=1)
    seed: int = 0
    max_bad_steps: int = Field(3, ge=1)  # consecutive non-finite losses before stopping
    # On a CPU: a job's thread count follows the machine's load between steps (faster beside other work) instead of
    # staying fixed; a fixed count is what makes the same seed give the same weights (flowfleet.threads)
    follow_load: bool = False
    keep_checkpoints: int = Field(2, ge=1)  # newest complete checkpoints kept per job
    # How a job holds its data: "memory" (every item loaded at the start) or "stream" (each batch's items read from the
    # shard files: memory that does not grow with the data, flowfleet.train.stream); the same batches either way
    loader: Literal["memory", "stream"] = "memory"
    # Steps whose batches a background thread reads while the current step computes (and pins for a GPU), as a
    # DataLoader's prefetch_factor; None: 1 with the stream loader, 0 with every item in memory. The same batches
    prefetch: int | None = Field(None, ge=0)
    # Threads reading a streamed batch's items from the shard files (a DataLoader's num_workers)
    loader_workers: int = Field(4, ge=1)
    # Experts and the monolith: the probability that a drawn item is replaced by one of its augmented copies
    # (data.augment.copies; the model is conditioned on how, expert.augment_dim). 0: the prepared items only.
    augment_p: float = Field(0.0, ge=0, le=1)

    @property
    def read_ahead(self) -> int:
        """train.prefetch as it applies: the steps read ahead."""
        if self.prefetch is not None:
            return self.prefetch
        return 1 if self.loader == "stream" else 0

    @model_validator(mode="after")
    def _check(self) -> "TrainConfig":
        if self.batch_size % self.grad_accum:
            raise ValueError(f"batch_size: {self.batch_size} is not divisible by grad_accum {self.grad_accum}")
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps: {self.warmup_steps} exceeds steps {self.steps}")
        for length in self.posthoc_ema:
            if not 0 < length < 12**-0.5:  # the longest power-function EMA, gamma -> -1, is the uniform average's
                raise ValueError(f"posthoc_ema: {length} is not a relative length in (0, {12**-0.5:.4f})")
        return self


class MonolithConfig(Strict):
    enabled: bool = True
    match_compute: bool = True  # steps so that training FLOPs equal the fleet's (experts + router)


class DiLoCoConfig(Strict):
    """One model trained by K isolated workers that exchange only through the run root (DiLoCo, Douillard et al.
    2023): each trains the `expert` architecture on a random 1/K of all the data with the inner optimiser for
    `sync_every` steps, writes its pseudo-gradient (the round's start weights minus its own), and applies the outer
    Nesterov step of the workers' mean, identically on every worker (flowfleet.train.diloco)."""

    workers: int = Field(4, ge=1)
    steps: int | None = Field(None, ge=1)  # each worker's inner steps; default train.steps (an expert's)
    sync_every: int = Field(100, ge=1)  # H: inner steps per round (the last round may be shorter)
    inner: Literal["adamw", "sgd"] = "adamw"  # sgd with outer_lr 1 and no momentum: local SGD (FedAvg)
    outer_lr: float = Field(0.7, gt=0)  # DiLoCo's 0.7, momentum 0.9, Nesterov
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    nesterov: bool = True
    # How long a worker waits at a round's end for the others' pseudo-gradients before it goes on with those
    # present (a lost or late worker), seconds.
    round_timeout_s: float = Field(600.0, gt=0)
    # Each worker's pace on machines of different speeds (Async Local-SGD's dynamic local updates, Liu et al. 2024):
    # worker w does pace[w] x sync_every inner steps a round and pace[w] x steps in all, so that a machine pace[w]
    # times as fast as the slowest ends each round when the slowest does. The same rounds for every worker; None:
    # every worker 1.
    pace: list[int] | None = None

    @model_validator(mode="after")
    def _check_pace(self) -> "DiLoCoConfig":
        if self.pace is not None:
            if len(self.pace) != self.workers:
                raise ValueError(f"pace: {len(self.pace)} entries for {self.workers} workers")
            if any(p < 1 for p in self.pace):
                raise ValueError(f"pace: {self.pace} (each a whole number >= 1)")
        return self

    def pace_of(self, worker: int) -> int:
        return 1 if self.pace is None else self.pace[worker]
