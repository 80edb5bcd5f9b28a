"""FleetPipeline's routed sampling (paris §2.7): exactness on the closed-form toy, per-sample top-k that
runs only the selected experts, renormalised weights, router caching, lazy loading and offloading."""

from __future__ import annotations

import re

import pytest
import torch
from fixtures.random_fleet import HashTextEncoder, randomize_, tiny_run_config
from fixtures.tolerances import gamma, max_abs, net_tol
from fixtures.toy import GaussianMixture, LabelledMixture, cluster_posterior

from flowfleet.errors import FlowfleetError
from flowfleet.flow import cfg_combine, guidance_scale_at, integrate, time_grid
from flowfleet.flow.ensemble import combine
from flowfleet.models.dit import DiTExpert, DiTRouter
from flowfleet.sampling import Condition, ExpertStore, FleetPipeline, RoutingTrace

CLUSTERS = [[0, 1], [2, 3], [4, 5]]


pytestmark = pytest.mark.usefixtures("one_thread")


# --------------------------------------------------------------------------------------------------
#                                          Helpers
# --------------------------------------------------------------------------------------------------


class Counting:
    """Wraps an expert callable and records every call's inputs."""

    def __init__(self, fn):
        self.fn = fn
        self.calls: list[dict] = []

    def __call__(self, x, t, **cond):
        self.calls.append({"x": x.clone(), "t": t.clone(), "drop": cond.get("drop"), "labels": cond.get("labels")})
        return self.fn(x, t, **cond)


class FixedRouter:
    """Router whose logits do not depend on x: row b of `logits` for sample b (cycled)."""

    def __init__(self, logits: torch.Tensor):
        self.logits = logits
        self.calls = 0

    def __call__(self, x, t):
        self.calls += 1
        idx = torch.arange(x.shape[0]) % self.logits.shape[0]
        return self.logits[idx].to(x.dtype)


def toy_pipeline(router=None) -> tuple[FleetPipeline, GaussianMixture]:
    mix = GaussianMixture.default()
    experts = [(lambda sub: lambda x, t, **_: sub.velocity(x, t))(mix.subset(c)) for c in CLUSTERS]
    if router is None:

        def router(x, t):
            return cluster_posterior(mix, CLUSTERS, x, t).log()  # softmax(log p) = p

    pipe = FleetPipeline(ExpertStore.from_callables(experts), router, latent_shape=(2,), dtype=torch.float64)
    return pipe, mix


def fleet_tol(ref: torch.Tensor, steps: int = 1) -> float:
    """Routed top-k runs each expert on its own samples only, the dense reference on all of them: the same
    per-sample sums, blocked by other batch sizes. dit_fleet's longest reduction is the 384-wide caption
    projection; one block (~4 roundings) plus the embeddings, the final layer and the CFG/mixture sums: ~8."""
    return net_tol(ref, reduction=384, layers=8, steps=steps)


# Router weights renormalised over K = 4 experts: a K-term sum, a division, and the K-term sum checked
# again: gamma_{2K+1} relative to weights <= 1.
NORMALISED = gamma(2 * 4 + 1, torch.float32)


@pytest.fixture(scope="module")
def dit_fleet():
    """4 random tiny DiT experts (8x8x1, hidden 32, depth 1, cross-attn) and a random router."""
    cfg = tiny_run_config(4)
    experts = [randomize_(DiTExpert.from_dit_config(cfg.expert), seed=k).eval() for k in range(4)]
    router = randomize_(DiTRouter.from_dit_config(cfg.router), seed=99).eval()
    return cfg, experts, router


def dit_pipeline(dit_fleet, *, router=None, present=None, max_resident=None):
    cfg, experts, dit_router = dit_fleet
    wrapped = [Counting(e) for e in experts]
    store = ExpertStore.from_callables(wrapped, present=present, max_resident=max_resident)
    pipe = FleetPipeline(
        store,
        router or dit_router,
        latent_shape=(1, 8, 8),
        conditioning="cross_attn",
        text_encoder=HashTextEncoder(384, 4),
    )
    return pipe, wrapped


def encoded(pipe, n):
    cond, _ = pipe.encode_condition(["a digit", "two small digits", "a very round zero here"], None, n)
    return cond


