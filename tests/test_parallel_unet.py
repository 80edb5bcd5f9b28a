"""Patch-parallel diffusers U-Net (flowfleet.parallel.unet, DistriFusion §4 on UNet2DConditionModel).

Unit tests of the pieces (statistics, halo geometry, modes, checks) run in this process; whole-run tests
run a FlowMatchEulerDiscreteScheduler loop on 2 and 4 gloo ranks (one thread each) and compare the final
latent with the same loop on the plain model.

No trained U-Net exists here, so the ablation test gives a random tiny U-Net an image whose halves differ
(the top rows quiet, the bottom rows loud and shifted, like sky over ground): GroupNorm statistics of one
band are then far from the whole image's, which is the situation the paper's GN ablation is about. On a
statistically uniform random latent the GN variants differ by only ~2 dB (measured while writing this).
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.models.attention_processor import AttnProcessor
from fixtures.tolerances import gamma, max_abs, network_terms, reorder
from fixtures.unets import banded_latent, tiny_unet, unet_tol

from flowfleet.distributed import Group
from flowfleet.errors import FlowfleetError
from flowfleet.parallel.launch import run_local
from flowfleet.parallel.mode import UNET_MODES, ParallelMode
from flowfleet.parallel.step import BandStep
from flowfleet.parallel.unet import NormStats, UNetMode, check_supported, parallelize
from flowfleet.parallel.unet.conv import FirstConvBand, RowHalo
from flowfleet.parallel.unet.norm import band_stats, corrected, normalize, pooled

FORK = dict(start_method="fork", timeout_s=30.0)
MODES = list(UNET_MODES)  # a U-Net's modes (not the transformers' ulysses / ring)
STEPS = 6


pytestmark = pytest.mark.usefixtures("one_thread")  # like every rank: two threads contend on 2 cores


def flow_loop(unet, x: torch.Tensor, text: torch.Tensor, steps: int = STEPS) -> torch.Tensor:
    """A plain diffusers scheduler loop; the U-Net may be patched or not."""
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    with torch.no_grad():
        for t in scheduler.timesteps:
            x = scheduler.step(unet(x, t, encoder_hidden_states=text).sample, t, x).prev_sample
    return x


def psnr(x: torch.Tensor, ref: torch.Tensor) -> float:
    mse = (x - ref).pow(2).mean().item()
    return 10 * math.log10((ref.max() - ref.min()).item() ** 2 / max(mse, 1e-30))


def assert_image_like(x: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    """Finite and not constant (no black image): its spread is at least half the reference's."""
    assert torch.isfinite(x).all(), f"{what}: NaN/inf"
    assert x.std() > 0.5 * ref.std(), f"{what}: nearly constant (std {x.std():.3g} vs {ref.std():.3g})"


# --------------------------------------------------------------------------------------------------
#                                  Pieces, in this process
# --------------------------------------------------------------------------------------------------


def test_modes_map_onto_exchange_and_statistics():
    assert UNetMode.parse("Separate_GN") is UNetMode.SEPARATE_GN
    assert (UNetMode.SYNC.exchange, UNetMode.SYNC.norm) == (ParallelMode.SYNC, NormStats.EXACT)
    assert (UNetMode.DISPLACED.exchange, UNetMode.DISPLACED.norm) == (ParallelMode.DISPLACED, NormStats.CORRECTED)
    assert UNetMode.STALE_GN.norm is NormStats.STALE and UNetMode.SYNC_GN.norm is NormStats.EXACT
    assert UNetMode.SEPARATE_GN.norm is NormStats.SEPARATE
    assert (UNetMode.NAIVE.exchange, UNetMode.NAIVE.norm) == (ParallelMode.NAIVE, NormStats.LOCAL)
    assert [UNetMode.STALE_GN.at_step(s, warmup=2) for s in range(4)] == [UNetMode.SYNC] * 3 + [UNetMode.STALE_GN]
    assert UNetMode.NAIVE.at_step(0, warmup=3) is UNetMode.NAIVE
    assert (UNetMode.RING.exchange, UNetMode.ULYSSES.exchange) == (ParallelMode.RING, ParallelMode.ULYSSES)
    assert UNetMode.RING.at_step(0, warmup=3) is UNetMode.RING  # exact: no warm-up, nothing stale
    with pytest.raises(FlowfleetError, match="unknown U-Net parallel mode"):
        UNetMode.parse("patchy")


