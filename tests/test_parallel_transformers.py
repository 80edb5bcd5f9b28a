"""Patch-parallel diffusers transformers (flowfleet.parallel.parallelize on PixArt, SD3 and Flux).

Whole scheduler loops with classifier-free guidance run on 2, 3 and 4 gloo ranks (one thread each), with
and without CFG split, and are compared with the same loop on the plain model. Each model is tiny and
trained here for 300 steps (~10 s) to draw one of four smooth latents per caption
(fixtures/transformers.py: trained): displaced patch parallelism pays off only on a model whose
attention has learned structure; on a random one, stale and missing keys/values are both just noise
(measured while writing this: random weights, 20 steps, N = 2: displaced 32.7 dB, naive 38.7 dB).
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from fixtures.transformers import (
    TINY,
    caption,
    image_ids,
    pack,
    predict,
    smooth_targets,
    tiny_pixart,
    trained,
    transformer_tol,
)

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel import parallelize
from flowfleet.parallel.launch import run_local
from flowfleet.parallel.transformers import ParallelPixArt

FORK = dict(start_method="fork", timeout_s=60.0)
STEPS = 8


pytestmark = pytest.mark.usefixtures("one_thread")  # like every rank: two threads contend on 2 cores


def guided_loop(model, x: torch.Tensor, text: torch.Tensor, scale: float = 4.0, steps: int = STEPS) -> torch.Tensor:
    """A pipeline's loop: one call on [unconditional; conditional], then CFG (flow matching Euler)."""
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    both = torch.cat([torch.zeros_like(text), text])  # [2B, L, D]
    with torch.no_grad():
        for t in scheduler.timesteps:
            uncond, cond = predict(model, torch.cat([x, x]), both, t.expand(2 * x.shape[0])).chunk(2)
            x = scheduler.step(uncond + scale * (cond - uncond), t, x).prev_sample
    return x


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (x - ref).pow(2).mean().item()
    return 10 * math.log10((ref.max() - ref.min()).item() ** 2 / max(mse, 1e-30))


@pytest.fixture(scope="module", params=["pixart", "sd3", "flux"])
def model(request):
    model, captions = trained(request.param, steps=300)
    return request.param, model, captions


def start(size: int) -> torch.Tensor:
    return torch.randn(1, 4, size, size, generator=torch.Generator().manual_seed(5))


def _ranks(ctx, kind: str, state: dict, captions: torch.Tensor, size: int, splits: list[bool]) -> dict:
    model = TINY[kind]()
    model.load_state_dict(state)
    out = {}
    for split in splits:
        for mode in ("sync", "displaced", "naive"):
            with parallelize(model, ctx.world, mode=mode, warmup=1, cfg_split=split) as handle:
                key = f"{mode}/{'split' if split else 'whole'}"
                out[key] = guided_loop(model, start(size), captions[1:2])
                out[f"{key}/bytes"] = handle.comm.bytes_by_step
                out[f"{key}/type"] = type(handle).__name__
    return out


