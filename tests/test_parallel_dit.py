"""DistriFusion patch parallelism for DiT experts (flowfleet.parallel): whole sampling runs on 2 and 4
gloo ranks against the single-process result, the comm manager, and failing ranks.

Ranks are local processes forked from the test (one thread each, gloo over 127.0.0.1), so each
multi-rank run costs well under a second for these tiny models.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
from fixtures.random_fleet import randomize_
from fixtures.stripes import train_stripes_dit
from fixtures.tolerances import net_tol
from torchmetrics.functional.image import peak_signal_noise_ratio

from flowfleet.config import SamplingConfig
from flowfleet.errors import FlowfleetError
from flowfleet.flow import guided_mixture, integrate, routing_weights, time_grid
from flowfleet.flow.ensemble import dense_weights
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.parallel import (
    BandLayout,
    CommManager,
    Group,
    ParallelMode,
    ParallelPlan,
    PatchParallelDiT,
    PatchParallelRunner,
    register_dit,
    run_local,
    single_process,
)
from flowfleet.parallel.step import BandStep

FORK = dict(start_method="fork", timeout_s=20.0)
K = 3  # experts in the routed fleet
B = 3  # samples
STEPS = 5
EXPERT = DiTConfig(
    input_size=(8, 8),
    in_channels=2,
    patch_size=2,
    hidden_size=32,
    depth=2,
    num_heads=2,
    conditioning="cross_attn",
    text_dim=8,
    text_len=3,
    add_pooled=True,
)  # 4x4 tokens
WIDE = DiTConfig(**{**EXPERT.model_dump(), "hidden_size": 64, "num_heads": 4})  # expert 1 of a mixed fleet
SIX_HEADS = DiTConfig(**{**EXPERT.model_dump(), "hidden_size": 48, "num_heads": 6})  # Ulysses over 2 or 3 ranks
DDPM = DiTConfig(**{**EXPERT.model_dump(), "objective": "ddpm", "schedule": "linear"})  # expert 1 of a mixed fleet


def dit_tol(want: torch.Tensor, sampler: str = "euler", steps: int = STEPS, reduction: int = 4 * 32) -> float:
    """Sync bands vs one process: the same sums in another order. The experts' longest reduction is the MLP
    (4 x hidden 32); 2 blocks of ~4 roundings, the embeddings, the final layer, the router and the top-2/CFG
    sums: ~12 per call, two calls per Heun step."""
    return net_tol(want, reduction, 12, steps * (2 if sampler == "heun" else 1))


ROUTER = DiTConfig(input_size=(8, 8), in_channels=2, patch_size=2, hidden_size=32, depth=1, num_heads=2, num_outputs=K)


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------
#                        A small random fleet, built identically in every process
# --------------------------------------------------------------------------------------------------


def fleet(variant: str = "") -> tuple[dict[int, DiTModel], DiTModel]:
    """K random experts and a router. variant "wide": expert 1 twice as wide; "heads6": every expert has
    6 heads (hidden 48); "ddpm": expert 1 predicts DDPM's noise (its velocity converted)."""
    one = {"wide": WIDE, "ddpm": DDPM, "heads6": SIX_HEADS}.get(variant, EXPERT)  # expert 1
    configs = {k: one if k == 1 or variant == "heads6" else EXPERT for k in range(K)}
    experts = {k: randomize_(DiTModel.from_dit_config(c), seed=10 + k, std=0.15).eval() for k, c in configs.items()}
    router = randomize_(DiTModel.from_dit_config(ROUTER), seed=99, std=0.3).eval()
    return experts, router


def inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    noise = torch.randn(B, 2, 8, 8, generator=g)
    cond = dict(
        text_tokens=torch.randn(B, 3, 8, generator=g),
        text_mask=torch.tensor([[1, 1, 0]] * B).bool(),
        text_pooled=torch.randn(B, 8, generator=g),
    )
    return noise, cond


def route_fn(router: DiTModel, k: int, mixture: bool = False):
    """Top-k of the router's posterior for both guidance branches, or (mixture) the unconditional branch's own
    top-k of another posterior (the router's logits reversed: a stand-in for p(k | x_t, t, null))."""

    def route(x, t, step):
        logits = router(x, t)
        experts, weights = routing_weights(torch.softmax(logits, dim=1), k)
        if not mixture:
            return experts, weights, None, None  # one choice serves both branches
        return experts, weights, *routing_weights(torch.softmax(logits.flip(1), dim=1), k)

    return route