def one_step(pipe, x, t, cond, strategy, guidance_scale=2.0):
    """One routed velocity evaluation and its trace."""
    s = pipe.settings(strategy, guidance_scale=guidance_scale)
    trace = RoutingTrace(pipe.num_experts)
    with torch.no_grad():
        v = pipe.velocity_fn(cond, s, trace)(x, t, 0)
    return v, trace


def dense_reference(pipe, experts, x, t, cond, guidance_scale, probs=None):
    """sum_k p(k) v_k with every expert run on every sample (what top-k must equal for k = K)."""
    with torch.no_grad():
        if probs is None:
            probs = torch.softmax(pipe.router(x, t), dim=1)
        vs = []
        for e in experts:
            drop = torch.cat([torch.zeros(len(x), dtype=torch.bool), torch.ones(len(x), dtype=torch.bool)])
            both = {name: torch.cat([c, c]) for name, c in cond.kwargs().items()}
            v = e(torch.cat([x, x]), torch.cat([t, t]), drop=drop, **both)
            vs.append(cfg_combine(*v.chunk(2), guidance_scale))
        return combine(torch.stack(vs), probs)


# --------------------------------------------------------------------------------------------------
#                          Closed-form toy: the fleet equals the global flow
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sampler", ["euler", "heun"])
def test_full_ensemble_with_exact_router_equals_global_closed_form_flow(sampler):
    pipe, mix = toy_pipeline()
    noise = torch.randn(128, 2, dtype=torch.float64)
    settings = pipe.settings("full", steps=16, sampler=sampler, guidance_scale=1.0)
    x0, trace = pipe.sample(noise, Condition(), settings)
    ref = integrate(lambda x, t, i: mix.velocity(x, t), noise, time_grid(16).double(), sampler)
    # float64 both ways, the same closed form summed per cluster vs over all 6 components: ~10 roundings per
    # component and evaluation, 2 evaluations (Heun) x 16 steps. The posterior's exponent |x - mu|^2 / var
    # amplifies a rounding by up to max|x|^2 / min var (var >= 0.25^2 at t = 0).
    n = 10 * 6 * 2 * 16
    amplification = max_abs(ref) ** 2 / float(mix.stds.min()) ** 2
    assert torch.allclose(x0, ref, atol=gamma(n) * amplification * max_abs(ref), rtol=0), (x0 - ref).abs().max()
    # and it really is sampling the mixture: every sample ends next to one of the six means
    nearest = torch.cdist(x0, mix.means).min(dim=1).values
    assert (nearest < 4 * mix.stds.max()).float().mean() > 0.97
    assert trace.num_steps == 16 and trace.stats.calls[0] > 0


def test_toy_ensemble_with_a_wrong_router_does_not_equal_the_global_flow():
    """The equality above is a property of the exact posterior, not of the test."""
    pipe, mix = toy_pipeline(router=FixedRouter(torch.zeros(1, 3, dtype=torch.float64)))  # uniform
    noise = torch.randn(64, 2, dtype=torch.float64)
    x0, _ = pipe.sample(noise, Condition(), pipe.settings("full", steps=24, guidance_scale=1.0))
    ref = integrate(lambda x, t, i: mix.velocity(x, t), noise, time_grid(24).double(), "euler")
    assert (x0 - ref).abs().max() > 0.1


def test_toy_top1_follows_the_posterior_argmax_and_lands_in_its_cluster():
    pipe, mix = toy_pipeline()
    noise = torch.randn(128, 2, dtype=torch.float64)
    x0, trace = pipe.sample(noise, Condition(), pipe.settings("top1", steps=24, guidance_scale=1.0))
    for probs, experts, weights in zip(trace.probs, trace.experts, trace.weights):
        assert torch.equal(experts[:, 0], probs.argmax(1))
        assert torch.equal(weights, torch.ones_like(weights))
    final_cluster = trace.experts[-1][:, 0]
    comp = torch.cdist(x0, mix.means).argmin(dim=1)
    cluster_of = torch.tensor([i for i, c in enumerate(CLUSTERS) for _ in c])
    assert (cluster_of[comp] == final_cluster).float().mean() > 0.95