@pytest.mark.parametrize(
    "nproc, size, splits",
    [(2, 12, [False, True]), (3, 12, [False]), (4, 12, [True]), (3, 14, [False]), (5, 12, [False])],
    ids=["2", "3", "4-cfg-split", "3-uneven", "5-uneven"],
)
def test_sync_equals_one_device_and_displaced_beats_naive_by_3db(model, nproc, size, splits):
    """12 x 12 latents are 6 token rows: 2 and 3 ranks split them evenly; 14 x 14 (7 rows) on 3 ranks and
    12 x 12 on 5 ranks give bands of 3/2/2 and 2/1/1/1/1 rows (Flux: 17/16/16 and 8/7/7/7/7 tokens)."""
    kind, net, captions = model
    ref = guided_loop(net, start(size), captions[1:2])
    if size == 12:
        assert psnr(ref, smooth_targets()[1:2]) > 20  # the model draws what caption 1 asks for
    ranks = run_local(_ranks, nproc, (kind, net.state_dict(), captions, size, splits), **FORK)
    r0 = ranks[0]
    for split in splits:
        tag = "split" if split else "whole"
        for mode in ("sync", "displaced", "naive"):
            assert all(torch.equal(r[f"{mode}/{tag}"], r0[f"{mode}/{tag}"]) for r in ranks), f"{mode}/{tag}"
            assert torch.isfinite(r0[f"{mode}/{tag}"]).all()
        assert (
            r0[f"sync/{tag}/type"] == {"pixart": "ParallelPixArt", "sd3": "ParallelSD3", "flux": "ParallelFlux"}[kind]
        )
        assert (r0[f"sync/{tag}"] - ref).abs().max() <= transformer_tol(ref, STEPS), (
            (r0[f"sync/{tag}"] - ref).abs().max()
        )
        scores = {mode: round(psnr(r0[f"{mode}/{tag}"], ref), 1) for mode in ("displaced", "naive")}
        print(
            f"{kind} N={nproc} {size}x{size} {tag}: PSNR vs one device {scores}, "
            f"rank 0 bytes/step {r0[f'sync/{tag}/bytes'][1]}"
        )
        if nproc // (2 if split else 1) > 1:  # bands within a group: displaced uses its neighbours' tokens
            assert scores["displaced"] >= scores["naive"] + 3, scores
        else:  # one rank per CFG half: the whole image on each, exact in every mode
            assert scores["naive"] > 100 and scores["displaced"] > 100, scores


def _sequence_ranks(ctx, kind: str, state: dict, captions: torch.Tensor, size: int, split: bool, modes) -> dict:
    model = TINY[kind](heads=6)
    model.load_state_dict(state)
    out = {}
    for mode in modes:
        with parallelize(model, ctx.world, mode=mode, cfg_split=split) as handle:
            out[mode] = guided_loop(model, start(size), captions[1:2])
            out[f"{mode}/bytes"] = handle.comm.bytes_by_step
            out[f"{mode}/modes"] = {m.value for m in handle.modes}
            out[f"{mode}/mesh"] = handle.step.mesh.describe()
    return out


@pytest.mark.parametrize("kind", ["pixart", "sd3", "flux"])
@pytest.mark.parametrize(
    "nproc, size, split, modes",
    [
        (2, 12, False, ("ulysses", "ring")),
        (3, 14, False, ("ulysses", "ring")),
        (4, 12, True, ("ulysses", "ring")),
        (4, 14, False, ("usp",)),
    ],
    ids=["2", "3-uneven", "4-cfg-split", "usp-2x2-uneven"],
)
def test_sequence_parallel_equals_one_device(kind, nproc, size, split, modes):
    """Exact sequence parallelism on a random 6-head model (Ulysses splits heads over 2 or 3 ranks): a whole
    guided loop equals the plain model's up to float reordering from the first step (no warm-up, nothing
    stale), every rank ends with the same latent, and SD3's and Flux's text stream, which every rank holds,
    stays the same on every rank. 14 x 14 on 3 ranks: bands of 3/2/2 token rows (Flux: 17/16/16 tokens);
    4 ranks with CFG split: two bands per guidance half; usp on 4 ranks: Ulysses over pairs of bands
    (gcd of 4 bands and 6 heads), ring across the two pairs, on bands of 2/2/2/1 rows."""
    net = TINY[kind](heads=6)
    captions = torch.cat([caption(seed=10 + i) for i in range(2)])
    ref = guided_loop(net, start(size), captions[1:2])
    ranks = run_local(_sequence_ranks, nproc, (kind, net.state_dict(), captions, size, split, modes), **FORK)
    for mode in modes:
        assert all(torch.equal(r[mode], ranks[0][mode]) for r in ranks), mode
        assert ranks[0][f"{mode}/modes"] == {mode}  # every evaluation, the first included
        diff = (ranks[0][mode] - ref).abs().max()
        assert diff <= transformer_tol(ref, STEPS, heads=6), (mode, diff)
        assert all(b > 0 for b in ranks[0][f"{mode}/bytes"].values())  # the bands really exchanged tokens
    bands = nproc // (2 if split else 1)
    expected = {"ulysses": f"ulysses degree {bands} x ring degree 1", "ring": f"ulysses degree 1 x ring degree {bands}"}
    expected["usp"] = "ulysses degree 2 x ring degree 2"
    assert all(ranks[0][f"{mode}/mesh"] == expected[mode] for mode in modes)


