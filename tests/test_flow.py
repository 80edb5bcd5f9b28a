"""Flow matching on the 2-D Gaussian mixture: sampler accuracy, paris Eq. 3, a DiT that learns."""

from __future__ import annotations

import pytest
import torch
from fixtures.tolerances import gamma, max_abs, unit_roundoff
from fixtures.toy import GaussianMixture, LabelledMixture, cluster_posterior

from flowfleet.flow import (
    Strategy,
    alignment_loss,
    cfg_combine,
    combine,
    dispersive_loss,
    flow_matching_loss,
    guided_mixture,
    integrate,
    interpolate,
    loss_weight,
    routing_weights,
    same_as_earlier,
    sample_t,
    target_velocity,
    time_grid,
    x0_from_velocity,
)
from flowfleet.flow.ensemble import dense_weights
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel

CLUSTERS = [[0, 1], [2, 3, 4], [5]]


def test_path_endpoints_and_velocity():
    x0, eps = torch.randn(4, 3), torch.randn(4, 3)
    assert torch.equal(interpolate(x0, eps, torch.zeros(4)), x0)
    assert torch.equal(interpolate(x0, eps, torch.ones(4)), eps)
    t = torch.rand(4)
    x_t = interpolate(x0, eps, t)
    v = target_velocity(x0, eps)
    # v is the time derivative of the path
    h = 1e-3
    fd = (interpolate(x0, eps, t + h) - interpolate(x0, eps, t - h)) / (2 * h)
    # The path is linear in t, so the central difference is exact but for float32 rounding: each path value
    # within 3u of its size (two products, a sum), t +- h within u (moving x by u |v|), divided by 2h.
    u, size = unit_roundoff(torch.float32), max_abs(torch.stack([x0, eps])) * 2
    assert torch.allclose(fd, v, atol=2 * (3 * u * size + u * max_abs(v)) / (2 * h), rtol=0)
    assert torch.allclose(x0_from_velocity(x_t, v, t), x0, atol=4 * u * (max_abs(x_t) + max_abs(v)), rtol=0)


def test_time_grid_runs_from_noise_to_data():
    g = time_grid(10)
    assert g[0] == 1.0 and g[-1] == 0.0 and len(g) == 11 and torch.all(g[1:] < g[:-1])
    shifted = time_grid(10, shift=3.0)
    assert shifted[0] == 1.0 and shifted[-1] == 0.0 and torch.all(shifted[1:-1] > g[1:-1])
    with pytest.raises(ValueError):
        time_grid(0)


def test_sample_t_modes():
    g = torch.Generator().manual_seed(0)
    u = sample_t(10_000, generator=g)
    ln = sample_t(10_000, mode="logit_normal", generator=g)
    assert 0 <= u.min() and u.max() <= 1 and abs(u.mean() - 0.5) < 0.02
    assert 0 < ln.min() and ln.max() < 1 and abs(ln.mean() - 0.5) < 0.02 and ln.std() < u.std()
    with pytest.raises(ValueError, match="unknown time sampling"):
        sample_t(3, mode="beta")


def test_min_snr_weight_is_min_snr_gamma_over_t():
    """The velocity's Min-SNR-5 weight, min((1 - t)^2, 5 t^2), by hand at four times: the cap on the clean side,
    the SNR on the noisy side."""
    t = torch.tensor([0.1, 0.25, 0.5, 0.9])
    expected = torch.tensor([0.05, 0.3125, 0.25, 0.01])  # 5*0.01, 5*0.0625, 0.5^2, 0.1^2
    assert torch.allclose(loss_weight(t, "min_snr", gamma=5.0), expected, rtol=1e-6, atol=0)
    assert torch.equal(loss_weight(t, "none"), torch.ones(4))
    with pytest.raises(ValueError, match="unknown loss weighting 'snr'"):
        loss_weight(t, "snr")  # type: ignore[arg-type]


