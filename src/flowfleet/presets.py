"""Named starting points for run.yaml (`flowfleet init RUN_ROOT --preset NAME`).

emoji / emoji-tiny    the built-in emoji (flowfleet.data.sources.emoji: 7572 in two art styles, `flowfleet fetch-data
                      --set emoji`) at 32 px in the latent of an autoencoder prepare trains, K = 4 clusters of
                      Inception features (power-normalised, none under 15 %); DDM's recipe: a router that reads the
                      prompt as the experts do, guidance over the mixture, each expert all the steps at its share of
                      the batch, top-2; the set's 1000 held-out emoji held out (tiny: 16 px pixels)
mnist / mnist-tiny    the built-in digits (flowfleet.data.sources.mnist: the 10,000 once fetched, else MNIST-5k) at
                      28 px in the 8 x 8 x 4 latent of an autoencoder prepare trains (tiny:
                      16 px pixels, Paris' prompt-blind router), K = 4 clusters of image features, the emoji's
                      router and guidance under Paris' compute matching (each expert the batch, its share of the
                      steps), top-2; the last 1000 digits held out for evaluation
images                the emoji recipe for a folder of your own images (`--set data.path=FOLDER`)
shapes / shapes-tiny  built-in procedural shapes (RGB), captions describing shape and colour
paris-b2 / paris-xl2  the Paris paper's §3.1 recipes: 32x32x4 sd-vae-ft-mse latents, CLIP ViT-L/14
                      text, DiT-B/2 experts + DiT-S router, or DiT-XL/2 experts + DiT-B router

The built-in recipes' choices were each measured on their data. The figures that hold for today's code are in
BENCHMARKS.md; those of a choice measured earlier are in git, by the section title each comment gives
(`git show 3844c21:docs/benchmarks-history.md`).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

from flowfleet.config import RunConfig, set_dotted


def _builtin(
    source: str,
    *,
    size: int,
    channels: int,
    k: int,
    steps: int,
    router_steps: int,
    batch: int,
    text_len: int,
    autoencoder: dict[str, Any] | None = None,
    semantic: dict[str, Any] | None = None,
    hidden: int = 128,
    router_hidden: int = 64,
    router_lr: float = 1e-3,
    router_batch: int | None = None,
    lr: float = 2e-3,
    grad_clip: float | None = None,
    caption_residual: bool = False,
    cluster_power: float = 1.0,
    fine_k: int | None = None,
    min_share: float = 0.05,
    expert_steps: str = "equal",
    guidance_max_t: float = 1.0,
    patch: int | None = None,
    router_reads_prompt: bool = False,
    split: str = "steps",
    time_mean: float = 0.0,
    **data: Any,
) -> dict[str, Any]:
    """The built-in sources' recipe, chosen by measurement on MNIST-5k (the probes mnist_recipe.py and
    expert_space.py, since retired): a DiT of depth 4 on 16 tokens (hidden 128, or `hidden`) with
    the exact GELU (DiT's tanh approximation of it is slower as an op on a CPU), conditioned on the caption's
    pooled MiniLM vector; AdamW (2e-3, or `lr`) with 100 warm-up steps, batch 64 (or `batch`), logit-normal t (of
    mean 0, or `time_mean`), an EMA that warms up; 20 Euler steps at CFG 3 (the evaluation's guidance sweep picks
    each model's scale).
    Its space: with `autoencoder`, the 8 x 8 x 4 latent of a small AutoencoderKL that prepare trains on the
    training digits (padded 28 -> 32), 2 x 2 patches: it reaches a given classifier FD in fewer steps than pixels
    in 7 x 7 patches, which also leave tile edges ("Which expert space"); else pixels in 7 x 7 patches.

    mnist clusters as Paris does: K clusters of the images' features (a pretrained image network's, Inception at
    75 px, as Paris uses DINOv2's; less their caption-predictable part, so that every cluster holds every digit),
    top-2 sampling, and the last 1000 digits held out of training as the evaluation's reference. Its router
    (router_reads_prompt: DDM's, told the prompt as the experts are; else Paris', which sees only (x_t, t)) and
    how the experts take their share of the monolith's budget (split: "batch" DDM's, "steps" Paris') are the
    recipe's last two choices."""
    latent, patch, latent_encoder = _space(size, channels, patch, autoencoder)
    condition = dict(conditioning="pooled", text_dim=384, cond_dropout=0.1)
    expert = _dit(hidden, 4, 4, patch, latent, **condition)
    # Paris §2.5: p(k | x_t, t), blind to the prompt; or (router_reads_prompt, DDM's) told the prompt as the experts
    # are, with their condition dropout: p(k | x_t, t, prompt) and p(k | x_t, t, null)
    told = condition if router_reads_prompt else dict(conditioning="none")
    router = _dit(router_hidden, 2, 2, patch, latent, num_outputs=k, **told)
    cluster: dict[str, Any] = dict(
        k=k,
        fine_k=fine_k or min(64, 8 * k),
        iters=25,
        features="semantic",
        caption_residual=caption_residual,
        power=cluster_power,
        min_share=min_share,
    )
    semantic = semantic or dict(name="inception")
    return dict(
        data=dict(source=source, image_size=size, channels=channels, **data),
        encoders=dict(latent=latent_encoder, semantic=semantic, text=dict(name="minilm", max_length=text_len)),
        cluster=cluster,
        expert=expert,
        router=router,
        **_schedules(
            steps, router_steps, expert_steps, split, batch, lr, router_lr, router_batch or batch, grad_clip, time_mean
        ),
        sampling=dict(steps=20, guidance_scale=3.0, strategy="top2", guidance_max_t=guidance_max_t, guidance="mixture"),
    )


def _space(
    size: int, channels: int, patch: int | None, autoencoder: dict[str, Any] | None
) -> tuple[tuple[int, int, int], int, dict[str, Any]]:
    """(latent shape, patch, encoders.latent): the autoencoder's latent in 2 x 2 patches, else pixels in 7 x 7
    (4 x 4 where 7 does not divide the side) or `patch` patches."""
    if autoencoder is None:
        return (channels, size, size), patch or (7 if size % 7 == 0 else 4), dict(name="pixels")
    side = autoencoder.get("pad_to") or size
    factor = 2 ** (len(autoencoder["block_out_channels"]) - 1)
    latent = (autoencoder["latent_channels"], side // factor, side // factor)
    return latent, 2, dict(name="autoencoder", autoencoder=autoencoder)


def _dit(hidden: int, depth: int, heads: int, patch: int, latent: tuple[int, int, int], **extra: Any) -> dict[str, Any]:
    """A DiT section (expert or router) of the built-in recipe: the exact GELU, the latent's grid and channels."""
    return dict(
        size=None,
        hidden_size=hidden,
        depth=depth,
        num_heads=heads,
        mlp_act="gelu",
        patch_size=patch,
        input_size=latent[1:],
        in_channels=latent[0],
        **extra,
    )


def _schedules(
    steps: int,
    router_steps: int,
    expert_steps: str,
    split: str,
    batch: int,
    lr: float,
    router_lr: float,
    router_batch: int,
    grad_clip: float | None,
    time_mean: float,
) -> dict[str, Any]:
    """The train and router_train sections: the experts' (and the monolith's) AdamW with a short warm-up,
    logit-normal t of mean `time_mean` and a warming EMA; the router's on a cosine schedule; intervals that follow
    the steps."""
    return dict(
        train=dict(
            steps=steps,
            expert_steps=expert_steps,
            split=split,
            batch_size=batch,
            lr=lr,
            grad_clip=grad_clip,
            warmup_steps=min(100, steps // 3),
            time_sampling="logit_normal",
            time_mean=time_mean,
            ema_decay=0.999,
            ckpt_every=max(steps // 4, 1),
            sample_every=max(steps // 2, 1),
            log_every=max(steps // 50, 1),
        ),
        router_train=dict(
            steps=router_steps,
            batch_size=router_batch,
            lr=router_lr,
            schedule="cosine",
            ema_decay=0.999,
            ckpt_every=max(router_steps // 2, 1),
            sample_every=router_steps,
            log_every=max(router_steps // 50, 1),
        ),
    )


def _digits(**changes: Any) -> dict[str, Any]:
    """The digits' recipe (preset mnist), every choice measured on them; `changes` replace its arguments of
    _builtin (the emoji's recipe is this one with the changes their data asks for)."""
    recipe: dict[str, Any] = dict(
        source="mnist",
        size=28,
        channels=1,
        k=4,
        # Experts of hidden 64 for three times the steps of hidden 128 (the same FLOPs): sharper samples that follow
        # the prompt better, and cheaper to sample ("Expert width at equal FLOPs")
        hidden=64,
        # Batches of 32 at 4e-3 rather than 64 at 2e-3 for half the steps: more updates for the same samples.
        # 1500 steps an expert, half the 3000 the demo trained before: the autoencoder's batches of 8 and the noisier
        # t (time_mean, below) bought the FD those steps did, so the demo spends the gain on its time ("The time
        # sampler's mean")
        steps=1500,
        # Each expert's share of the fleet's work follows its cluster's size (under split "batch": its share of the
        # batch), so that it passes over its data as often as the monolith over all of it ("Each expert's steps")
        expert_steps="by_size",
        batch=32,
        lr=4e-3,
        # At 4e-3 a long monolith can spike; late gradients are well under 1 in norm, so a clip at 1 cuts only spikes
        grad_clip=1.0,
        # t drawn noisier than SD3's logit-normal(0, 1), more of the steps where a digit's shape is set: the
        # validation split chose a mean of 0.5 of -0.5 / 0.5 / 1; the fleet gains the most ("The time sampler's mean")
        time_mean=0.5,
        # A router long enough to read its clusters at low t; the fleet gains a little and the monolith, which is
        # given the router's FLOPs too, nothing ("The router's training budget"). Its 4000 batches of 32 as 2000 of
        # 64: the same samples and FLOPs, and the same top-2 over 3 seeds, for half the steps of a model whose step
        # is mostly fixed cost ("The demos' wall time")
        router_steps=2000,
        router_batch=64,
        router_hidden=32,
        router_lr=2e-3,
        text_len=16,
        # the last 1000 digits (100 of each) held out: 300 of them the validation split the evaluation chooses on
        # (every one its reference), the other 700 the test split it reports (a real floor and its reference)
        holdout=1000,
        validation=0.3,
        # Batches of 8 at 4e-3 for 1600 steps: half the FLOPs of 800 batches of 32 at 2e-3, and its reconstructions of
        # held-out digits closer (more updates); fewer steps leave a larger reconstruction error and a worse monolith
        # ("The demos' wall time")
        autoencoder=dict(
            block_out_channels=[16, 32, 32], latent_channels=4, pad_to=32, steps=1600, batch_size=8, lr=4e-3
        ),
        # Inception at 75 px, less what the caption predicts of it. Clusters that follow the digit would let a
        # cluster fix the prompted digit, and Paris' prompt-blind router, which cannot know it at high t, send a
        # "zero" to experts that hold none ("Which clusters a prompt-blind router can serve"); without the
        # caption's part every cluster holds every digit ("Clusters of what the caption does not tell").
        caption_residual=True,
        semantic=dict(name="inception", image_size=75),
        # Guidance only at t <= 0.78, the 15 of the 20 steps from t = 0.75 down (Kynkaanniemi et al. 2024: the
        # noisiest steps unguided; "Guidance in a limited interval")
        guidance_max_t=0.78,
        # DDM's sampling (BENCHMARKS.md, "Guidance over the mixture: the claim on the test split"): the router reads
        # the prompt as the experts do (their conditioning and condition dropout) and the fleet is guided over the
        # mixture, each branch by its own posterior. It gains most where the prompt decides the expert (the emoji);
        # the digits' clusters each hold every digit, and take it all the same: one recipe for both
        router_reads_prompt=True,
        # Paris' compute matching: each expert the monolith's batch of 32 for its cluster's share of K x train.steps.
        # On the digits DDM's (split "batch": every expert all the steps at its share of the batch) gives the same
        # figures within the seeds' spread at the same FLOPs, in more wall time: a step's fixed cost is paid K times
        # as often ("The demos' wall time")
        split="steps",
    )
    return _builtin(**{**recipe, **changes})


def _emoji(source: str, holdout: int = 0, **data: Any) -> dict[str, Any]:
    """The built-in emoji's recipe (emoji), and the same for a folder of your own images (images: captions in
    captions.jsonl / .csv or a .txt beside each image, labels optional; `flowfleet init RUN --preset images --set
    data.path=FOLDER`): 32 px colour in the 8 x 8 x 8 latent of an autoencoder prepare trains, K = 4 clusters of
    Inception features at 75 px (its standard 299 px costs an order of magnitude more on a CPU), power-normalised,
    none under 15 % of the data (a smaller one takes the fine clusters nearest it; BENCHMARKS.md, "The emoji's
    clusters"), and the digits' training recipe under DDM's compute matching."""
    return _digits(
        source=source,
        size=32,
        channels=3,
        # 750 steps an expert, half the 1500 the demo trained before: the autoencoder, guidance at every step and the
        # noisier t (time_mean, below) bought more than those steps; at a third of them the judge read fewer emoji's
        # subcategory right than before ("The time sampler's mean")
        steps=750,
        router_steps=2000,
        router_batch=32,  # (the digits' batches of 64 were measured on the digits only)
        holdout=holdout,
        validation=0.3 if holdout else 0.0,
        # 8 latent channels, not the digits' 4: a colour image is three times the numbers. 2400 steps of 8 at 4e-3:
        # at 800 steps of 16 its reconstructions were a ceiling the models sat under; 1600 of 16 lowered every
        # model's classifier FD at the same training FLOPs, and 2400 of 8 (three quarters of those images, more
        # updates) reconstructs as closely, the models' FD the same ("The demos' wall time")
        autoencoder=dict(block_out_channels=[16, 32, 32], latent_channels=8, steps=2400, batch_size=8, lr=4e-3),
        # clusters of content: no caption residual (each expert holds its own emoji), features power-normalised
        caption_residual=False,
        cluster_power=0.5,
        fine_k=128,
        min_share=0.15,
        # DDM's compute matching, where the prompt decides the expert: its fleet follows the prompt's subcategory
        # better than under Paris' and draws sharper emoji, for the wall time its small expert batches cost ("The
        # demos' wall time")
        split="batch",
        # Guidance at every step, not the digits' interval: the emoji's category and shape are set at the noisiest
        # steps, and guiding them lowered both models' classifier FD and raised their prompt accuracy on the
        # validation split, in every seed ("Sampling at the demos' budget")
        guidance_max_t=1.0,
        # t noisier still than the digits': the validation split chose 1 of -0.5 / 0.5 / 1 / 1.5, where both models
        # drew closer to the held-out emoji and read more prompts right ("The time sampler's mean")
        time_mean=1.0,
        **data,
    )


def _tiny(cfg: dict[str, Any]) -> dict[str, Any]:
    cfg["expert"].update(hidden_size=64, depth=2, num_heads=2, patch_size=4)
    cfg["router"].update(hidden_size=32, depth=1, num_heads=2, patch_size=4)
    cfg["sampling"].update(steps=6)
    cfg["train"]["warmup_steps"] = 0  # tiny runs are a few dozen steps (tests override them to fewer)
    if cfg["encoders"]["semantic"]["name"] == "inception":
        # Inception at 96 px instead of 299: a fraction of the compute per image, enough for a test
        cfg["encoders"]["semantic"].update(image_size=96)
    return cfg


def _pixel_features() -> dict[str, Any]:
    return dict(name="pixels", image_size=16)  # tests: no Inception pass


def _tiny_of(source: str, channels: int, **data: Any) -> dict[str, Any]:
    """A built-in source at test size: 16 px, K = 3, 30 steps (the tests override them to fewer)."""
    return _tiny(
        _builtin(
            source,
            size=16,
            channels=channels,
            k=3,
            steps=30,
            router_steps=30,
            batch=32,
            text_len=8,
            shard_size=128,
            **data,
        )
    )


def _paris(expert_size: str, router_size: str) -> dict[str, Any]:
    text_len = 77
    return dict(
        data=dict(
            source="webdataset",
            path="/path/to/laion-aesthetic/{00000..01099}.tar",
            image_size=256,
            channels=3,
            shard_size=4096,
            batch_size=64,
        ),
        encoders=dict(
            latent=dict(name="sd-vae-ft-mse", path="stabilityai/sd-vae-ft-mse"),
            semantic=dict(name="dinov2", path="facebook/dinov2-large"),
            text=dict(name="clip", path="openai/clip-vit-large-patch14", max_length=text_len),
        ),
        cluster=dict(k=8, fine_k=1024, sample_size=1_000_000, iters=20),
        expert=dict(
            size=expert_size,
            input_size=(32, 32),
            in_channels=4,
            adaln="single",
            conditioning="cross_attn",
            text_dim=768,
            text_len=text_len,
            cond_dropout=0.1,
        ),
        router=dict(size=router_size, input_size=(32, 32), in_channels=4, num_outputs=8),
        # batch 128 x 2 accumulation = 256 per step (paris §3.1.1)
        train=dict(
            steps=400_000,
            batch_size=256,
            grad_accum=2,
            lr=1e-4,
            ema_decay=0.9999,
            precision="bf16",
            ckpt_every=5000,
            sample_every=5000,
            log_every=100,
        ),
        # router: batch 64 x 4 accumulation = 256, lr 5e-5, cosine
        router_train=dict(
            steps=100_000,
            batch_size=256,
            grad_accum=4,
            lr=5e-5,
            schedule="cosine",
            ema_decay=0.9999,
            precision="bf16",
            ckpt_every=5000,
            sample_every=100_000,
            log_every=100,
        ),
        sampling=dict(steps=50, guidance_scale=4.0, strategy="top2", shift=1.0),
    )


PRESETS: dict[str, Callable[[], dict[str, Any]]] = {
    "mnist": _digits,
    "emoji": lambda: _emoji("emoji", holdout=1000),
    "images": lambda: _emoji("folder", path="/path/to/your/images"),
    "emoji-tiny": lambda: _tiny_of("emoji", 3, semantic=_pixel_features(), router_reads_prompt=True, split="batch"),
    "mnist-tiny": lambda: _tiny_of("mnist", 1, limit=384, semantic=_pixel_features()),
    "shapes": lambda: _builtin(
        "shapes", size=32, channels=3, k=4, steps=1500, router_steps=600, batch=64, text_len=16, count=4000
    ),
    "shapes-tiny": lambda: _tiny_of("shapes", 3, count=256),
    "paris-b2": lambda: _paris("B/2", "S/2"),
    "paris-xl2": lambda: _paris("XL/2", "B/2"),
}


def preset(preset_name: str, *, sets: Sequence[str] = (), **overrides: Any) -> RunConfig:
    """Build a validated RunConfig from a preset name, its top-level sections replaced by `overrides` and its
    dotted keys set by `sets` ("data.path=/my/images": config.set_dotted) before it is validated."""
    if preset_name not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r} (expected one of {', '.join(PRESETS)})")
    raw = PRESETS[preset_name]()
    raw["name"] = overrides.pop("name", preset_name)
    raw.update(overrides)
    for assignment in sets:
        set_dotted(raw, assignment)
    return RunConfig.from_dict(raw, where=f"preset {preset_name}")