# --------------------------------------------------------------------------------------------------
#                   Labelled toy: guidance over the mixture is the whole data set's
# --------------------------------------------------------------------------------------------------


class ToyRouter:
    """The labelled toy's exact router in the model-call convention: log p(k | x_t, y), or log p(k | x_t) on the
    rows with drop=True; it reads the condition."""

    reads_condition = True

    def __init__(self, toy: LabelledMixture):
        self.toy = toy
        self.calls: list[int] = []

    def __call__(self, x, t, labels=None, drop=None):
        self.calls.append(x.shape[0])
        post = self.toy.posterior(x, t, labels)
        if drop is not None and bool(drop.any()):
            post = torch.where(drop[:, None], self.toy.posterior(x, t), post)
        return post.log()  # softmax(log p) = p; a cluster without the class: -inf, weight 0


def labelled_pipeline(router=None) -> tuple[FleetPipeline, LabelledMixture, list[Counting]]:
    toy = LabelledMixture.default()

    def expert(k):
        def velocity(x, t, labels=None, drop=None):
            v = toy.expert_velocity(k, x, t, labels)
            return v if drop is None else torch.where(drop[:, None], toy.expert_velocity(k, x, t), v)

        return Counting(velocity)

    experts = [expert(k) for k in range(len(toy.clusters))]
    pipe = FleetPipeline(
        ExpertStore.from_callables(experts),
        router or ToyRouter(toy),
        latent_shape=(2,),
        conditioning="class",
        num_classes=toy.num_classes,
        dtype=torch.float64,
    )
    return pipe, toy, experts


def toy_guided(toy: LabelledMixture, scale: float):
    """The whole data set's guided velocity u(x) + s (u(x | y) - u(x)) as a velocity function of labels y."""
    return lambda y: lambda x, t, i: cfg_combine(toy.velocity(x, t, y), toy.velocity(x, t), scale)


def toy_tol(toy: LabelledMixture, x: torch.Tensor, ref: torch.Tensor, scale: float, evaluations: int = 1) -> float:
    """float64 closed forms per cluster vs over the components (~10 roundings per component), amplified by the
    posterior's exponent (max|x|^2 / min var) in each branch, combined with weights 1 + s and s, per evaluation."""
    amplification = max_abs(x) ** 2 / float(toy.mix.stds.min()) ** 2
    return (1 + 2 * scale) * gamma(10 * 6 * evaluations) * amplification * max_abs(ref)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_mixture_guidance_samples_the_whole_data_sets_guided_flow(seed):
    """Through the fleet's sampler, full ensemble, exact experts and router: guidance over the mixture integrates
    the guided flow of one model of all the data; guidance inside each expert ends elsewhere."""
    pipe, toy, _ = labelled_pipeline()
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(96, 2, dtype=torch.float64, generator=g)
    labels = torch.randint(0, 3, (96,), generator=g)
    cond = Condition(labels=labels)
    ref = integrate(toy_guided(toy, 3.0)(labels), noise, time_grid(16).double(), "euler")
    x0, trace = pipe.sample(noise, cond, pipe.settings("full", steps=16, guidance_scale=3.0, guidance="mixture"))
    assert (x0 - ref).abs().max() <= toy_tol(toy, ref, ref, 3.0, evaluations=16)
    assert all(e is not None for e in trace.uncond_experts)  # each branch routed on its own
    per_expert, trace_e = pipe.sample(
        noise, cond, pipe.settings("full", steps=16, guidance_scale=3.0, guidance="expert")
    )
    assert (per_expert - ref).norm(dim=1).max() > 0.1 * ref.norm(dim=1).max()
    assert all(e is None for e in trace_e.uncond_experts)