def test_min_snr_weighted_velocity_loss_is_min_snr_on_the_clean_estimate():
    """Weighting the velocity's error by loss_weight is Min-SNR-gamma as Hang et al. state it: the clean estimate's
    squared error times min(SNR(t), gamma), SNR = (1 - t)^2 / t^2, averaged over items; weight none is plain."""
    g = torch.Generator().manual_seed(0)
    x0, eps = torch.randn(6, 2, 3, 3, generator=g, dtype=torch.float64), torch.randn(6, 2, 3, 3, generator=g)
    x0, eps = x0.float(), eps.float()
    t = torch.tensor([0.05, 0.2, 0.4, 0.6, 0.8, 0.97])
    velocity_fn = lambda x_t, tt: 0.7 * x_t + tt.reshape(-1, 1, 1, 1)  # noqa: E731  any network
    weighted = flow_matching_loss(velocity_fn, x0, t, eps, loss_weight(t, "min_snr", gamma=4.0))

    x_t = interpolate(x0, eps, t)
    x0_hat = x0_from_velocity(x_t, velocity_fn(x_t, t), t)
    snr = ((1 - t.double()) / t.double()) ** 2
    per_item = ((x0_hat - x0).double() ** 2).mean(dim=(1, 2, 3))  # [6]
    assert weighted.item() == pytest.approx((torch.clamp(snr, max=4.0) * per_item).mean().item(), rel=1e-5)
    plain = flow_matching_loss(velocity_fn, x0, t, eps)
    assert flow_matching_loss(velocity_fn, x0, t, eps, loss_weight(t, "none")).item() == plain.item()
    assert plain.item() == pytest.approx(((velocity_fn(x_t, t) - (eps - x0)) ** 2).mean().item(), rel=1e-6)


def test_dispersive_loss_by_hand():
    """Three items of one token of two numbers, (0, 0), (1, 0), (0, 2): squared distances 1, 4, 5, per number 0.5,
    2, 2.5; the loss is the log of the mean of exp(-d / tau) over all nine ordered pairs, the three i = j among them."""
    z = torch.tensor([[[0.0, 0.0]], [[1.0, 0.0]], [[0.0, 2.0]]])  # [B=3, N=1, D=2]
    for tau in (1.0, 0.5):
        pairs = torch.tensor([0.5, 2.0, 2.5], dtype=torch.float64)
        expected = torch.log((3 + 2 * torch.exp(-pairs / tau).sum()) / 9)
        assert dispersive_loss(z, tau).item() == pytest.approx(expected.item(), rel=1e-6)
    assert dispersive_loss(torch.ones(4, 3, 2)).item() == pytest.approx(0.0, abs=1e-7)  # all alike: its maximum
    far = dispersive_loss(1e3 * torch.eye(4).reshape(4, 1, 4)).item()
    assert far == pytest.approx(-torch.log(torch.tensor(4.0)).item(), rel=1e-6)  # all far apart: -log B
    z = z.clone().requires_grad_(True)
    dispersive_loss(z).backward()
    spread = torch.pdist(z.detach().reshape(3, -1))
    assert (torch.pdist((z - 0.1 * z.grad).detach().reshape(3, -1)) > spread).all()  # descent pushes them apart


def test_alignment_loss_by_hand():
    """REPA's alignment: minus the mean cosine over items and tokens; (1, 0) against (1, 0) is 1, (0, 1) against
    (1, 1) is 1 / sqrt 2, (0, 2) against (0, -3) is -1; a scale of either side changes nothing."""
    projected = torch.tensor([[[1.0, 0.0], [0.0, 1.0]], [[0.0, 2.0], [0.0, 2.0]]])  # [B=2, N=2, C=2]
    target = torch.tensor([[[1.0, 0.0], [1.0, 1.0]], [[0.0, -3.0], [0.0, 5.0]]])
    expected = -(1 + 2**-0.5 - 1 + 1) / 4
    assert alignment_loss(projected, target).item() == pytest.approx(expected, rel=1e-6)
    assert alignment_loss(3 * projected, 0.5 * target).item() == pytest.approx(expected, rel=1e-6)
    assert alignment_loss(target, target).item() == pytest.approx(-1.0, rel=1e-6)


def test_logit_normal_mean_and_std_move_the_times():
    """sample_t's logit-normal draws sigmoid(mean + std n): a positive mean draws noisier times, a small std keeps
    them near sigmoid(mean); mean 0, std 1 draws what the default does, bit for bit."""
    draw = lambda **kw: sample_t(4000, mode="logit_normal", generator=torch.Generator().manual_seed(1), **kw)  # noqa: E731
    assert torch.equal(draw(mean=0.0, std=1.0), draw())
    assert draw(mean=1.0).median().item() == pytest.approx(torch.sigmoid(torch.tensor(1.0)).item(), abs=0.02)
    narrow = draw(mean=-0.5, std=0.1)
    assert (narrow - torch.sigmoid(torch.tensor(-0.5))).abs().max().item() < 0.1