def single_process_run(
    top_k: int,
    guidance_scale: float,
    sampler: str = "euler",
    variant: str = "",
    guidance_max_t: float = 1.0,
    mixture: bool = False,
) -> torch.Tensor:
    """Reference: every expert on the whole image with and without the condition, each branch mixed by its own
    routing weights, guided (at t <= guidance_max_t): flowfleet.flow.guided_mixture on dense [K, B, ...] velocities."""
    experts, router = fleet(variant)
    noise, cond = inputs()
    route = route_fn(router, top_k, mixture)

    def velocity(x, t, step):
        ec, wc, eu, wu = route(x, t, step)
        eu, wu = (ec, wc) if eu is None else (eu, wu)
        scale = guidance_scale if float(t[0]) <= guidance_max_t else 1.0
        both = [
            model(
                torch.cat([x, x]),
                torch.cat([t, t]),
                drop=torch.arange(2 * B) >= B,
                **{n: torch.cat([c, c]) for n, c in cond.items()},
            ).chunk(2)
            for model in experts.values()
        ]
        v_c, v_u = torch.stack([c for c, _ in both]), torch.stack([u for _, u in both])  # [K, B, C, H, W]
        return guided_mixture(v_c, v_u, dense_weights(ec, wc, K), dense_weights(eu, wu, K), scale)

    with torch.inference_mode():
        return integrate(velocity, noise, time_grid(STEPS), sampler)


def parallel_run(
    ctx,
    mode: str,
    warmup: int,
    top_k: int,
    guidance_scale: float,
    cfg_split: bool,
    sampler: str = "euler",
    batch_bytes: int = 8 << 20,
    variant: str = "",
    guidance_max_t: float = 1.0,
    mixture: bool = False,
) -> dict:
    """Worker: the same run patch-parallel on ctx's ranks."""
    experts, router = fleet(variant)
    noise, cond = inputs()
    runner = PatchParallelRunner(
        ctx,
        {k: m.cfg for k, m in experts.items()},
        experts.__getitem__,
        ParallelPlan(mode, warmup, cfg_split=cfg_split, batch_bytes=batch_bytes),
        batch=B,
        guided=True,
    )
    guidance = SamplingConfig(guidance_scale=guidance_scale, guidance_max_t=guidance_max_t)
    vf = runner.velocity(cond, guidance=guidance, route=route_fn(router, top_k, mixture), steps=STEPS)
    with torch.inference_mode():
        out = integrate(vf, runner.broadcast(noise), time_grid(STEPS), sampler)
    runner.close()
    return dict(
        out=out,
        bytes=runner.comm.bytes_by_step,
        batches=runner.comm.num_batches,
        modes=[sorted({m.value for m in ran.values()}) for ran in vf.modes],
        split=runner.split_text,
    )


# --------------------------------------------------------------------------------------------------
#                                      Small pieces
# --------------------------------------------------------------------------------------------------


def test_mode_parse_and_warmup():
    assert ParallelMode.parse(" Displaced ") is ParallelMode.DISPLACED
    with pytest.raises(FlowfleetError, match="parallel: unknown mode 'async'"):
        ParallelMode.parse("async")
    d = ParallelMode.DISPLACED
    assert [d.at_step(i, warmup=2).value for i in range(5)] == ["sync"] * 3 + ["displaced"] * 2
    assert ParallelMode.NAIVE.at_step(0, 3) is ParallelMode.NAIVE and not ParallelMode.NAIVE.exchanges
    with pytest.raises(FlowfleetError, match="^warmup: must be >= 0"):
        ParallelPlan("displaced", warmup=-1)


