"""Guidance over the mixture on DiT fleets whose router reads the prompt: each branch's own experts and weights, the
dense guided_mixture it computes sparsely, the settings that reach it (guidance interval, step cache, route_every),
and the same images through every door for a seed (generate, serve, diffusers' loader, generate --nproc 2)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from diffusers import DiffusionPipeline
from fixtures.random_fleet import HashTextEncoder, tiny_run_config, write_random_fleet
from fixtures.tolerances import net_tol
from PIL import Image

from flowfleet.flow import guided_mixture
from flowfleet.flow.ensemble import dense_weights
from flowfleet.sampling import FleetPipeline, RoutingTrace
from flowfleet.sampling.card import read_card
from flowfleet.sampling.views import to_pil
from flowfleet.serve.service import FleetService, GenerateRequest, ServeLimits
from flowfleet.stages.assemble import assemble
from flowfleet.stages.generate import generate

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3
PROMPTS = ["a handwritten digit seven", "two small digits", "a round zero"]


@pytest.fixture(scope="module")
def prompt_fleet(tmp_path_factory) -> str:
    """An assembled random fleet of K = 3 cross-attention experts whose router reads the prompt's pooled vector."""
    run = tmp_path_factory.mktemp("mixture") / "run"
    cfg = tiny_run_config(K, router_conditioning="pooled", guidance_scale=3.0)
    write_random_fleet(str(run), cfg)
    return assemble(str(run), progress=False).out


def opened(folder: str) -> FleetPipeline:
    return FleetPipeline.from_pretrained(folder, text_encoder=HashTextEncoder(384, 4))


def one_step(pipe: FleetPipeline, x, t, prompts, strategy: str, **choices):
    cond, _ = pipe.encode_condition(prompts, None, x.shape[0])
    trace = RoutingTrace(pipe.num_experts)
    with torch.no_grad():
        v = pipe.velocity_fn(cond, pipe.settings(strategy, **choices), trace)(x, t, 0)
    return v, trace, cond


def dense_mixture(pipe: FleetPipeline, x, t, cond, trace, scale: float) -> torch.Tensor:
    """Every expert on every sample with and without the prompt, each branch mixed by the weights the trace says
    the sampler chose: flowfleet.flow.guided_mixture on dense [K, B, ...] velocities."""
    n = x.shape[0]
    both = {name: torch.cat([c, c]) for name, c in cond.kwargs().items()}
    drop = torch.arange(2 * n) >= n
    with torch.no_grad():
        halves = [
            pipe.experts.get(k)(torch.cat([x, x]), torch.cat([t, t]), drop=drop, **both).chunk(2) for k in range(K)
        ]
    v_c, v_u = torch.stack([c for c, _ in halves]), torch.stack([u for _, u in halves])
    w_c = dense_weights(trace.experts[0], trace.weights[0], K)
    w_u = dense_weights(trace.uncond_experts[0], trace.uncond_weights[0], K)
    return guided_mixture(v_c, v_u, w_c, w_u, scale)


def tol(ref: torch.Tensor) -> float:
    """Sparse rows vs the dense batch: the same per-row sums blocked by other batch sizes; the longest reduction is
    the 384-wide caption projection, one block plus embeddings, final layer and the mixture sums (~8 roundings)."""
    return net_tol(ref, reduction=384, layers=8)


def test_each_branch_takes_its_own_posteriors_top_k_and_equals_the_dense_mixture(prompt_fleet):
    pipe = opened(prompt_fleet)
    g = torch.Generator().manual_seed(0)
    x, t = torch.randn(12, 1, 8, 8, generator=g), torch.full((12,), 0.6)
    v, trace, cond = one_step(pipe, x, t, PROMPTS, "top2", guidance_scale=3.0)
    with torch.no_grad():
        p_c, p_u = pipe.router_probs(x, t, cond), pipe.router_probs(x, t, cond, null=True)
    assert torch.equal(trace.experts[0], p_c.topk(2, dim=1).indices)
    assert torch.equal(trace.uncond_experts[0], p_u.topk(2, dim=1).indices)
    assert not torch.equal(trace.experts[0], trace.uncond_experts[0])  # the prompt routes some rows elsewhere
    ref = dense_mixture(pipe, x, t, cond, trace, 3.0)
    assert (v - ref).abs().max() <= tol(ref)
    # the per-expert rule is the conditional choice for both branches: another velocity
    v_e, trace_e, _ = one_step(pipe, x, t, PROMPTS, "top2", guidance_scale=3.0, guidance="expert")
    assert trace_e.uncond_experts == [None] and (v_e - v).abs().max() > 100 * tol(ref)
    # rows run: every sample on two experts per branch, never more (no expert call is wasted)
    assert sum(trace.stats.rows.values()) == 12 * 2 * 2 == sum(trace_e.stats.rows.values())