def test_pooled_band_statistics_equal_torch_group_norm():
    x = torch.randn(2, 16, 12, 5) * torch.linspace(0.2, 3.0, 12).view(1, 1, 12, 1) + 4.0  # rows differ, |mean| >> std
    norm = torch.nn.GroupNorm(4, 16, eps=1e-5)
    with torch.no_grad():
        norm.weight.normal_(), norm.bias.normal_()
    stats = torch.stack([band_stats(band, 4) for band in x.chunk(3, dim=2)])  # [3 bands, B, G, 2]
    mean, var = pooled(stats)
    ref_var, ref_mean = torch.var_mean(x.reshape(2, 4, -1), dim=-1, correction=0)  # biased, as GroupNorm
    # A group holds 4 channels x 12 x 5 = 240 values of |x| <= ~10: pooling three bands' statistics reorders
    # those sums (the variance's terms are squares, |x|^2); normalising divides by a std >= ~0.2.
    n = 4 * 12 * 5
    torch.testing.assert_close(mean, ref_mean, rtol=0, atol=reorder(n, scale=max_abs(x)))
    torch.testing.assert_close(var, ref_var, rtol=0, atol=reorder(n, scale=max_abs(x) ** 2))
    want = norm(x)
    torch.testing.assert_close(normalize(x, mean, var, norm), want, rtol=0, atol=reorder(n, scale=max_abs(want)))
    unbiased = torch.var(x.reshape(2, 4, -1), dim=-1)  # what would make sync differ from one device
    assert (unbiased - var).abs().min() > 1e-4


def test_corrected_statistics_follow_paper_equation_2():
    g = torch.Generator().manual_seed(0)
    stale = torch.rand(4, 3, 8, 2, generator=g, dtype=torch.float64) + torch.tensor([0.0, 0.5], dtype=torch.float64)
    fresh = torch.rand(3, 8, 2, generator=g, dtype=torch.float64) + torch.tensor([0.0, 0.5], dtype=torch.float64)
    me = 2
    mean, var = corrected(stale, fresh, me)
    second = lambda s: s[..., 1] + s[..., 0] ** 2  # E[x^2] = Var + mean^2  # noqa: E731
    g_mean, g_var = pooled(stale)
    e_mean = g_mean + (fresh[..., 0] - stale[me, ..., 0])  # Eq. 2, mean
    e_second = (g_var + g_mean**2) + (second(fresh) - second(stale[me]))  # Eq. 2, second moment
    e_var = e_second - e_mean**2
    assert torch.equal(mean, e_mean)  # the same two float64 operations
    # the variance is computed rearranged (norm.corrected's docstring): both sides take ~16 float64 roundings
    # of terms no larger than (1 + max |stale|)^2, twice (the second moment and the squared mean)
    tol = gamma(16) * 2 * (1 + max_abs(stale)) ** 2
    torch.testing.assert_close(var, torch.where(e_var < 0, fresh[..., 1], e_var), rtol=0, atol=tol)
    # A band that did not change leaves the previous step's global statistics as they were: d = 0 exactly,
    # so mean = g_mean + 0 and var = g_var + 0 + 0, bit for bit.
    same_mean, same_var = corrected(stale, stale[me], me)
    assert torch.equal(same_mean, g_mean) and torch.equal(same_var, g_var)
    # Where the estimate goes negative, the band's own fresh variance is used.
    quiet = stale.clone()
    quiet[..., 1] = 1e-3
    quiet[me, ..., 1] = 5.0  # this band was loud; now it is quiet, and the estimate drops below zero
    drop = torch.stack((quiet[me, ..., 0], torch.full_like(quiet[me, ..., 1], 1e-3)), dim=-1)
    _, v = corrected(quiet, drop, me)
    assert torch.equal(v, drop[..., 1])  # the fresh variance itself, selected