def test_band_layout_tiles_the_latent():
    x = torch.arange(2 * 16 * 6, dtype=torch.float32).reshape(1, 2, 16, 6)
    layouts = [BandLayout.for_latent((16, 6), 2, 4, r) for r in range(4)]
    assert layouts[1].rows == 2 and layouts[1].tokens == 6 and layouts[1].token_slice == slice(6, 12)
    assert torch.equal(torch.cat([lay.split(x) for lay in layouts], dim=-2), x)
    uneven = [BandLayout.for_latent((16, 6), 2, 3, r) for r in range(3)]  # 8 token rows: 3/3/2
    assert [lay.rows for lay in uneven] == [3, 3, 2] and uneven[2].token_slice == slice(18, 24)
    assert uneven[0].token_counts == [9, 9, 6]
    assert torch.equal(torch.cat([lay.split(x) for lay in uneven], dim=-2), x)
    with pytest.raises(FlowfleetError, match="8 token rows .* cannot be split into 9 bands; use at most 8"):
        BandLayout.for_latent((16, 6), 2, 9, 0)


def test_band_step_cuts_every_level_where_the_band_layout_does():
    # one geometry: a U-Net or transformer layer at any resolution cuts its rows at the DiT layout's rows
    for bands, grid_h in ((3, 8), (4, 16), (5, 7)):
        layouts = [BandLayout.for_latent((grid_h * 2, 6), 2, bands, r) for r in range(bands)]
        for level in (1, 2, 4):  # rows of a level `level` times finer than the token rows
            steps = [BandStep(None, r, bands, sizes=layouts[0].sizes) for r in range(bands)]
            spans = [s.span(grid_h * level) for s in steps]
            assert spans == [(lay.start * level, lay.rows * level) for lay in layouts]
            assert steps[-1].counts(layouts[-1].rows * level) == [r * level for r in layouts[0].sizes]
    assert BandStep(None, 1, 4).span(16) == (4, 4) and BandStep(None, 1, 4).counts(3) == [3, 3, 3, 3]


def test_comm_manager_slots_batches_and_rows_on_one_rank():
    comm = CommManager(Group.solo(), batch_bytes=64)
    comm.register("a.0", (4, 3), family="a")  # 48 bytes
    comm.register("a.1", (4, 3), family="a")  # would make 96 > 64: new batch
    comm.register("b.0", (2, 2), family="b")  # other family: new batch
    with pytest.raises(RuntimeError, match="registered twice"):
        comm.register("a.0", (1,))
    comm.allocate()
    assert comm.num_batches == 3 and comm.buffer_bytes == (12 + 12 + 4) * 4 * 2
    got = comm.gather("a.0", torch.ones(2, 3), rows=torch.tensor([1, 3]))  # [1 rank, 2 rows, 3]
    assert got.shape == (1, 2, 3) and torch.equal(got, torch.ones(1, 2, 3))
    assert torch.equal(comm.wait("a.0")[0, :, 0], torch.tensor([0.0, 1.0, 0.0, 1.0]))  # rows 1 and 3
    comm.enqueue("b.0", torch.full((2, 2), 5.0))  # the batch's only slot: sent at once
    assert torch.equal(comm.wait("b.0"), torch.full((1, 2, 2), 5.0))
    with pytest.raises(RuntimeError, match="does not fit"):
        comm.enqueue("a.1", torch.ones(5, 3))
    with pytest.raises(RuntimeError, match="never registered"):
        comm.wait("c")
    assert comm.bytes_total == 0  # nothing leaves a group of one


@pytest.mark.parametrize("mode", list(ParallelMode))
def test_one_band_is_the_model(mode):
    model, _ = fleet()
    m = model[0]
    layout = BandLayout.for_latent(EXPERT.input_size, EXPERT.patch_size, 1, 0)
    comm = CommManager(Group.solo())
    register_dit(comm, "e", EXPERT, layout, B)
    comm.allocate()
    noise, cond = inputs()
    t = torch.full((B,), 0.7)
    with torch.no_grad():
        want = m(noise, t, **cond)
        for _ in range(2):  # the second call reads what the first one left (displaced)
            got = PatchParallelDiT(m, comm, "e", layout)(noise, t, mode=mode, **cond)
    assert torch.allclose(got, want, atol=dit_tol(want, steps=1), rtol=0)


def test_runner_on_one_process_is_the_routed_fleet():
    """No process group at all: the runner's velocity is the plain routed, guided fleet."""
    want = single_process_run(top_k=2, guidance_scale=2.5)
    got = parallel_run(single_process(), "displaced", 0, 2, 2.5, True)
    assert torch.allclose(got["out"], want, atol=dit_tol(want), rtol=0)
    assert got["bytes"] == {} and got["modes"][0] == ["naive"]  # one band: nothing to exchange