def test_mixture_top1_runs_one_expert_per_sample_and_branch():
    """Each branch takes its own posterior's top-1: an expert runs on the conditional rows of the samples whose
    p(k | x_t, y) it tops and the unconditional rows of those whose p(k | x_t) it tops, nothing else: 2 rows per
    sample, a monolith's guided step; each branch's mixture then weighs 1 on its own expert."""
    pipe, toy, experts = labelled_pipeline()
    g = torch.Generator().manual_seed(4)
    x, t = 2 * torch.randn(64, 2, dtype=torch.float64, generator=g), torch.full((64,), 0.3, dtype=torch.float64)
    labels = torch.randint(0, 3, (64,), generator=g)
    v, trace = one_step(pipe, x, t, Condition(labels=labels), "top1", guidance_scale=3.0)
    top_c, top_u = toy.posterior(x, t, labels).argmax(1), toy.posterior(x, t).argmax(1)
    assert torch.equal(trace.experts[0][:, 0], top_c) and torch.equal(trace.uncond_experts[0][:, 0], top_u)
    assert bool((top_c != top_u).any())  # the prompt moves some samples to another cluster
    assert sum(trace.stats.rows.values()) == 2 * 64
    for k, expert in enumerate(experts):
        (call,) = expert.calls  # once per evaluation, both branches batched
        cond_rows, null_rows = (top_c == k).nonzero()[:, 0], (top_u == k).nonzero()[:, 0]
        assert torch.equal(call["x"], torch.cat([x[cond_rows], x[null_rows]]))
        assert torch.equal(call["drop"], torch.arange(call["x"].shape[0]) >= cond_rows.numel())
    want = torch.stack([cfg_combine(toy.expert_velocity(c, x[i : i + 1], t[i : i + 1], labels[i : i + 1]),
                                    toy.expert_velocity(u, x[i : i + 1], t[i : i + 1]), 3.0)[0]
                        for i, (c, u) in enumerate(zip(top_c.tolist(), top_u.tolist()))])  # fmt: skip
    assert torch.equal(v, want)  # one expert per branch, weight 1: no sum to round


def test_a_prompt_blind_router_guides_the_same_under_both_rules():
    """A router that does not read the condition has one posterior for both branches: the two rules are one field,
    computed once (one router pass per evaluation), bit for bit."""
    toy = LabelledMixture.default()
    blind = lambda x, t: torch.log(torch.stack(  # noqa: E731 - p(k | x_t), the exact prompt-blind router
        [torch.softmax(toy.mix.log_joint(x, t), 1)[:, c].sum(1) for c in toy.clusters], 1))  # fmt: skip
    pipe, _, _ = labelled_pipeline(router=blind)
    noise, labels = torch.randn(32, 2, dtype=torch.float64), torch.arange(32) % 3
    runs = [pipe.sample(noise, Condition(labels=labels), pipe.settings("top2", steps=6, guidance_scale=3.0,
                                                                          guidance=rule))
            for rule in ("mixture", "expert")]  # fmt: skip
    assert torch.equal(runs[0][0], runs[1][0]) and runs[0][1].router_calls == runs[1][1].router_calls == 6


def test_trajectory_draws_one_expert_per_image_from_the_prompts_posterior_and_keeps_it():
    """trajectory: at the first step each image draws one expert from p(k | x_1, y) and keeps it to the end; the
    draw is the image's own (its noise's), so it does not change with the batch split, and over many images it
    follows the posterior."""
    pipe, toy, _ = labelled_pipeline()
    n = 3000
    out = pipe(None, n, labels=[0, 1, 2], strategy="trajectory", steps=4, guidance_scale=3.0, seed=11)
    chosen = out.trace.experts[0][:, 0]
    assert out.trace.routed == [True, False, False, False]
    assert all(torch.equal(e[:, 0], chosen) for e in out.trace.experts)
    assert torch.equal(out.trace.weights[0], torch.ones(n, 1, dtype=out.trace.weights[0].dtype))
    split = pipe(None, n, labels=[0, 1, 2], strategy="trajectory", steps=4, guidance_scale=3.0, seed=11, batch_size=7)
    assert torch.equal(split.trace.experts[0], out.trace.experts[0]) and torch.equal(split.images, out.images)
    labels = torch.arange(n) % 3
    noise = pipe.noise(n, 11)
    prior = toy.posterior(noise, torch.ones(n, dtype=torch.float64), labels)  # [n, K] at x_1, t = 1
    for y in range(3):
        rows = labels == y
        share = torch.bincount(chosen[rows], minlength=3).double() / rows.sum()
        expected = prior[rows].mean(0)
        # a multinomial share of ~1000 draws: sd <= 0.5 / sqrt(1000) = 0.016; 0.06 is > 3.5 sd
        assert (share - expected).abs().max() < 0.06, (y, share, expected)
        assert bool((share[expected < 1e-9] == 0).all())  # never a cluster that holds no image of the class