@pytest.mark.parametrize("sampler, steps", [("euler", 100), ("heun", 40)])
def test_closed_form_flow_reaches_the_mixture(sampler, steps):
    """(a) integrating the marginal velocity from noise reproduces the data's mean and covariance."""
    mix = GaussianMixture.default()
    g = torch.Generator().manual_seed(0)
    x1 = torch.randn(10_000, 2, dtype=torch.float64, generator=g)
    x = integrate(lambda x, t, i: mix.velocity(x, t), x1, time_grid(steps).double(), sampler)
    data, _ = mix.sample(10_000, generator=g)
    # Statistical, not rounding: two independent 10,000-sample estimates of a mixture with per-axis sd ~2.2
    # (variance ~4.6): the means' difference has sd sqrt(2) x 2.2 / 100 = 0.031 (0.1 is ~3 sd); a covariance
    # entry's has sd ~sqrt(2 x 2) x 4.6 / 100 = 0.092 (0.25 is ~2.7 sd); the ODE's discretisation error
    # (100 Euler / 40 Heun steps) is well inside both.
    assert torch.allclose(x.mean(0), data.mean(0), atol=0.1)
    assert torch.allclose(torch.cov(x.T), torch.cov(data.T), atol=0.25)
    # and the samples land on the components, not between them
    nearest = torch.cdist(x, mix.means).min(dim=1).values
    assert (nearest < 3 * mix.stds.max()).float().mean() > 0.97


def test_decomposition_identity_paris_eq3():
    """(b) sum_k p(k|x_t) u^(k)(x_t) == u(x_t) with exact posteriors and per-cluster flows."""
    mix = GaussianMixture.default()
    g = torch.Generator().manual_seed(1)
    x = 3 * torch.randn(512, 2, dtype=torch.float64, generator=g)
    t = torch.rand(512, dtype=torch.float64, generator=g).clamp(1e-3, 1)
    velocities = torch.stack([mix.subset(c).velocity(x, t) for c in CLUSTERS])  # [K, B, 2]
    posterior = cluster_posterior(mix, CLUSTERS, x, t)  # [B, K]
    # a float64 softmax over 6 components (exp, 5 additions, a division each), sums within 3 clusters, then
    # over them: fewer than 3 x 6 roundings of terms that add up to 1
    torch.testing.assert_close(posterior.sum(1), torch.ones(512, dtype=torch.float64), rtol=0, atol=gamma(18))
    # float64, per-cluster flows and posteriors vs all 6 components at once: ~10 roundings per component;
    # the posterior's exponent |x - mu|^2 / var amplifies them by up to max|x|^2 / min var (var >= 0.25^2)
    u = mix.velocity(x, t)
    tol = gamma(10 * 6) * max_abs(x) ** 2 / float(mix.stds.min()) ** 2 * max_abs(u)
    assert (combine(velocities, posterior) - u).abs().max() <= tol
    # top-k with k = K through the routing path is the same thing
    idx, w = routing_weights(posterior, len(CLUSTERS))
    assert (combine(velocities, dense_weights(idx, w, 3)) - u).abs().max() <= tol


def labelled_point(seed: int, n: int = 512):
    """Points x_t at times t across the path, each with a class label, on the labelled toy."""
    g = torch.Generator().manual_seed(seed)
    x = 3 * torch.randn(n, 2, dtype=torch.float64, generator=g)
    t = torch.rand(n, dtype=torch.float64, generator=g).clamp(1e-3, 1)
    y = torch.randint(0, 3, (n,), generator=g)
    return x, t, y