# --------------------------------------------------------------------------------------------------
#                           Whole sampling runs on 2 and 4 ranks
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler, nproc", [("euler", 2), ("heun", 2), ("euler", 3)])
def test_sync_equals_single_process(sampler, nproc):
    """Routed top-2 of 3 experts, CFG 2.5, both CFG halves on each rank: every band exchanges K/V.
    3 ranks split the 4 token rows unevenly (2/1/1)."""
    want = single_process_run(top_k=2, guidance_scale=2.5, sampler=sampler)
    ranks = run_local(parallel_run, nproc, ("sync", 0, 2, 2.5, False, sampler), **FORK)
    diff = (ranks[0]["out"] - want).abs().max().item()
    print(f"\nsync ({sampler}) vs single process: max abs diff {diff:.2e}")
    assert diff <= dit_tol(want, sampler)
    assert all(torch.equal(r["out"], ranks[0]["out"]) for r in ranks)  # every rank holds the same latent
    assert all(m == ["sync"] for m in ranks[0]["modes"])


@pytest.mark.parametrize("cfg_split", [False, True])
def test_guidance_only_at_t_below_guidance_max_t_equals_single_process(cfg_split):
    """--guidance-max-t: the steps above it combine the halves at scale 1 on every layout of the ranks."""
    want = single_process_run(top_k=2, guidance_scale=2.5, guidance_max_t=0.55)  # between two grid times
    ranks = run_local(parallel_run, 2, ("sync", 0, 2, 2.5, cfg_split, "euler", 8 << 20, "", 0.55), **FORK)
    assert (ranks[0]["out"] - want).abs().max().item() <= dit_tol(want, "euler")
    guided_everywhere = single_process_run(top_k=2, guidance_scale=2.5)
    assert (guided_everywhere - want).abs().max().item() > 100 * dit_tol(want, "euler")  # the interval acted