# --------------------------------------------------------------------------------------------------
#                                Per-sample top-k with DiT experts
# --------------------------------------------------------------------------------------------------


def test_topk_with_k_equal_K_equals_the_dense_full_ensemble(dit_fleet):
    pipe, wrapped = dit_pipeline(dit_fleet)
    x, t = torch.randn(6, 1, 8, 8), torch.rand(6)
    cond = encoded(pipe, 6)
    ref = dense_reference(pipe, dit_fleet[1], x, t, cond, guidance_scale=2.0)
    v_topk, _ = one_step(pipe, x, t, cond, "topk:4")
    v_full, _ = one_step(pipe, x, t, cond, "full")
    assert torch.allclose(v_topk, ref, rtol=0, atol=fleet_tol(ref))
    assert torch.equal(v_topk, v_full)
    assert ref.abs().mean() > 1e-2  # random experts give non-trivial velocities


def test_top1_picks_the_argmax_expert_per_sample(dit_fleet):
    pipe, wrapped = dit_pipeline(dit_fleet)
    x, t = torch.randn(8, 1, 8, 8), torch.rand(8)
    cond = encoded(pipe, 8)
    v, trace = one_step(pipe, x, t, cond, "top1")
    with torch.no_grad():
        argmax = pipe.router(x, t).argmax(1)
    assert torch.equal(trace.experts[0][:, 0], argmax)
    assert len(set(argmax.tolist())) > 1  # the batch really mixes experts
    onehot = torch.nn.functional.one_hot(argmax, 4).double()
    ref = dense_reference(pipe, dit_fleet[1], x, t, cond, guidance_scale=2.0, probs=onehot)
    assert torch.allclose(v, ref, rtol=0, atol=fleet_tol(ref))


def test_only_selected_experts_run_each_on_exactly_its_samples(dit_fleet):
    # sample 0 -> experts {2, 0}, 1 -> {2, 3}, 2 -> {0, 2}; expert 1 is never in anyone's top-2
    logits = torch.tensor([[2.0, -9, 3.0, 0.0], [-1.0, -9, 3.0, 2.0], [3.0, -9, 2.0, 0.0]])
    pipe, wrapped = dit_pipeline(dit_fleet, router=FixedRouter(logits))
    x, t = torch.randn(3, 1, 8, 8), torch.rand(3)
    cond = encoded(pipe, 3)
    v, trace = one_step(pipe, x, t, cond, "top2", guidance_scale=3.0)
    expected_rows = {0: [0, 2], 1: [], 2: [0, 1, 2], 3: [1]}
    for k, rows in expected_rows.items():
        calls = wrapped[k].calls
        if not rows:
            assert calls == [], f"expert {k} ran although no sample selected it"
            continue
        assert len(calls) == 1, f"expert {k} should run once (cond + uncond batched)"
        call = calls[0]
        n = len(rows)
        assert call["x"].shape[0] == 2 * n
        assert torch.equal(call["x"], torch.cat([x[rows], x[rows]]))
        assert torch.equal(call["drop"], torch.tensor([False] * n + [True] * n))
    assert dict(trace.stats.rows) == {0: 4, 2: 6, 3: 2}
    ref = dense_reference(
        pipe,
        dit_fleet[1],
        x,
        t,
        cond,
        guidance_scale=3.0,
        probs=torch.zeros(3, 4).scatter(1, trace.experts[0], trace.weights[0].float()),
    )
    assert torch.allclose(v, ref, rtol=0, atol=fleet_tol(ref))


@pytest.mark.parametrize("strategy", ["top1", "top2", "topk:3", "full"])
def test_weights_sum_to_one_and_follow_the_router(dit_fleet, strategy):
    pipe, _ = dit_pipeline(dit_fleet)
    noise = torch.randn(5, 1, 8, 8)
    settings = pipe.settings(strategy, steps=3, guidance_scale=1.5)
    _, trace = pipe.sample(noise, encoded(pipe, 5), settings)
    k = settings.k
    for probs, experts, weights in zip(trace.probs, trace.experts, trace.weights):
        assert experts.shape == weights.shape == (5, k)
        assert torch.allclose(weights.sum(1), torch.ones(5), rtol=0, atol=NORMALISED)
        picked = probs.gather(1, experts)
        assert torch.allclose(weights, picked / picked.sum(1, keepdim=True), rtol=0, atol=NORMALISED)
        assert torch.all(picked.min(1).values >= probs.topk(k, 1).values[:, -1] - 1e-7)