@pytest.mark.parametrize("k, s, p, d", [(3, 1, 1, 1), (3, 2, 1, 1), (5, 1, 2, 1), (3, 1, 2, 2), (4, 2, 1, 1)])
def test_first_convolution_bands_equal_the_full_convolution(k, s, p, d):
    conv = torch.nn.Conv2d(3, 5, k, stride=s, padding=p, dilation=d)
    x = torch.randn(2, 3, 16, 10)
    full = conv(x)  # [2, 5, 16/s, W']
    halo = RowHalo.of(conv)
    assert halo.top == p
    bands = [FirstConvBand(conv, BandStep(comm=None, index=i, bands=4))(x) for i in range(4)]
    assert all(b.shape[-2] == 16 // s // 4 for b in bands)
    # the same k x k x 3-term dot products on a slice with its halo rows: only their blocking may differ
    torch.testing.assert_close(torch.cat(bands, dim=-2), full, rtol=0, atol=reorder(k * k * 3, scale=max_abs(full)))


def test_unsupported_models_and_inputs_are_one_line_errors():
    with pytest.raises(FlowfleetError, match="expected a diffusers UNet2DConditionModel"):
        check_supported(torch.nn.Conv2d(1, 1, 3))
    unet = tiny_unet()
    unet.down_blocks[0].downsamplers[0].padding = 0  # F.pad((0, 1, 0, 1)) would pad every band's bottom
    with pytest.raises(FlowfleetError, match="padding=0"):
        check_supported(unet)
    unet = tiny_unet()
    unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.set_processor(object())
    with pytest.raises(FlowfleetError, match="attention processor object"):
        check_supported(unet)
    # A 9-row latent cannot be halved by the U-Net's one downsampling, and 3 ranks need 3 x 2 rows at least.
    # The checks run before any communication (no process group here).
    punet = parallelize(tiny_unet(), Group(None, 0, 3), mode="sync")
    for rows in (9, 4):
        with pytest.raises(FlowfleetError, match="must be a multiple of 2 and at least 3 x 2 = 6"):
            punet.forward(torch.randn(1, 4, rows, 8), 10, encoder_hidden_states=torch.randn(1, 7, 32))
    punet.restore()
    punet = parallelize(tiny_unet(), Group(None, 0, 2), mode="sync")
    with pytest.raises(FlowfleetError, match="attention_mask is not supported"):
        punet.forward(
            torch.randn(1, 4, 8, 8), 10, encoder_hidden_states=torch.randn(1, 7, 32), attention_mask=torch.ones(1, 64)
        )
    punet.restore()


def test_one_rank_is_the_plain_model_and_restore_undoes_the_patch():
    unet = tiny_unet()
    unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.set_processor(AttnProcessor())  # also supported
    x, text = banded_latent(16)
    keys = list(unet.state_dict())
    processors = dict(unet.attn_processors)
    ref = flow_loop(unet, x, text, steps=3)
    with parallelize(unet, Group.solo(), mode="displaced") as punet:
        assert "forward" in unet.__dict__ and "forward" in unet.conv_in.__dict__
        out = flow_loop(unet, x, text, steps=3)
        assert punet.modes == [UNetMode.NAIVE] * 3  # one band: nothing to exchange
        assert list(unet.state_dict()) == keys  # patched forwards, same modules and parameters
    torch.testing.assert_close(out, ref, rtol=0, atol=unet_tol(ref, 3))
    assert not any("forward" in m.__dict__ for m in unet.modules())
    assert all(unet.attn_processors[k] is v for k, v in processors.items())
    torch.testing.assert_close(flow_loop(unet, x, text, steps=3), ref, rtol=0, atol=0)


def test_text_keys_values_are_computed_once_per_prompt_tensor():
    unet = tiny_unet()
    calls = []
    to_k = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn2.to_k
    to_k.register_forward_hook(lambda *a: calls.append(1))
    x, text = banded_latent(16)
    with parallelize(unet, Group.solo()), torch.no_grad():
        ref = [unet(x, t, encoder_hidden_states=text).sample for t in (900, 500, 100)]
        assert len(calls) == 1
        again = unet(x, 100, encoder_hidden_states=text.clone()).sample  # a new prompt tensor: recomputed
        assert len(calls) == 2
        text.mul_(2.0)  # modified in place: recomputed
        unet(x, 50, encoder_hidden_states=text)
        assert len(calls) == 3
    torch.testing.assert_close(again, ref[-1], rtol=0, atol=0)


# --------------------------------------------------------------------------------------------------
#                            Whole scheduler loops on gloo ranks
# --------------------------------------------------------------------------------------------------


def _ablation(ctx, size: int, modes: list[str], warmup: int, steps: int = STEPS, again: bool = True) -> dict:
    """Every mode's final latent on this rank (and the modes each step ran in, and bytes per step)."""
    unet = tiny_unet()
    x, text = banded_latent(size)
    out = {}
    for mode in modes:
        with parallelize(unet, ctx.world, mode=mode, warmup=warmup) as punet:
            out[mode] = flow_loop(unet, x, text, steps)
            out[f"{mode}/bytes"] = [punet.comm.bytes_by_step.get(s, 0) for s in range(steps)]
            out[f"{mode}/modes"] = [m.value for m in punet.modes]
            if mode == "displaced" and again:  # a second loop: the timestep goes back up, a new run, sync first
                out["displaced/again"] = flow_loop(unet, x, text, steps)
                out["displaced/modes"] = [m.value for m in punet.modes]
    return out


def test_two_ranks_sync_is_exact_and_corrected_gn_beats_stale_and_separate():
    unet = tiny_unet()
    x, text = banded_latent(16)
    ref = flow_loop(unet, x, text)
    r0, r1 = run_local(_ablation, 2, (16, MODES, 1), **FORK)
    for mode in MODES:
        assert torch.equal(r0[mode], r1[mode]), f"{mode}: ranks disagree"
        assert_image_like(r0[mode], ref, mode)
    assert (r0["sync"] - ref).abs().max() <= unet_tol(ref, STEPS)
    score = {mode: psnr(r0[mode], ref) for mode in MODES}
    assert score["displaced"] > score["stale-gn"] + 0.5, score
    assert score["displaced"] > score["separate-gn"] + 0.5, score
    assert score["sync-gn"] > score["separate-gn"] and score["displaced"] > score["naive"], score
    assert score["sync"] > score["sync-gn"] > 30.0, score
    # Warm-up: step 0 and one more run synchronously; the second loop starts over and repeats the first.
    assert r0["displaced/modes"] == (["sync"] * 2 + ["displaced"] * (STEPS - 2)) * 2
    assert torch.equal(r0["displaced/again"], r0["displaced"])
    # Traffic: naive sends only the output bands; the displaced family sends what sync sends, asynchronously.
    band_out = x.numel() // 2 * 4  # float32 output band, to the one other rank
    assert r0["naive/bytes"] == [band_out] * STEPS
    assert r0["displaced/bytes"] == r0["sync/bytes"] == r0["stale-gn/bytes"] == r0["separate-gn/bytes"]
    assert r0["sync/bytes"][0] > 10 * band_out


def _warmup_counting(ctx) -> dict:
    """The mode of every call for a Heun-like loop (t_0, then each later t twice) and for a loop with the
    CFG halves as two calls at the same t, with the default warm-up."""
    unet = tiny_unet()
    x, text = banded_latent(8)
    out = {}
    heun = [1000, 900, 900, 800, 800, 700, 700, 600, 600, 500, 500, 400, 400]
    cfg_calls = [t for t in (1000, 900, 800, 700, 600, 500, 400) for _ in range(2)]
    with parallelize(unet, ctx.world, mode="displaced") as punet:
        out["warmup"] = punet.warmup
        for name, loop in (("heun", heun), ("cfg", cfg_calls)):
            punet.reset()
            punet.modes.clear()
            with torch.no_grad():
                for t in loop:
                    unet(x, torch.tensor(t), encoder_hidden_states=text)
            out[name] = [m.value for m in punet.modes]
    return out


def test_warmup_counts_sampler_steps_not_calls_and_defaults_to_4():
    r0 = run_local(_warmup_counting, 2, (), **FORK)[0]
    assert r0["warmup"] == 4  # the paper's and distrifuser's
    # steps 0..4 synchronous: Heun's 9 calls of steps 0-4, then displaced
    assert r0["heun"] == ["sync"] * 9 + ["displaced"] * 4
    # two calls per step (the CFG halves separately): 10 synchronous calls, then displaced
    assert r0["cfg"] == ["sync"] * 10 + ["displaced"] * 4


@pytest.mark.parametrize("nproc, size", [(3, 16), (2, 10)], ids=["3-ranks-16-rows", "2-ranks-10-rows"])
def test_uneven_bands_are_exact_in_sync_and_displaced_beats_naive_by_3db(nproc, size):
    """16 latent rows on 3 ranks: bands of 6/6/4 rows (3/3/2 at the coarse level); 10 rows on 2: 6/4. GroupNorm
    pools band statistics weighted by band size; halos and keys/values of unequal bands travel padded."""
    unet = tiny_unet()
    x, text = banded_latent(size)
    ref = flow_loop(unet, x, text)
    ranks = run_local(_ablation, nproc, (size, ["sync", "displaced", "naive"], 1, STEPS, False), **FORK)
    for mode in ("sync", "displaced", "naive"):
        assert all(torch.equal(r[mode], ranks[0][mode]) for r in ranks), f"{mode}: ranks disagree"
        assert_image_like(ranks[0][mode], ref, mode)
    assert (ranks[0]["sync"] - ref).abs().max() <= unet_tol(ref, STEPS)
    scores = {mode: round(psnr(ranks[0][mode], ref), 1) for mode in ("displaced", "naive")}
    print(f"U-Net N={nproc} {size} rows: PSNR vs one device {scores}")
    assert scores["displaced"] >= scores["naive"] + 3, scores


def controlnet_loop(unet, controlnet, x, text, hint, steps: int = 4) -> torch.Tensor:
    """A ControlNet pipeline's loop: the ControlNet (whole image, every rank) gives residuals for every
    U-Net level, which the U-Net adds (each rank its band's rows)."""
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    with torch.no_grad():
        for t in scheduler.timesteps:
            down, mid = controlnet(x, t, encoder_hidden_states=text, controlnet_cond=hint, return_dict=False)
            eps = unet(
                x,
                t,
                encoder_hidden_states=text,
                down_block_additional_residuals=down,
                mid_block_additional_residual=mid,
            ).sample
            x = scheduler.step(eps, t, x).prev_sample
    return x


def tiny_controlnet(unet):
    from diffusers import ControlNetModel

    torch.manual_seed(3)
    controlnet = ControlNetModel.from_unet(unet, conditioning_embedding_out_channels=(8, 16)).eval()
    with torch.no_grad():  # ControlNet zero-initialises its output convolutions: make the residuals matter
        for p in controlnet.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return controlnet


def _controlnet(ctx, size: int) -> dict:
    unet = tiny_unet()
    controlnet = tiny_controlnet(unet)
    x, text = banded_latent(size)
    hint = torch.rand(1, 3, 2 * size, 2 * size, generator=torch.Generator().manual_seed(4))
    out = {}
    for mode in ("sync", "displaced"):
        with parallelize(unet, ctx.world, mode=mode, warmup=1):
            out[mode] = controlnet_loop(unet, controlnet, x, text, hint)
    return out


@pytest.mark.parametrize("nproc, size", [(2, 16), (3, 16)])
def test_controlnet_residuals_are_split_per_band(nproc, size):
    unet = tiny_unet()
    controlnet = tiny_controlnet(unet)
    x, text = banded_latent(size)
    hint = torch.rand(1, 3, 2 * size, 2 * size, generator=torch.Generator().manual_seed(4))
    ref = controlnet_loop(unet, controlnet, x, text, hint)
    plain = flow_loop(unet, x, text, steps=4)
    assert (ref - plain).abs().max() > 0.05  # the residuals change the result
    ranks = run_local(_controlnet, nproc, (size,), **FORK)
    assert (ranks[0]["sync"] - ref).abs().max() <= unet_tol(ref, STEPS)
    assert all(torch.equal(r["displaced"], ranks[0]["displaced"]) for r in ranks)
    assert_image_like(ranks[0]["displaced"], ref, "displaced with ControlNet")


def _overlap(ctx, batch_bytes) -> dict:
    unet = tiny_unet()
    x, text = banded_latent(16)
    out = {}
    for mode in ("displaced", "sync-gn"):
        with parallelize(unet, ctx.world, mode=mode, warmup=1, batch_bytes=batch_bytes) as punet:
            out[mode] = flow_loop(unet, x, text, steps=4)
            out[f"{mode}/overlap"] = punet.comm.overlap_by_step
            out[f"{mode}/batches"] = punet.comm.num_batches
    return out


def test_exchange_batches_leave_during_the_forward_for_a_small_unet():
    """The tiny U-Net exchanges ~0.4 MB per step: with a fixed 8 MiB batch everything left in one gather
    at the end of the forward (no overlap). Sized from the model (the default), most bytes leave while
    later layers still run, in displaced and in sync-gn (whose GN statistics are enqueued like the others);
    the results are the same numbers either way."""
    fixed = run_local(_overlap, 2, (8 << 20,), **FORK)[0]
    auto = run_local(_overlap, 2, (None,), **FORK)[0]
    for mode in ("displaced", "sync-gn"):
        assert fixed[f"{mode}/batches"] == 1
        assert all(early == 0 for early, _ in fixed[f"{mode}/overlap"].values())  # the old default: none
        assert auto[f"{mode}/batches"] >= 6, auto[f"{mode}/batches"]
        steps = auto[f"{mode}/overlap"]
        assert sorted(steps) == [2, 3], steps  # steps 0-1 are warm-up (sync: nothing asynchronous)
        for early, late in steps.values():
            assert early >= 0.75 * (early + late), steps
        assert torch.equal(auto[mode], fixed[mode])  # batching the sends changes no arithmetic
        print(mode, "bytes during / after the forward per step:", steps)


@pytest.mark.parametrize("nproc", [2, 4])
def test_small_latents_stay_exact_in_sync_and_never_black(nproc):
    """8x8 latents: 4 (or 2) rows per band, 2 (or 1) at the coarse level, where halos and GN matter most."""
    unet = tiny_unet()
    x, text = banded_latent(8)
    ref = flow_loop(unet, x, text, steps=4)
    modes = ["sync", "displaced", "naive"] if nproc == 4 else MODES
    ranks = run_local(_ablation, nproc, (8, modes, 1, 4, False), **FORK)
    for mode in modes:
        assert all(torch.equal(r[mode], ranks[0][mode]) for r in ranks), f"{mode}: ranks disagree"
        assert_image_like(ranks[0][mode], ref, f"{mode} on {nproc} ranks")
    assert (ranks[0]["sync"] - ref).abs().max() <= unet_tol(ref, STEPS)
    assert psnr(ranks[0]["displaced"], ref) > psnr(ranks[0]["naive"], ref)


def guided_loop(unet, x: torch.Tensor, text: torch.Tensor, scale: float = 4.0, steps: int = STEPS) -> torch.Tensor:
    """A pipeline's guided loop: one U-Net call on [unconditional; conditional] (2B rows), then CFG."""
    scheduler = FlowMatchEulerDiscreteScheduler()
    scheduler.set_timesteps(steps)
    both = torch.cat([torch.zeros_like(text), text])  # [2B, L, D]: the empty prompt's states, then the prompt's
    with torch.no_grad():
        for t in scheduler.timesteps:
            uncond, cond = unet(torch.cat([x, x]), t, encoder_hidden_states=both).sample.chunk(2)
            x = scheduler.step(uncond + scale * (cond - uncond), t, x).prev_sample
    return x


def _cfg_split(ctx, size: int, modes: list[str], batch: int) -> dict:
    unet = tiny_unet()
    x, text = banded_latent(size)
    x, text = x.repeat(batch, 1, 1, 1), text.repeat(batch, 1, 1)
    out = {}
    for mode in modes:
        for split in (True, False):
            with parallelize(unet, ctx.world, mode=mode, warmup=1, cfg_split=split) as punet:
                key = f"{mode}/{'split' if split else 'whole'}"
                out[key] = guided_loop(unet, x, text)
                out[f"{key}/bytes"] = [punet.comm.bytes_by_step.get(s, 0) for s in range(STEPS)]
                out[f"{key}/bands"] = punet.step.bands
    return out


@pytest.mark.parametrize("nproc", [2, 4])
def test_cfg_split_is_exact_in_sync_and_halves_each_ranks_rows(nproc):
    """CFG split (distrifuser's split_batch): ranks [0, N/2) run the unconditional rows, [N/2, N) the
    conditional; each half in N/2 bands. Sync equals one device; each rank's band holds twice the rows of
    the unsplit run's band, for half the batch, so band exchanges carry the same bytes per rank and only
    the output gather differs; at N = 2 each group is one rank: no band exchange at all."""
    unet = tiny_unet()
    x, text = banded_latent(16)
    x, text = x.repeat(2, 1, 1, 1), text.repeat(2, 1, 1)
    ref = guided_loop(unet, x, text)
    ranks = run_local(_cfg_split, nproc, (16, ["sync", "displaced", "naive"], 2), **FORK)
    r0 = ranks[0]
    for key in ("sync/split", "displaced/split", "naive/split", "sync/whole"):
        assert all(torch.equal(r[key], r0[key]) for r in ranks), f"{key}: ranks disagree"
        assert_image_like(r0[key], ref, key)
    assert (r0["sync/split"] - ref).abs().max() <= unet_tol(ref, STEPS)
    assert (r0["sync/whole"] - ref).abs().max() <= unet_tol(ref, STEPS)
    assert r0["sync/split/bands"] == nproc // 2 and r0["sync/whole/bands"] == nproc
    out_band = 4 * x.numel() * 2 // nproc  # float32: a 1/N share of the guided [2B, C, H, W] output
    assert r0["naive/split/bytes"] == [(nproc - 1) * out_band] * STEPS
    if nproc == 2:  # one rank per group: the whole image, only the output gather
        assert r0["displaced/split/bytes"] == r0["naive/split/bytes"]
        assert torch.equal(r0["displaced/split"], r0["sync/split"])
    else:
        assert psnr(r0["displaced/split"], ref) > psnr(r0["naive/split"], ref)
        # band traffic: the same activations per rank as unsplit at half the ranks per band group
        assert r0["sync/split/bytes"][0] < r0["sync/whole/bytes"][0]
    for key in ("sync/split", "sync/whole"):
        print(f"N={nproc} {key}: bytes per step sent by rank 0 {r0[key + '/bytes']}")


def _cfg_split_odd(ctx) -> dict:
    unet = tiny_unet()
    x, text = banded_latent(16)
    with parallelize(unet, ctx.world, mode="sync", cfg_split=True) as punet:
        out = {"unguided": flow_loop(unet, x, text, steps=2)}  # batch 1: both groups run it whole
        try:
            unet(torch.cat([x] * 3), torch.tensor(900), encoder_hidden_states=torch.cat([text] * 3))
        except FlowfleetError as e:
            out["error"] = str(e)
        out["bands"] = punet.step.bands
    return out


def test_cfg_split_runs_an_unguided_batch_whole_and_refuses_odd_rank_counts():
    unet = tiny_unet()
    x, text = banded_latent(16)
    r0, r1 = run_local(_cfg_split_odd, 2, (), **FORK)
    ref = flow_loop(unet, x, text, steps=2)
    assert (r0["unguided"] - ref).abs().max() <= unet_tol(ref, 2)
    assert torch.equal(r0["unguided"], r1["unguided"]) and r0["bands"] == 1
    assert "3 rows per rank group exceed the 1 its buffers hold" in r0["error"]
    with pytest.raises(FlowfleetError, match="cfg_split: needs an even number of ranks, got 3"):
        parallelize(unet, Group(None, 0, 3), cfg_split=True)


@pytest.mark.parametrize("mode", ["ulysses", "ring"])
def test_sequence_parallel_modes_are_for_transformers_only(mode):
    """A U-Net's convolutions need halo rows, which sequence parallelism does not exchange: one line."""
    unet = tiny_unet()
    with pytest.raises(FlowfleetError, match=f"U-Net: mode={mode} is exact sequence parallelism for transformers"):
        parallelize(unet, Group(None, 0, 2), mode=mode)
    assert "forward" not in unet.__dict__


# --------------------------------------------------------------------------------------------------
#                          The example: a diffusers pipeline's own loop
# --------------------------------------------------------------------------------------------------


def _example_rank(ctx, argv: list[str]) -> None:
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "examples" / "pipeline_parallel.py"
    spec = importlib.util.spec_from_file_location("pipeline_parallel_example", path)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.rank_main(ctx, example.parse_args(argv))


@pytest.mark.parametrize("pipeline, nproc", [("sd", 2), ("pixart", 3)])
def test_example_runs_a_diffusers_pipeline_split_over_ranks(tmp_path, capfd, pipeline, nproc):
    """The example on a tiny Stable Diffusion pipeline (2 ranks, CFG split) and a tiny PixArt-α pipeline
    (3 ranks: 3/3/2 token rows), in sync mode: the pipeline's own loop gives the single-device image."""
    from PIL import Image

    out = tmp_path / "grid.png"
    argv = ["--nproc", str(nproc), "--pipeline", pipeline, "--mode", "sync", "--steps", "3", "--size", "32"]
    run_local(_example_rank, nproc, ([*argv, "--guidance", "3", "--out", str(out)],), **FORK)
    grid = Image.open(out)
    assert grid.size == (64, 3 * 64)  # one 32 px image (upscaled to 64) per row: single | parallel | |diff|
    printed = capfd.readouterr().out
    diff = float(printed.split("max |parallel - single| = ")[1].split()[0])
    # images in [0, 1]; the longest reduction is the VAE decoder's GroupNorm at 32 px (4 channels x 32 x 32);
    # ~50 layers (UNet or PixArt, then the decoder) x 3 steps, CFG halves alike
    assert diff <= reorder(network_terms(4 * 32 * 32, 50, 3)), printed


def test_an_untested_diffusers_release_is_refused_by_name_unless_asked_for(monkeypatch):
    import diffusers

    from flowfleet.parallel.registry import ALLOW_UNTESTED_ENV, SUPPORTED_DIFFUSERS, check_diffusers

    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    assert diffusers.__version__ in SUPPORTED_DIFFUSERS  # the suite runs on a tested release
    check_diffusers()
    for tested in ("0.35.2", "0.42.1"):  # the two ends make test runs
        check_diffusers(tested)
    for untested in ("0.30.3", "0.43.0", "1.0.0"):
        with pytest.raises(FlowfleetError, match=rf"diffusers {untested} is untested \(tested: diffusers"):
            check_diffusers(untested)
    check_diffusers("0.43.0", allow_untested=True)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    check_diffusers("0.43.0")
    monkeypatch.delenv(ALLOW_UNTESTED_ENV)
    monkeypatch.setattr(diffusers, "__version__", "0.43.0")  # what parallelize() sees
    with pytest.raises(FlowfleetError, match="diffusers 0.43.0 is untested"):
        parallelize(tiny_unet(), Group.solo())