def test_an_unguided_step_routes_the_prompt_alone_and_runs_no_null_rows(prompt_fleet):
    """Outside the guidance interval (t > guidance_max_t) the velocity is the conditional mixture: one branch."""
    pipe = opened(prompt_fleet)
    x, t = torch.randn(6, 1, 8, 8), torch.full((6,), 0.9)
    v, trace, cond = one_step(pipe, x, t, PROMPTS, "top2", guidance_scale=3.0, guidance_max_t=0.5)
    assert sum(trace.stats.rows.values()) == 6 * 2
    plain, _, _ = one_step(pipe, x, t, PROMPTS, "top2", guidance_scale=1.0)
    assert torch.equal(v, plain)


def test_cache_and_route_every_sample_the_mixture_too(prompt_fleet):
    """--cache 0 skips nothing: the same images; --route-every 2 reuses both branches' choices in between."""
    pipe = opened(prompt_fleet)
    kw = dict(n=4, strategy="top2", steps=4, guidance_scale=3.0, seed=2)
    plain = pipe(PROMPTS, **kw)
    assert torch.equal(pipe(PROMPTS, cache=0.0, **kw).images, plain.images)
    cached = pipe(PROMPTS, cache=1e-9, **kw)  # nothing changes by less than 1e-9: every block runs
    assert torch.allclose(cached.images, plain.images, rtol=0, atol=tol(plain.images) * 4)
    assert cached.trace.stats.cache.blocks_skipped == 0 and cached.trace.stats.cache.blocks_run > 0
    every2 = pipe(PROMPTS, route_every=2, **kw)
    assert every2.trace.routed == [True, False, True, False]
    for i in (1, 3):
        assert torch.equal(every2.trace.uncond_experts[i], every2.trace.uncond_experts[i - 1])


def png_bytes(images) -> list[bytes]:
    return [np.asarray(im).tobytes() for im in images]


@pytest.mark.parametrize("strategy", ["top2", "trajectory"])
def test_generate_serve_and_diffusers_draw_the_same_images_for_a_seed(prompt_fleet, tmp_path, strategy):
    """One seed, one computation: the images of generate, of the server and of diffusers' loader with the seed's
    generator are the same pixels (the trajectory sampler's draws included: they are read off the noise)."""
    kw = dict(strategy=strategy, steps=4, guidance_scale=3.0)
    out_png, encoder = str(tmp_path / "g.png"), HashTextEncoder(384, 4)
    ours = generate(prompt_fleet, prompts=[PROMPTS[0]], n=3, seed=5, out=out_png, text_encoder=encoder, **kw)
    want = png_bytes(to_pil(ours.output.images))
    assert len({b for image in want for b in image}) > 50  # grey levels, not a saturated picture
    svc = FleetService(opened(prompt_fleet), read_card(prompt_fleet), ServeLimits())
    served = svc.generate(GenerateRequest(prompt=PROMPTS[0], n=3, seed=5, **kw))
    assert png_bytes(served.images) == want
    first = served.routing[0][0]  # the answer's routing: each branch's experts where they were routed apart
    if strategy == "top2":
        assert first["uncond_experts"] == ours.output.trace.uncond_experts[0][0].tolist()
    else:  # one drawn expert serves both branches
        assert "uncond_experts" not in first and len(first["experts"]) == 1
    pipe = DiffusionPipeline.from_pretrained(prompt_fleet, trust_remote_code=True)
    pipe.fleet.text_encoder = HashTextEncoder(384, 4)
    out = pipe(PROMPTS[0], num_inference_steps=4, guidance_scale=3.0, num_images_per_prompt=3,
               generator=torch.Generator().manual_seed(5), strategy=strategy)  # fmt: skip
    assert png_bytes(out.images) == want
    assert ours.output.settings.guidance == "mixture"


def test_generate_nproc_2_draws_the_single_process_images(prompt_fleet, tmp_path):
    """Two torchrun ranks, one CFG half each: the unconditional rank runs its own branch's experts. The folder's
    own text encoder in both runs; sync attention: float rounding at most, a grey level on a rounding edge."""
    args = ["generate", prompt_fleet, "--prompt", PROMPTS[0], "--prompt", PROMPTS[1], "--n", "3", "--steps", "3",
            "--cfg", "3", "--seed", "4"]  # fmt: skip
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for out, extra in (("single.png", []), ("par.png", ["--nproc", "2", "--parallel", "sync"])):
        proc = subprocess.run(
            [sys.executable, "-m", "flowfleet.cli", *args, "--out", str(tmp_path / out), *extra],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
    single = np.asarray(Image.open(tmp_path / "single.png")).astype("int16")
    par = np.asarray(Image.open(tmp_path / "par.png")).astype("int16")
    assert single.shape == par.shape and np.abs(single - par).max() <= 1
    assert "the 2 CFG halves on 2 rank groups" in proc.stderr