def test_partial_fleet_renormalises_over_present_experts(dit_fleet):
    pipe, wrapped = dit_pipeline(dit_fleet, present=[0, 2, 3])
    x, t = torch.randn(6, 1, 8, 8), torch.rand(6)
    cond = encoded(pipe, 6)
    v, trace = one_step(pipe, x, t, cond, "full")
    with torch.no_grad():
        p = torch.softmax(pipe.router(x, t), dim=1)
    renorm = p[:, [0, 2, 3]] / p[:, [0, 2, 3]].sum(1, keepdim=True)
    assert torch.allclose(trace.probs[0][:, [0, 2, 3]], renorm.float(), rtol=0, atol=NORMALISED)
    assert torch.all(trace.probs[0][:, 1] == 0)
    assert wrapped[1].calls == []
    dense = torch.zeros(6, 4)
    dense[:, [0, 2, 3]] = renorm
    ref = dense_reference(pipe, dit_fleet[1], x, t, cond, guidance_scale=2.0, probs=dense)
    assert torch.allclose(v, ref, rtol=0, atol=fleet_tol(ref))
    with pytest.raises(FlowfleetError, match="k=4 exceeds the 3 experts present"):
        pipe.settings("topk:4")


# --------------------------------------------------------------------------------------------------
#                                  Router caching, loading, batches
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sampler,route_every,router_calls",
    [("euler", 1, 6), ("euler", 2, 3), ("euler", 4, 2), ("heun", 1, 11), ("heun", 3, 2)],
)
def test_route_every_reuses_the_router_choice_in_between(dit_fleet, sampler, route_every, router_calls):
    _, _, dit_router = dit_fleet
    counting = Counting(dit_router)
    pipe, _ = dit_pipeline(dit_fleet, router=counting)
    settings = pipe.settings("top1", steps=6, sampler=sampler, route_every=route_every)
    _, trace = pipe.sample(torch.randn(4, 1, 8, 8), encoded(pipe, 4), settings)
    assert len(counting.calls) == router_calls == trace.router_calls
    assert trace.routed == [i % route_every == 0 for i in range(6)]
    for i in range(6):  # in between, the selection of the last routed step is reused
        last = i - i % route_every
        assert torch.equal(trace.experts[i], trace.experts[last])


def test_experts_load_lazily_and_offload_bounds_the_resident_set(dit_fleet):
    cfg, experts, _ = dit_fleet
    resident_sizes = []
    store = None

    def loader(k):
        resident_sizes.append(len(store.resident))
        return experts[k]

    # samples alternate between experts 1 and 3; 0 and 2 are never selected
    logits = torch.tensor([[0.0, 5.0, 0.0, 1.0], [0.0, 1.0, 0.0, 5.0]])
    store = ExpertStore(loader, range(4), 4, max_resident=None)
    pipe = FleetPipeline(
        store,
        FixedRouter(logits),
        latent_shape=(1, 8, 8),
        conditioning="cross_attn",
        text_encoder=HashTextEncoder(384, 4),
    )
    pipe(["a digit"], n=4, strategy="top1", steps=3, guidance_scale=2.0)
    assert dict(store.loads) == {1: 1, 3: 1}  # lazily, once each
    store = ExpertStore(loader, range(4), 4, max_resident=1)
    pipe.experts = store
    out = pipe(["a digit"], n=4, strategy="top1", steps=3, guidance_scale=2.0)
    assert max(resident_sizes) <= 1 and len(store.resident) == 1
    # 3 steps x 2 experts with room for 1: the expert still resident runs first at each step, so only one
    # load per step after the first (4 loads, 3 releases) instead of two (6, 5)
    assert (store.loads[1] + store.loads[3], sum(store.releases.values())) == (4, 3)
    ref = FleetPipeline(
        ExpertStore.from_callables(experts),
        FixedRouter(logits),
        latent_shape=(1, 8, 8),
        conditioning="cross_attn",
        text_encoder=HashTextEncoder(384, 4),
    )
    assert torch.equal(out.images, ref(["a digit"], n=4, strategy="top1", steps=3, guidance_scale=2.0).images)