def branch_terms(toy: LabelledMixture, x, t, y):
    """Each expert's conditional and unconditional flow [K, B, 2] and the exact posteriors of both branches."""
    v_c = torch.stack([toy.expert_velocity(k, x, t, y) for k in range(len(toy.clusters))])
    v_u = torch.stack([toy.expert_velocity(k, x, t) for k in range(len(toy.clusters))])
    return v_c, v_u, toy.posterior(x, t, y), toy.posterior(x, t)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_guided_mixture_is_the_whole_data_sets_guided_velocity(seed):
    """DDM's decomposition per guidance branch: with exact experts and posteriors, guided_mixture equals the guided
    velocity of a model of all the data, u(x) + s (u(x | y) - u(x)), to float64 rounding; guiding inside each
    expert and mixing with the conditional posterior (w_uncond = w_cond) is another field."""
    toy, scale = LabelledMixture.default(), 3.0
    x, t, y = labelled_point(seed)
    v_c, v_u, w_c, w_u = branch_terms(toy, x, t, y)
    exact = cfg_combine(toy.velocity(x, t, y), toy.velocity(x, t), scale)  # [B, 2]
    # float64 closed forms summed per cluster vs over the components: ~10 roundings per component (6), amplified
    # by the posterior's exponent |x - mu|^2 / var (<= max|x|^2 / min var), in each of the two branches, which the
    # guidance combines with weights 1 + s and s
    branch = gamma(10 * 6) * max_abs(x) ** 2 / float(toy.mix.stds.min()) ** 2
    tol = (1 + 2 * scale) * branch * max(max_abs(v_c), max_abs(v_u))
    got = guided_mixture(v_c, v_u, w_c, w_u, scale)
    assert (got - exact).abs().max() <= tol
    # the per-expert rule misses it: by a sizeable share of the velocity at some points (not rounding)
    per_expert = guided_mixture(v_c, v_u, w_c, w_c, scale)
    assert torch.allclose(per_expert, combine(cfg_combine(v_c, v_u, scale), w_c), rtol=0, atol=tol)
    miss = (per_expert - exact).norm(dim=1) / exact.norm(dim=1).clamp_min(1e-12)
    assert miss.max() > 0.25 and (miss > 1e3 * tol).float().mean() > 0.1
    # at scale 1 (no guidance) both rules are the conditional mixture
    assert torch.allclose(guided_mixture(v_c, v_u, w_c, w_u, 1.0), combine(v_c, w_c), rtol=0, atol=tol)


def test_guided_mixture_shapes_and_sparse_weights():
    """[K, B, ...] velocities with any trailing dims and dense [B, K] weights, zeros where not selected."""
    g = torch.Generator().manual_seed(3)
    v_c, v_u = torch.randn(4, 5, 3, 2, 2, generator=g), torch.randn(4, 5, 3, 2, 2, generator=g)
    w_c = dense_weights(torch.tensor([[0, 2]] * 5), torch.full((5, 2), 0.5), 4)
    w_u = dense_weights(torch.tensor([[3]] * 5), torch.ones(5, 1), 4)
    got = guided_mixture(v_c, v_u, w_c, w_u, 2.0)
    assert got.shape == (5, 3, 2, 2)
    want = v_u[3] + 2.0 * (0.5 * v_c[0] + 0.5 * v_c[2] - v_u[3])
    torch.testing.assert_close(got, want, rtol=0, atol=gamma(8, torch.float32) * 4 * max_abs(want))


def test_tiny_dit_learns_the_toy_flow():
    """(c) a tiny DiT (2-D point = 2 channels x 1 x 1) trained a few hundred steps cuts its loss from
    the zero-velocity start most of the way down to the closed-form optimum."""
    torch.manual_seed(0)
    mix = GaussianMixture.default(torch.float32)
    exact = GaussianMixture.default()
    model = DiTModel.from_dit_config(
        DiTConfig(input_size=(1, 1), in_channels=2, patch_size=1, hidden_size=64, depth=2, num_heads=2)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.0)
    g = torch.Generator().manual_seed(0)
    losses, optimum = [], []
    for _ in range(300):
        x0, _ = mix.sample(128, generator=g)
        x0 = x0.float()[:, :, None, None]
        t = sample_t(128, generator=g)
        eps = torch.randn(x0.shape, generator=g)
        loss = flow_matching_loss(lambda x, tt: model(x, tt), x0, t, eps)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        # the same batch under the closed-form marginal velocity: the irreducible loss
        optimum.append(
            flow_matching_loss(
                lambda x, tt: exact.velocity(x.flatten(1).double(), tt).float()[:, :, None, None], x0, t, eps
            ).item()
        )
    first, end = losses[0], sum(losses[-50:]) / 50
    best = sum(optimum[-50:]) / 50
    assert first > 1.5 * best  # zero-initialised output: the loss starts at E|eps - x0|^2
    assert end - best < 0.2 * (first - best), (first, end, best)