@pytest.mark.parametrize("kind", ["pixart", "sd3", "flux"])
def test_ulysses_refuses_heads_the_bands_do_not_divide(kind):
    """Two heads over three or four bands: a one-line error naming the layer, before anything is patched or
    any process group is touched (ring takes any split)."""
    model = TINY[kind]()
    heads_error = r"mode ulysses: \w+ layer [\w.]+ has 2 attention heads, not divisible by the 3 ranks"
    with pytest.raises(FlowfleetError, match=heads_error):
        parallelize(model, Group(None, 0, 3), mode="ulysses")
    assert "forward" not in model.__dict__
    with pytest.raises(FlowfleetError, match="mode ulysses: .* not divisible by the 4 ranks"):
        parallelize(model, Group(None, 0, 4), mode="ulysses")
    with pytest.raises(FlowfleetError, match=r"ulysses_degree 4: must divide every attention layer's heads"):
        parallelize(model, Group(None, 0, 4), mode="usp", ulysses_degree=4)
    with pytest.raises(FlowfleetError, match=r"ulysses_degree 3: must divide the 4 bands of an image"):
        parallelize(model, Group(None, 0, 4), mode="usp", ulysses_degree=3)
    with pytest.raises(FlowfleetError, match=r"ulysses_degree: only with usp \(got ring\)"):
        parallelize(model, Group(None, 0, 4), mode="ring", ulysses_degree=2)


CACHE_STEPS = 20


def cached_loop(model, x: torch.Tensor, text: torch.Tensor) -> tuple[torch.Tensor, list[bool]]:
    """FluxPipeline's loop (no CFG batch: Flux is guidance-distilled), every call in the model's cache
    context as the pipeline opens it -> (latent, per call: did the last block run)."""
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(CACHE_STEPS)
    ran: list[bool] = []
    tail = model.single_transformer_blocks[-1].attn  # runs only when the cache does not skip the call
    hook = tail.register_forward_pre_hook(lambda module, args: ran.__setitem__(-1, True))
    try:
        with torch.no_grad():
            for t in scheduler.timesteps:
                ran.append(False)
                with model.cache_context("cond"):
                    v = predict(model, x, text, t.expand(x.shape[0]))
                x = scheduler.step(v, t, x).prev_sample
    finally:
        hook.remove()
    return x, ran


def _cache_ranks(ctx, state: dict, captions: torch.Tensor, threshold: float) -> dict:
    from diffusers.hooks import FirstBlockCacheConfig

    model = TINY["flux"]()
    model.load_state_dict(state)
    out = {}
    for mode in ("sync", "ring", "displaced"):
        model.enable_cache(FirstBlockCacheConfig(threshold=threshold))  # before parallelize() or after: both work
        with parallelize(model, ctx.world, mode=mode, warmup=1) as handle:
            out[mode], out[f"{mode}/ran"] = cached_loop(model, start(12), captions[1:2])
            out[f"{mode}/decided"] = list(handle.cache.decisions)
        model.disable_cache()
    return out