def test_batching_and_seed_determine_the_images(dit_fleet):
    pipe, _ = dit_pipeline(dit_fleet)
    kw = dict(n=5, strategy="top2", steps=3, guidance_scale=2.0, seed=7)
    a = pipe(["a digit", "another"], **kw)
    b = pipe(["a digit", "another"], batch_size=2, **kw)
    assert torch.allclose(a.images, b.images, rtol=0, atol=fleet_tol(a.images, steps=3))  # other batches
    assert torch.equal(torch.stack(a.trace.experts), torch.stack(b.trace.experts))
    c = pipe(["a digit", "another"], **{**kw, "seed": 8})
    assert not torch.allclose(a.images, c.images)
    assert a.prompts == ["a digit", "another", "a digit", "another", "a digit"]
    assert a.images.shape == (5, 1, 8, 8) and a.images.abs().max() <= 1
    # settings resolved once by pipe.settings() (what generate and evaluate pass) give the same images
    resolved = pipe.settings("top2", steps=3, guidance_scale=2.0, seed=7)
    d = pipe(["a digit", "another"], n=5, settings=resolved)
    assert torch.equal(d.images, a.images) and d.settings == a.settings


def test_guidance_max_t_guides_only_the_steps_at_or_below_it(dit_fleet):
    """Above guidance_max_t a step is the unguided velocity, with no unconditional rows; at or below it, the
    guided one: the same computations as cfg 1 and cfg 3 without the interval, so bit for bit."""
    pipe, wrapped = dit_pipeline(dit_fleet)
    cond = encoded(pipe, 4)
    x = torch.randn(4, 1, 8, 8)
    s = pipe.settings("top2", guidance_scale=3.0, guidance_max_t=0.5)
    assert (s.guidance_scale, s.guidance_max_t) == (3.0, 0.5) and s.to_json()["guidance_max_t"] == 0.5

    def velocity(guidance_scale, max_t, t):
        trace = RoutingTrace(pipe.num_experts)
        with torch.no_grad():
            settings = pipe.settings("top2", guidance_scale=guidance_scale, guidance_max_t=max_t)
            return pipe.velocity_fn(cond, settings, trace)(x, torch.full((4,), t), 0)

    for t, plain_cfg in ((0.9, 1.0), (0.5000001, 1.0), (0.5, 3.0), (0.1, 3.0)):
        for w in wrapped:
            w.calls.clear()
        v = velocity(3.0, 0.5, t)
        rows = sum(call["x"].shape[0] for w in wrapped for call in w.calls)
        assert rows == 4 * 2 * (2 if plain_cfg != 1.0 else 1), t  # top-2: each sample on 2 experts
        assert torch.equal(v, velocity(plain_cfg, 1.0, t)), t
    # the fleet's own default comes from its scheduler config (model_index.json); a call may set it
    assert pipe.settings("top2").guidance_max_t == 1.0
    kw = dict(n=2, strategy="top2", steps=4, guidance_scale=3.0)
    assert pipe(["a digit"], guidance_max_t=0.5, **kw).settings.guidance_max_t == 0.5
    assert not torch.equal(pipe(["a digit"], guidance_max_t=0.5, **kw).images, pipe(["a digit"], **kw).images)
    # times are compared at the grid's float32 precision: a grid time equal to guidance_max_t is guided
    grid = time_grid(20)  # 1, 0.95, ..., 0.8 (0.800000012 in float32), ...
    assert [guidance_scale_at(3.0, float(t), 0.8) for t in grid[3:6]] == [1.0, 3.0, 3.0]


def test_guidance_scale_one_runs_no_unconditional_pass(dit_fleet):
    pipe, wrapped = dit_pipeline(dit_fleet)
    x, t = torch.randn(4, 1, 8, 8), torch.rand(4)
    one_step(pipe, x, t, encoded(pipe, 4), "full", guidance_scale=1.0)
    for w in wrapped:
        assert [c["x"].shape[0] for c in w.calls] == [4]