def test_cfg_combine():
    c, u = torch.randn(3, 4), torch.randn(3, 4)
    # u + 1 (c - u) is c up to two float32 roundings, of c - u and of the sum
    tol = gamma(2, torch.float32) * (c.abs() + 2 * u.abs())
    assert ((cfg_combine(c, u, 1.0) - c).abs() <= tol).all()
    assert torch.equal(cfg_combine(c, u, 0.0), u)  # u + 0 (c - u) = u + 0: exact
    assert torch.equal(cfg_combine(c, u, 4.0), u + 4 * (c - u))  # the same arithmetic


def test_routing_weights_topk():
    probs = torch.softmax(torch.randn(8, 5), dim=1)
    idx, w = routing_weights(probs, 2)
    assert idx.shape == w.shape == (8, 2)
    # renormalised weights: a k-term sum and a division each, then summed again: gamma_{2k+1}
    assert torch.allclose(w.sum(1), torch.ones(8), rtol=0, atol=gamma(2 * 2 + 1, torch.float32))
    assert torch.equal(idx[:, 0], probs.argmax(1))
    idx1, w1 = routing_weights(probs, 1)
    assert torch.equal(idx1[:, 0], probs.argmax(1)) and torch.all(w1 == 1)
    idx_full, w_full = routing_weights(probs, 5)
    assert torch.allclose(dense_weights(idx_full, w_full, 5), probs, rtol=0, atol=gamma(2 * 5 + 1, torch.float32))
    with pytest.raises(ValueError):
        routing_weights(probs, 6)


@pytest.mark.parametrize("text, k", [("top1", 1), ("top2", 2), ("topk:3", 3), ("full", None), ("TOP1", 1)])
def test_parse_strategy(text, k):
    assert Strategy.parse(text).k == k


@pytest.mark.parametrize("text", ["top0", "topk:", "best", "topk:x", ""])
def test_parse_strategy_refuses(text):
    with pytest.raises(ValueError, match="unknown strategy"):
        Strategy.parse(text)


def test_strategy_k_above_experts_is_refused():
    with pytest.raises(ValueError, match="exceeds"):
        Strategy.parse("topk:5").resolve_k(4)
    assert Strategy.parse("full").resolve_k(4) == 4


def test_same_as_earlier_names_the_strategies_that_are_one_model():
    def same(names, k):
        return same_as_earlier([Strategy.parse(n) for n in names], k)

    assert same(["top1", "top2", "full"], 2) == {"full": "top2"}
    assert same(["top1", "top2", "full"], 4) == {}
    assert same(["full", "topk:3", "top1"], 3) == {"topk:3": "full"}
    assert same(["top1", "full"], 1) == {"full": "top1"}


def test_a_strategy_is_parsed_where_it_enters_and_travels_as_a_value():
    """The sampling settings and the distillation take a name, hold a Strategy (one parse: Strategy.parse), and
    write the name back; a call's choice is parsed once into the settings it makes."""
    from flowfleet.config import DistillConfig, SamplingConfig

    cfg = SamplingConfig(strategy="topk:3")
    assert cfg.strategy == Strategy(3, "topk:3") and str(cfg.strategy) == "topk:3"
    assert cfg.model_dump()["strategy"] == "topk:3" and '"strategy":"topk:3"' in cfg.model_dump_json()
    assert SamplingConfig.model_validate(cfg.model_dump()) == cfg
    assert SamplingConfig(strategy=cfg.strategy).strategy is cfg.strategy  # a value is taken as it is
    call = cfg.for_call(4, strategy="trajectory")
    assert call.strategy.kept and call.k == 1
    assert cfg.for_call(4).k == 3
    with pytest.raises(ValueError, match=r"unknown strategy 'top0'"):
        SamplingConfig(strategy="top0")
    assert DistillConfig(teacher="full").model_dump()["teacher"] == "full"