@pytest.mark.parametrize("nproc", [2, 4])
def test_cfg_batch_split_equals_single_process(nproc):
    """N even: ranks [0, N/2) run the conditional rows, [N/2, N) the unconditional ones (paper §5.2);
    with 4 ranks each half is itself split into 2 bands."""
    want = single_process_run(top_k=1, guidance_scale=3.0)
    ranks = run_local(parallel_run, nproc, ("sync", 0, 1, 3.0, True), **FORK)
    diff = max((r["out"] - want).abs().max().item() for r in ranks)
    print(f"\ncfg split over {nproc} ranks vs single process: max abs diff {diff:.2e}")
    assert diff <= dit_tol(want)
    output_and_routing = (nproc - 1) * (B * 2 * 8 * 8 * 4 // (nproc // 2) + B * 2 * 1 * 8)
    if nproc == 2:  # one rank per CFG half: whole images, no keys/values cross
        assert ranks[0]["bytes"][1] == output_and_routing
    else:  # two bands per half: keys/values cross within each half
        kv = EXPERT.depth * B * 2 * EXPERT.num_heads * 8 * (EXPERT.hidden_size // EXPERT.num_heads) * 4
        assert ranks[0]["bytes"][1] == output_and_routing + kv


@pytest.mark.parametrize("nproc, cfg_split", [(2, False), (2, True), (4, True)])
def test_guidance_over_the_mixture_equals_single_process(nproc, cfg_split):
    """Each branch routed on its own (the unconditional rows' experts differ from the conditional rows'): both
    halves on each rank, one half per rank group, and halves split into bands all give the single process's."""
    want = single_process_run(top_k=2, guidance_scale=2.5, mixture=True)
    args = ("sync", 0, 2, 2.5, cfg_split, "euler", 8 << 20, "", 1.0, True)
    ranks = run_local(parallel_run, nproc, args, **FORK)
    assert max((r["out"] - want).abs().max().item() for r in ranks) <= dit_tol(want)
    assert all(torch.equal(r["out"], ranks[0]["out"]) for r in ranks)
    assert (single_process_run(top_k=2, guidance_scale=2.5) - want).abs().max().item() > 100 * dit_tol(want)


@pytest.mark.parametrize(
    "mode, nproc, cfg_split",
    [
        ("ulysses", 2, False),
        ("ulysses", 3, False),
        ("ring", 2, False),
        ("ring", 3, False),
        ("ulysses", 4, True),
        ("ring", 4, True),
        ("usp", 4, False),
    ],
)
def test_sequence_parallel_equals_single_process(mode, nproc, cfg_split):
    """Exact sequence parallelism: routed top-2 of 3 six-head experts, CFG 2.5, Heun. 3 ranks split the 4
    token rows unevenly (8/4/4 tokens); 4 ranks with the CFG split: 2 halves x 2 bands; usp on 4 bands:
    Ulysses over pairs of bands (the gcd of 4 bands and 6 heads) and ring across the two pairs."""
    want = single_process_run(top_k=2, guidance_scale=2.5, sampler="heun", variant="heads6")
    args = (mode, 0, 2, 2.5, cfg_split, "heun", 8 << 20, "heads6")
    ranks = run_local(parallel_run, nproc, args, **FORK)
    diff = max((r["out"] - want).abs().max().item() for r in ranks)
    print(f"\n{mode} on {nproc} ranks (cfg split {cfg_split}) vs single process: max abs diff {diff:.2e}")
    assert diff <= dit_tol(want, "heun", reduction=4 * 48)
    assert all(torch.equal(r["out"], ranks[0]["out"]) for r in ranks)
    assert all(m == [mode] for m in ranks[0]["modes"])
    if mode == "usp":
        assert ranks[0]["split"].endswith("each image in 4 band(s) (usp: ulysses degree 2 x ring degree 2)")


def test_ulysses_refuses_heads_that_do_not_divide_in_one_line():
    """Two-head experts over 3 ranks: every rank refuses before any work, naming the expert and a way out."""
    with pytest.raises(
        FlowfleetError,
        match=r"parallel ulysses: expert 0 has 2 attention heads, not divisible by "
        r"the 3 ranks of an image \(use parallel ring",
    ):
        run_local(parallel_run, 3, ("ulysses", 0, 2, 2.5, False), **FORK)


def test_displaced_with_full_warmup_equals_sync_and_without_it_differs():
    sync = run_local(parallel_run, 2, ("sync", 0, 2, 2.0, False), **FORK)[0]
    warm = run_local(parallel_run, 2, ("displaced", STEPS, 2, 2.0, False), **FORK)[0]
    assert torch.equal(warm["out"], sync["out"])
    assert all(m == ["sync"] for m in warm["modes"])
    disp = run_local(parallel_run, 2, ("displaced", 1, 2, 2.0, False), **FORK)[0]
    assert disp["modes"][0] == ["sync"] and disp["modes"][1] == ["sync"]  # step 0 + 1 warm-up step
    assert "displaced" in {m for ms in disp["modes"][2:] for m in ms}
    diff = (disp["out"] - sync["out"]).abs().max().item()
    print(f"\ndisplaced (warmup 1) vs sync, random fleet: max abs diff {diff:.2e}")
    assert diff > dit_tol(sync["out"])  # stale keys/values were really used: more than rounding


def test_a_fleet_with_a_wider_expert_on_two_ranks():
    """Expert 1 twice as wide as the others (its own comm slots): sync equals one process; displaced runs
    the steps after warm-up on stale keys/values."""
    want = single_process_run(top_k=2, guidance_scale=2.0, variant="wide")
    sync = run_local(parallel_run, 2, ("sync", 0, 2, 2.0, False, "euler", 8 << 20, "wide"), **FORK)[0]
    assert (sync["out"] - want).abs().max().item() <= dit_tol(want, reduction=4 * 64)
    disp = run_local(parallel_run, 2, ("displaced", 1, 2, 2.0, False, "euler", 8 << 20, "wide"), **FORK)[0]
    assert torch.isfinite(disp["out"]).all() and not torch.equal(disp["out"], sync["out"])
    assert disp["modes"][:2] == [["sync"], ["sync"]] and "displaced" in {m for ms in disp["modes"][2:] for m in ms}


def test_a_fleet_with_a_ddpm_expert_on_two_ranks():
    """Expert 1 a DDPM (noise) expert: each band converts its own positions' noise into the velocity, so sync bands
    equal one process."""
    want = single_process_run(top_k=2, guidance_scale=2.0, variant="ddpm")
    sync = run_local(parallel_run, 2, ("sync", 0, 2, 2.0, False, "euler", 8 << 20, "ddpm"), **FORK)[0]
    # the conversion amplifies the noise's rounding by up to 1 / sqrt(abar) (~160 on the linear schedule), which
    # the random expert's samples carry in their size too: dit_tol scales with it
    assert (sync["out"] - want).abs().max().item() <= dit_tol(want)
    assert not torch.equal(want, single_process_run(top_k=2, guidance_scale=2.0))  # expert 1 is another model


def test_bytes_per_step_follow_the_layout():
    """One expert (top-1 of a fleet where routing happens to vary is avoided: K/V slot bytes are exact)."""
    runs = {m: run_local(parallel_run, 2, (m, 0, 3, 2.0, False), **FORK)[0] for m in ("sync", "displaced", "naive")}
    slot = 2 * B * 2 * EXPERT.num_heads * 8 * (EXPERT.hidden_size // EXPERT.num_heads) * 4  # [2B, 2, H, n, Dh]
    output = B * 2 * 4 * 8 * 4  # each rank's [B, C, 4, 8] band of the velocity
    routing = B * 2 * 3 * 8  # rank 0 broadcasts [B, 2k] float64 (top-3: every expert runs)
    per_step = K * EXPERT.depth * slot + output + routing
    sync = runs["sync"]["bytes"]
    assert [sync[i] for i in range(1, STEPS)] == [per_step] * (STEPS - 1)
    assert sync[0] == per_step + B * 2 * 8 * 8 * 4  # + the starting noise broadcast
    disp = runs["displaced"]["bytes"]
    assert disp[0] == sync[0] and all(disp[i] == per_step for i in range(1, STEPS - 1))
    assert disp[STEPS - 1] == output + routing  # the last step prefetches nothing
    naive = runs["naive"]["bytes"]
    assert all(naive[i] == output + routing for i in range(1, STEPS))
    # exact sequence parallelism at 2 ranks, per layer and rank: Ulysses sends half of q, k, v and half of the
    # attention output, 4 (N-1)/N = 2 tensors of [2B, H, n, Dh]; Ring sends its keys/values once, 2 (N-1) = 2:
    # the bytes of sync's key/value slot (they part at 3 ranks and more: BENCHMARKS.md)
    for mode in ("ulysses", "ring"):
        seq = run_local(parallel_run, 2, (mode, 0, 3, 2.0, False), **FORK)[0]["bytes"]
        assert [seq[i] for i in range(1, STEPS)] == [per_step] * (STEPS - 1), mode


def _comm_two_ranks(ctx) -> dict:
    from flowfleet.parallel import Group

    comm = CommManager(ctx.world, batch_bytes=4 * 4 * 4)
    for i in range(3):
        comm.register(f"l{i}", (4, 4), family="m")  # 64 bytes each: one batch per slot
    comm.register("m2", (2, 4), family="n")
    comm.allocate()
    me = float(ctx.rank + 1)
    out = {"batches": comm.num_batches}
    out["sync"] = comm.gather("l0", torch.full((4, 4), me)).clone()  # a view until the slot's next gather
    for i in range(3):
        comm.enqueue(f"l{i}", torch.full((4, 4), 10 * me + i))
    comm.enqueue("m2", torch.full((1, 4), me), rows=torch.tensor([1]))
    out["l2"] = comm.wait("l2").clone()
    out["m2"] = comm.wait("m2").clone()
    comm.drain()
    out["bytes"] = comm.bytes_total
    assert isinstance(ctx.world, Group)
    return out


def test_comm_manager_two_ranks():
    r0, r1 = run_local(_comm_two_ranks, 2, **FORK)
    assert r0["batches"] == 4
    assert torch.equal(r0["sync"][:, 0, 0], torch.tensor([1.0, 2.0]))  # both ranks' data, in rank order
    assert torch.equal(r1["l2"][:, 0, 0], torch.tensor([12.0, 22.0]))
    assert torch.equal(r0["m2"][:, :, 0], torch.tensor([[0.0, 1.0], [0.0, 2.0]]))  # row 1 only
    assert r0["bytes"] == (16 + 3 * 16 + 8) * 4  # one all-gather per slot, each rank's chunk to 1 peer


# --------------------------------------------------------------------------------------------------
#                         Quality on a trained model: displaced vs naive
# --------------------------------------------------------------------------------------------------

STRIPES = DiTConfig(input_size=(16, 16), in_channels=1, patch_size=4, hidden_size=64, depth=2, num_heads=4)
STRIPES_ITERS = 120  # a few seconds on one core: stripes appear (patchy), attention spans the whole image
QUALITY_STEPS = 10


def _stripes_run(ctx, state: dict, mode: str, warmup: int, noise: torch.Tensor) -> torch.Tensor:
    model = DiTModel.from_dit_config(STRIPES)
    model.load_state_dict(state)
    model.eval()
    runner = PatchParallelRunner(
        ctx, {0: STRIPES}, lambda k: model, ParallelPlan(mode, warmup), batch=noise.shape[0], guided=False
    )
    vf = runner.velocity({}, steps=QUALITY_STEPS)
    with torch.inference_mode():
        out = integrate(vf, noise, time_grid(QUALITY_STEPS))
    runner.close()
    return out


def test_trained_model_displaced_beats_naive_by_3db():
    t0 = time.monotonic()
    model = train_stripes_dit(STRIPES, iters=STRIPES_ITERS, batch=32, lr=2e-3)
    train_s = time.monotonic() - t0
    noise = torch.randn(8, 1, 16, 16, generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        want = integrate(lambda x, t, i: model(x, t), noise, time_grid(QUALITY_STEPS)).clamp(-1, 1)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    for nproc in (2, 3):  # 4 token rows: 2/2, and 2/1/1 (uneven)
        psnr = {}
        for mode, warmup in [("sync", 0), ("displaced", 1), ("naive", 0)]:
            got = run_local(_stripes_run, nproc, (state, mode, warmup, noise), **FORK)[0].clamp(-1, 1)
            psnr[mode] = peak_signal_noise_ratio(got, want, data_range=2.0).item()
        print(
            f"\nstripes DiT (trained {train_s:.1f} s, {STRIPES_ITERS} steps), {nproc} ranks, {QUALITY_STEPS} Euler "
            f"steps, PSNR vs single process: sync {psnr['sync']:.1f} dB, displaced (warmup 1) "
            f"{psnr['displaced']:.1f} dB, naive {psnr['naive']:.1f} dB"
        )
        assert psnr["sync"] > 60  # float rounding only
        assert psnr["displaced"] >= psnr["naive"] + 3.0


# --------------------------------------------------------------------------------------------------
#                                 Dead and stalled ranks
# --------------------------------------------------------------------------------------------------


def _failing_run(ctx, how: str) -> dict:
    experts, router = fleet()
    noise, cond = inputs()
    runner = PatchParallelRunner(
        ctx,
        {k: m.cfg for k, m in experts.items()},
        experts.__getitem__,
        ParallelPlan("displaced"),
        batch=B,
        guided=True,
    )
    vf = runner.velocity(cond, guidance=SamplingConfig(guidance_scale=2.0), route=route_fn(router, 2), steps=STEPS)

    def velocity(x, t, step):
        if step == 2 and ctx.rank == 1:
            if how == "dead":
                os._exit(3)
            time.sleep(120)  # stalled: never answers
        return vf(x, t, step)

    with torch.inference_mode():
        integrate(velocity, noise, time_grid(STEPS))
    return {}


@pytest.mark.parametrize("how", ["dead", "stalled"])
def test_failing_rank_gives_clear_error_within_timeout(how):
    t0 = time.monotonic()
    with pytest.raises(FlowfleetError) as err:
        run_local(_failing_run, 2, (how,), start_method="fork", timeout_s=3.0, deadline_s=60)
    elapsed = time.monotonic() - t0
    msg = str(err.value)
    print(f"\n{how} rank -> after {elapsed:.1f} s: {msg}")
    assert "rank 0: ParallelError" in msg and "another rank died or stalled" in msg
    assert "\n" not in msg
    assert elapsed < 25


# --------------------------------------------------------------------------------------------------
#                         The command line: generate --nproc 2 under torchrun
# --------------------------------------------------------------------------------------------------


def _class_fleet(run_root) -> str:
    """An assembled 3-expert fleet of mixed widths, class-conditioned (no text encoder to load in every rank)."""
    from fixtures.random_fleet import tiny_run_config, write_random_fleet

    from flowfleet.cli import main
    from flowfleet.config import RunConfig

    raw = tiny_run_config(3, size=8, conditioning="none").model_dump()
    raw["expert"] = {**raw["expert"], "conditioning": "class", "num_classes": 4, "depth": 2}
    raw["expert_overrides"] = {1: {"hidden_size": 64, "num_heads": 4}}  # a mixed fleet: expert 1 twice as wide
    write_random_fleet(str(run_root), RunConfig(**raw))
    assert main(["assemble", str(run_root)]) == 0
    return str(run_root / "model")


def _pixels(path) -> torch.Tensor:
    import numpy as np
    from PIL import Image

    return torch.from_numpy(np.asarray(Image.open(path)).astype("int16"))


@pytest.mark.parametrize("mode", ["sync", "ulysses", "ring"])
def test_cli_generate_nproc_2_writes_the_single_process_png(run_root, tmp_path, mode):
    """--cfg 1: nothing to split but the sequence, so both ranks hold one band each; the CLI says so."""
    import subprocess
    import sys

    from flowfleet.cli import main

    model = _class_fleet(run_root)
    args = ["generate", model, "--label", "1", "--label", "3", "--n", "3", "--steps", "4", "--cfg", "1"]
    assert main([*args, "--out", str(tmp_path / "single.png")]) == 0
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "flowfleet.cli",
            *args,
            "--out",
            str(tmp_path / "par.png"),
            "--nproc",
            "2",
            "--parallel",
            mode,
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote" in proc.stdout and proc.stdout.count("wrote ") == 1  # rank 0 reports, rank 1 stays quiet
    assert (
        f"parallel: 2 ranks: both CFG halves (or none) on every rank, each image in 2 band(s) ({mode})" in proc.stderr
    )
    single, par = _pixels(tmp_path / "single.png"), _pixels(tmp_path / "par.png")
    assert single.shape == par.shape
    # sync and ulysses attend with the same SDPA call as one process; ring merges blocks in float32 by their
    # log-sum-exp: float rounding, which moves a pixel only where it sits on a rounding edge (one grey level)
    assert torch.equal(single, par) if mode != "ring" else (single - par).abs().max() <= 1
    assert (tmp_path / "par.routing.json").exists()


def test_cli_generate_nproc_errors_are_one_line(run_root, capsys):
    from flowfleet.cli import main

    model = _class_fleet(run_root)
    with pytest.raises(SystemExit):  # argparse: unknown mode
        main(["generate", model, "--label", "1", "--nproc", "2", "--parallel", "async"])
    os.environ.update(RANK="0", WORLD_SIZE="3", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    try:  # "inside torchrun" with a world size that differs from --nproc: refused before joining
        assert main(["generate", model, "--label", "1", "--nproc", "2"]) == 1
        assert main(["generate", model, "--label", "1", "--nproc", "2", "--parallel", "ring", "--ulysses-degree", "2"])
    finally:
        for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key)
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-2] == "flowfleet generate: error: --nproc 2: torchrun started 3 ranks"
    assert err[-1] == "flowfleet generate: error: --ulysses-degree: only with --parallel usp (got ring)"


@pytest.mark.slow
def test_cli_generate_mnist_tiny_nproc_2(run_root, tmp_path):
    """The mnist-tiny fleet (random weights, real MiniLM text encoder in every rank): sync without
    guidance equals the single-process PNG (bands exchange keys/values); with guidance, the two ranks
    split the CFG batch and displaced equals it too (each rank holds whole images)."""
    import subprocess
    import sys

    from fixtures.random_fleet import write_random_fleet

    from flowfleet.cli import main
    from flowfleet.presets import preset

    write_random_fleet(str(run_root), preset("mnist-tiny"))
    assert main(["assemble", str(run_root)]) == 0
    model = str(run_root / "model")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for extra, mode in ((["--cfg", "1"], "sync"), ([], "displaced")):
        args = ["generate", model, "--prompt", "a handwritten digit 3", "--n", "4", *extra]
        assert main([*args, "--out", str(tmp_path / f"single-{mode}.png")]) == 0
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "flowfleet.cli",
                *args,
                "--out",
                str(tmp_path / f"{mode}.png"),
                "--nproc",
                "2",
                "--parallel",
                mode,
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=1200,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert torch.equal(_pixels(tmp_path / f"single-{mode}.png"), _pixels(tmp_path / f"{mode}.png"))