def test_single_expert_without_router_is_a_monolith(dit_fleet):
    _, experts, _ = dit_fleet
    pipe = FleetPipeline(
        ExpertStore.from_callables(experts[:1]),
        None,
        latent_shape=(1, 8, 8),
        conditioning="cross_attn",
        text_encoder=HashTextEncoder(384, 4),
    )
    x, t = torch.randn(3, 1, 8, 8), torch.rand(3)
    cond = encoded(pipe, 3)
    v, trace = one_step(pipe, x, t, cond, "top1")
    ref = dense_reference(pipe, experts[:1], x, t, cond, guidance_scale=2.0, probs=torch.ones(3, 1))
    assert torch.allclose(v, ref, rtol=0, atol=fleet_tol(ref))
    with pytest.raises(ValueError, match="router is required"):
        FleetPipeline(ExpertStore.from_callables(experts), None, latent_shape=(1, 8, 8))


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(strategy="best"), "strategy: unknown strategy 'best'"),
        (dict(strategy="top5"), "strategy: strategy 'top5': k=5 exceeds the 4 experts present"),
        (dict(strategy="topk:0"), "strategy: unknown strategy"),
        (dict(steps=0), "steps: Input should be greater than or equal to 1, got 0"),
        (dict(sampler="rk4"), "sampler: Input should be 'euler' or 'heun', got 'rk4'"),
        (dict(route_every=0), "route_every: Input should be greater than or equal to 1, got 0"),
        (dict(guidance_max_t=0.0), "guidance_max_t: Input should be greater than 0, got 0.0"),
        (dict(guidance_max_t=1.5), "guidance_max_t: Input should be less than or equal to 1, got 1.5"),
        (dict(guidance_scale=float("nan")), "guidance_scale: Input should be a finite number, got nan"),
        (dict(seed=-1), "seed: Input should be greater than or equal to 0, got -1"),
        (
            dict(stepz=3),
            "stepz: not a sampling setting (one of steps, sampler, guidance_scale, guidance_max_t, shift, strategy,",
        ),
    ],
)
def test_bad_settings_are_one_line_errors(dit_fleet, kwargs, message):
    pipe, _ = dit_pipeline(dit_fleet)
    with pytest.raises(FlowfleetError, match=re.escape(message)) as info:
        pipe.settings(**kwargs)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("prompts,message", [([], "^prompt: required"), (["ok", "  "], "^prompt: empty prompt")])
def test_bad_prompts_are_one_line_errors(dit_fleet, prompts, message):
    pipe, wrapped = dit_pipeline(dit_fleet)
    with pytest.raises(FlowfleetError, match=message):
        pipe(prompts, n=2, steps=2)
    assert all(w.calls == [] for w in wrapped)


def test_class_conditioned_fleet_cycles_labels_and_checks_their_range():
    cfg = tiny_run_config(2, conditioning="none")
    expert_cfg = cfg.expert.model_copy(update={"conditioning": "class", "num_classes": 10})
    experts = [Counting(randomize_(DiTExpert.from_dit_config(expert_cfg), seed=k).eval()) for k in range(2)]
    router = randomize_(DiTRouter.from_dit_config(cfg.router), seed=5).eval()
    pipe = FleetPipeline(
        ExpertStore.from_callables(experts), router, latent_shape=(1, 8, 8), conditioning="class", num_classes=10
    )
    out = pipe(None, n=3, labels=[3, 7], strategy="full", steps=1, guidance_scale=2.0)
    assert out.images.shape == (3, 1, 8, 8)
    for e in experts:  # one call per expert: [3, 7, 3] conditional then the same rows dropped
        assert len(e.calls) == 1 and torch.equal(e.calls[0]["drop"], torch.tensor([False] * 3 + [True] * 3))
        assert torch.equal(e.calls[0]["labels"], torch.tensor([3, 7, 3] * 2))
    with pytest.raises(FlowfleetError, match="^label: 10 outside 0..9"):
        pipe(None, n=2, labels=[10])
    with pytest.raises(FlowfleetError, match="^label: required"):
        pipe(["a prompt"], n=2)