def test_diffusers_first_block_cache_takes_one_decision_on_every_rank():
    """diffusers' own First Block Cache (Flux's enable_cache) on 2 ranks: each rank sees half of the tokens,
    yet every rank skips exactly the calls that one device skips (the decision's sums are all-reduced), so
    sync and ring equal the cached single-device loop; displaced (stale keys/values, its own decisions)
    runs to the end on both ranks alike. At threshold 0.1 the trained tiny Flux computes 12 of 20 calls
    whole (its first-block change ratios nearest the threshold are 0.105 and 0.094: no float-rounding
    tie)."""
    from diffusers.hooks import FirstBlockCacheConfig

    net, captions = trained("flux", steps=300)
    plain, ran_plain = cached_loop(net, start(12), captions[1:2])
    net.enable_cache(FirstBlockCacheConfig(threshold=0.1))
    ref, ran = cached_loop(net, start(12), captions[1:2])
    net.disable_cache()
    assert all(ran_plain) and 0 < sum(ran) < CACHE_STEPS, ran  # the cache really skips calls
    assert (ref - plain).abs().max() > 10 * transformer_tol(ref, CACHE_STEPS)  # ... which changes the latent
    ranks = run_local(_cache_ranks, 2, (net.state_dict(), captions, 0.1), **FORK)
    for mode in ("sync", "ring"):
        assert ranks[0][f"{mode}/ran"] == ranks[1][f"{mode}/ran"] == ran, mode
        assert ranks[0][f"{mode}/decided"][1:] == ran[1:]  # the first call has nothing cached: no decision made
        assert (ranks[0][mode] - ref).abs().max() <= transformer_tol(ref, CACHE_STEPS), mode
    assert ranks[0]["displaced/ran"] == ranks[1]["displaced/ran"]
    assert torch.equal(ranks[0]["displaced"], ranks[1]["displaced"])


def controlnet_call(model, kind: str, x: torch.Tensor, text: torch.Tensor, residuals: list) -> torch.Tensor:
    """One call with ControlNet residuals ([B, image tokens, 32] per block), as the ControlNet pipelines pass them."""
    t = torch.tensor([500.0])
    if kind == "sd3":
        out = model(
            x,
            encoder_hidden_states=text,
            pooled_projections=text.mean(1),
            timestep=t,
            block_controlnet_hidden_states=residuals,
        ).sample
        return out
    h, w = x.shape[-2:]
    return model(
        pack(x),
        encoder_hidden_states=text,
        pooled_projections=text.mean(1),
        timestep=t / 1000,
        img_ids=image_ids(h, w),
        txt_ids=torch.zeros(text.shape[1], 3),
        controlnet_block_samples=residuals,
        controlnet_single_block_samples=residuals,
    ).sample


def _controlnet_ranks(ctx, kind: str, residuals: list) -> torch.Tensor:
    model = TINY[kind]()
    with torch.no_grad(), parallelize(model, ctx.world, mode="sync"):
        return controlnet_call(model, kind, start(14), caption(), residuals)


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_controlnet_residuals_are_split_per_band(kind):
    """3 ranks on 7 token rows (uneven): each band adds its own tokens' share of every block's residual."""
    model = TINY[kind]()
    g = torch.Generator().manual_seed(6)
    residuals = [torch.randn(1, 49, 32, generator=g) for _ in range(2)]
    with torch.no_grad():
        ref = controlnet_call(model, kind, start(14), caption(), residuals)
        plain = controlnet_call(model, kind, start(14), caption(), [torch.zeros_like(r) for r in residuals])
    assert (ref - plain).abs().max() > 0.01  # the residuals change the output
    ranks = run_local(_controlnet_ranks, 3, (kind, residuals), **FORK)
    for out in ranks:
        assert (out - ref).abs().max() <= transformer_tol(ref, 1), (out - ref).abs().max()


def test_pixart_refuses_what_it_cannot_split():
    model = tiny_pixart()
    handle = ParallelPixArt(model, Group.solo())
    try:
        with pytest.raises(FlowfleetError, match="attention_mask is not supported"):
            model(
                torch.zeros(1, 4, 12, 12),
                encoder_hidden_states=caption(),
                timestep=torch.tensor([1]),
                attention_mask=torch.ones(1, 36),
                added_cond_kwargs={"resolution": None, "aspect_ratio": None},
            )
    finally:
        handle.restore()
    assert "forward" not in model.__dict__
    with pytest.raises(FlowfleetError, match="cfg_split: needs an even number of ranks, got 3"):
        parallelize(model, Group(None, 0, 3), cfg_split=True)
    with pytest.raises(FlowfleetError, match="Linear is not supported .supported: UNet2DConditionModel, PixArt"):
        parallelize(torch.nn.Linear(2, 2))
