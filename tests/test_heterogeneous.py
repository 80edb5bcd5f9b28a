"""DDPM (noise-predicting) experts beside flow-matching ones (flowfleet.flow.path, docs/heterogeneous-experts.md):
the conversion of an exact noise predictor is the exact flow-matching velocity of the toy mixture (closed form) on
both schedules; a fleet mixing exact noise and velocity experts is the marginal flow under the full ensemble; a
ddpm DiT takes flowfleet's (x_t, t) on every path (its forward, the step cache); a fleet with a ddpm expert
trains, assembles, records each expert's objective, generates with every strategy, guidance and the cache, serves
and distils (its two-rank path: test_parallel_dit); inconsistent settings are one-line errors."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.random_fleet import HashTextEncoder
from fixtures.synthetic_run import synthetic_config, write_synthetic_run
from fixtures.tolerances import gamma, max_abs, net_tol
from fixtures.toy import GaussianMixture, cluster_posterior
from test_flow import CLUSTERS

from flowfleet.config import ConfigError, RunConfig
from flowfleet.flow import combine
from flowfleet.flow.path import (
    VP_MIN_LOG_SNR,
    VP_STEPS,
    velocity_from_eps,
    vp_input_scale,
    vp_log_snr,
    vp_log_snr_at,
    vp_log_snr_bounds,
    vp_timestep,
)
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTModel
from flowfleet.sampling.cache import BlockCache
from flowfleet.storage import RunRoot

SCHEDULES = ("linear", "cosine")


def t_range(table: torch.Tensor) -> tuple[float, float]:
    """The flow-matching times whose SNR the conversion spans (the schedule's steps, down to VP_MIN_LOG_SNR):
    t = sigmoid(-log SNR / 2)."""
    lo, hi = vp_log_snr_bounds(table)
    ends = torch.tensor([-hi / 2, -lo / 2], dtype=torch.float64)
    return float(torch.sigmoid(ends[0])), float(torch.sigmoid(ends[1]))


def exact_noise_expert(mix: GaussianMixture, table: torch.Tensor):
    """An exact DDPM noise predictor of `mix` in its own coordinates: (x_vp, tau) -> E[eps | x_vp], where x_vp
    is the VP state at step tau (abar from the schedule, between steps as flowfleet interpolates it)."""

    def eps(x_vp: torch.Tensor, tau: torch.Tensor) -> torch.Tensor:
        t = torch.sigmoid(-vp_log_snr_at(tau, table) / 2)  # the flow-matching time of that SNR
        return mix.noise_prediction(x_vp / vp_input_scale(t)[:, None], t)

    return eps


def as_velocity(eps_expert, table: torch.Tensor):
    """A noise expert queried the way a ddpm DiT is (network_input, output_velocity): (x_t, t) -> velocity."""

    def v(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return velocity_from_eps(eps_expert(x * vp_input_scale(t)[:, None], vp_timestep(t, table)), x, t, table)

    return v


def conversion_tol(mix: GaussianMixture, x: torch.Tensor, u: torch.Tensor, table: torch.Tensor) -> float:
    """The toy's float64 posterior (~10 roundings per component, amplified by max|x|^2 / min var, as in
    test_flow's decomposition test) passed through x0 = (x_vp - sigma eps) / alpha: up to 1 / alpha_min more."""
    alpha_min = float(torch.sigmoid(torch.tensor(vp_log_snr_bounds(table)[0], dtype=torch.float64)).sqrt())
    return gamma(10 * 6) * max_abs(x) ** 2 / float(mix.stds.min()) ** 2 * max_abs(u) / alpha_min


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_an_exact_noise_predictor_is_the_exact_flow_matching_velocity(schedule):
    mix, table = GaussianMixture.default(), vp_log_snr(schedule)
    lo, hi = t_range(table)
    g = torch.Generator().manual_seed(0)
    t = torch.cat(
        [torch.tensor([lo, hi], dtype=torch.float64), lo + (hi - lo) * torch.rand(2046, generator=g).double()]
    )
    x = 3 * torch.randn(2048, 2, dtype=torch.float64, generator=g)
    u = mix.velocity(x, t)
    v = as_velocity(exact_noise_expert(mix, table), table)(x, t)
    assert (v - u).abs().max() <= conversion_tol(mix, x, u, table)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_vp_timestep_and_the_schedule_are_inverses(schedule):
    table = vp_log_snr(schedule)
    assert len(table) == VP_STEPS and bool((table[1:] < table[:-1]).all())  # decreasing: noisier with each step
    # the steps the conversion queries: all of the linear schedule's, the cosine's up to VP_MIN_LOG_SNR's (994.x)
    last = float(vp_timestep(torch.ones(1, dtype=torch.float64), table))  # where t = 1 (pure noise) is queried
    assert last == {"linear": 999.0, "cosine": pytest.approx(994.92, abs=0.01)}[schedule]
    lam = vp_log_snr_at(torch.tensor([last], dtype=torch.float64), table)
    assert float(lam) == pytest.approx(max(float(table[-1]), VP_MIN_LOG_SNR), abs=1e-9)
    steps = torch.arange(int(last) + 1, dtype=torch.float64)
    tau = torch.cat([steps, torch.tensor([last], dtype=torch.float64), torch.rand(500, dtype=torch.float64) * last])
    t = torch.sigmoid(-vp_log_snr_at(tau, table) / 2)
    # tau -> log SNR -> t -> log SNR -> tau: a handful of float64 roundings, relative to the steps' size
    torch.testing.assert_close(vp_timestep(t, table), tau, rtol=0, atol=gamma(16) * 1e3 * VP_STEPS)
    # beyond the conversion's range: the schedule's first step, and the step of VP_MIN_LOG_SNR (the linear
    # schedule's last; the cosine's 995th of 1000), and a finite velocity (x0 at the clamped SNR)
    ends = torch.tensor([0.0, 1e-9, 1 - 1e-9, 1.0], dtype=torch.float64)
    assert vp_timestep(ends, table).tolist() == [0.0, 0.0, last, last]
    assert velocity_from_eps(torch.randn(4, 2), torch.randn(4, 2), ends.float(), table).isfinite().all()


def test_the_least_snr_is_the_linear_schedules_last_step():
    assert VP_MIN_LOG_SNR == pytest.approx(float(vp_log_snr("linear")[-1]), abs=1e-4)


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_noise_error_at_the_noisy_end_is_amplified_no_more_than_at_the_least_snr(schedule):
    """x0 = (x_vp - sigma eps) / alpha: an error d in the noise is an error sigma / alpha * d in x0. At the
    cosine schedule's last step that factor is 2e4 (its log SNR -19.8); the conversion never goes below
    VP_MIN_LOG_SNR, where it is exp(-VP_MIN_LOG_SNR / 2) = 157."""
    table = vp_log_snr(schedule)
    g = torch.Generator().manual_seed(0)
    x, eps, err = (torch.randn(64, 4, generator=g, dtype=torch.float64) for _ in range(3))
    least = vp_log_snr_bounds(table)[0]  # the linear schedule's own last step; the cosine's: VP_MIN_LOG_SNR
    assert least == pytest.approx(VP_MIN_LOG_SNR, abs=1e-4)
    bound = torch.exp(torch.tensor(-least / 2, dtype=torch.float64))  # sigma / alpha there: 157
    for t in (0.995, 0.9999, 1.0):
        tt = torch.full((64,), t, dtype=torch.float64)
        dv = velocity_from_eps(eps + 1e-3 * err, x, tt, table) - velocity_from_eps(eps, x, tt, table)
        gain = dv.abs().max() / (1e-3 * err).abs().max()
        # v = (x_t - x0) / t: the error sigma / alpha * d / t; the floor binds for every t beyond 0.9937
        assert float(gain) == pytest.approx(float(bound) / t, rel=1e-6), t


def test_a_mixed_fleet_under_the_full_ensemble_is_the_marginal_flow():
    """Cluster 0 a flow-matching expert, 1 and 2 noise experts on the linear and the cosine schedule, each exact
    for its cluster's data; the exact router's weights over all three: the mixture's marginal velocity."""
    mix = GaussianMixture.default()
    tables = {1: vp_log_snr("linear"), 2: vp_log_snr("cosine")}
    experts = {0: mix.subset(CLUSTERS[0]).velocity}
    for k, table in tables.items():
        experts[k] = as_velocity(exact_noise_expert(mix.subset(CLUSTERS[k]), table), table)
    lo = max(t_range(table)[0] for table in tables.values())
    hi = min(t_range(table)[1] for table in tables.values())
    g = torch.Generator().manual_seed(1)
    x = 3 * torch.randn(512, 2, dtype=torch.float64, generator=g)
    t = lo + (hi - lo) * torch.rand(512, dtype=torch.float64, generator=g)
    velocities = torch.stack([experts[k](x, t) for k in range(3)])  # [K, B, 2]
    u = mix.velocity(x, t)
    got = combine(velocities, cluster_posterior(mix, CLUSTERS, x, t))
    assert (got - u).abs().max() <= conversion_tol(mix, x, u, tables[2])


# --------------------------------------------------------------------------------------------------
#                                     A ddpm DiT on every path
# --------------------------------------------------------------------------------------------------

TINY = dict(input_size=(8, 8), in_channels=2, patch_size=2, hidden_size=32, depth=2, num_heads=2)


@pytest.mark.parametrize("out_channels", [None, 4])  # 4: a learned-sigma head (DiT's checkpoints), half ignored
def test_a_ddpm_dit_takes_flowfleet_time_and_returns_the_velocity(out_channels):
    torch.manual_seed(0)
    model = DiTModel(**TINY, out_channels=out_channels, objective="ddpm", schedule="linear").eval()
    for p in model.parameters():  # adaLN-Zero starts every output at zero: give the network something to say
        p.data.normal_(0, 0.1)
    x, t = torch.randn(5, 2, 8, 8), torch.tensor([0.0, 0.2, 0.5, 0.9, 1.0])
    with torch.no_grad():
        got = model(x, t)
        x_vp = x * vp_input_scale(t.double()).float()[:, None, None, None]
        eps = model.network(x_vp, vp_timestep(t, model.vp_table).float())[:, :2]
        want = velocity_from_eps(eps, x, t, model.vp_table)
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same operations in the same order
        # the first-block step cache with nothing skipped is the forward, for a ddpm expert as for any
        cache = BlockCache(threshold=0.0, rows=5)
        torch.testing.assert_close(cache.bind(0, model, torch.arange(5))(x, t), got, rtol=0, atol=0)
    assert got.shape == x.shape and got.isfinite().all()


def test_inconsistent_objectives_are_one_line_errors(tmp_path):
    with pytest.raises(ValueError, match="schedule: a ddpm model needs its VP schedule"):
        DiTConfig(**TINY, objective="ddpm")
    with pytest.raises(ValueError, match="schedule"):
        DiTConfig(**TINY, objective="ddpm", schedule="quadratic")
    with pytest.raises(ValueError, match="schedule: 'linear' is for a ddpm model"):
        DiTConfig(**TINY, schedule="linear")
    raw = synthetic_config().to_dict()
    raw["expert_overrides"] = {1: {"objective": "ddpm", "schedule": "quadratic"}}
    with pytest.raises(ConfigError, match=r"^[^\n]*schedule[^\n]*$"):
        RunConfig.from_dict(raw, where="run.yaml")
    # experts' steps split by cluster size (one budget of FLOPs): another objective keeps the FLOPs, another width not
    raw["train"]["expert_steps"] = "by_size"
    raw["expert_overrides"] = {1: {"objective": "ddpm", "schedule": "linear"}}
    assert RunConfig.from_dict(raw, where="run.yaml").expert_config(1).objective == "ddpm"
    raw["expert_overrides"] = {1: {"hidden_size": 64}}
    with pytest.raises(
        ConfigError, match="train.expert_steps: by_size splits the steps of experts of one architecture"
    ):
        RunConfig.from_dict(raw, where="run.yaml")


# --------------------------------------------------------------------------------------------------
#                                      A mixed fleet end to end
# --------------------------------------------------------------------------------------------------


def png_bytes(image) -> bytes:
    import io

    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def test_a_fleet_with_a_ddpm_expert_trains_assembles_and_generates(tmp_path):
    from flowfleet.models.files import ModelFileError
    from flowfleet.sampling.pipeline import FleetPipeline
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.train import train_all

    cfg = synthetic_config(k=2, steps=12)
    raw = cfg.to_dict()
    raw["expert_overrides"] = {1: {"objective": "ddpm", "schedule": "cosine"}}
    cfg = RunConfig.from_dict(raw, where="test")
    root = RunRoot(str(tmp_path / "run"))
    write_synthetic_run(root, cfg)
    train_all(root.url, parallel=1, progress=False)
    losses = [json.loads(line)["loss"] for line in (tmp_path / "run/experts/1/metrics.jsonl").read_text().splitlines()]
    assert all(0 < loss < 10 for loss in losses)  # the noise regression (its target has unit variance)
    model = assemble(root.url).out
    recorded = {k: json.loads((tmp_path / f"run/model/expert_{k}/config.json").read_text()) for k in (0, 1)}
    assert (recorded[0]["objective"], recorded[0]["schedule"]) == ("fm", None)
    assert (recorded[1]["objective"], recorded[1]["schedule"]) == ("ddpm", "cosine")
    text = HashTextEncoder(cfg.encoders.text.width, cfg.encoders.text.max_length)
    pipe = FleetPipeline.from_pretrained(model, text_encoder=text)
    prompts = ["item 0 of cluster 0", "item 1 of cluster 1"]
    for strategy in ("top1", "top2", "full"):
        for cache in (0.0, 0.2):
            settings = pipe.settings(strategy, guidance_scale=2.0, cache=cache, seed=0)
            out = pipe(prompts, 4, settings=settings)
            assert out.images.shape[0] == 4 and out.images.isfinite().all(), (strategy, cache)
    # served: the same images as the pipeline for a seed
    import base64

    import httpx
    from fixtures.servers import app_in_thread

    from flowfleet.sampling.card import read_card
    from flowfleet.sampling.views import to_pil
    from flowfleet.serve.app import create_app
    from flowfleet.serve.service import FleetService, ServeLimits

    svc = FleetService(FleetPipeline.from_pretrained(model, text_encoder=text), read_card(model), ServeLimits())
    body = {"prompt": prompts[1], "strategy": "full", "steps": 3, "guidance_scale": 2.0, "seed": 5, "n": 2}
    with app_in_thread(create_app(svc, model, ui=False)) as url:
        served = httpx.post(f"{url}/api/generate", json=body, timeout=60).json()["images"]
    ref = pipe([prompts[1]], 2, strategy="full", steps=3, guidance_scale=2.0, seed=5)
    assert [base64.b64decode(im) for im in served] == [png_bytes(im) for im in to_pil(ref.images)]
    # distilled: a student learns the mixed fleet's velocities (the teacher converts the ddpm expert's noise)
    from flowfleet.stages.distill import distill

    student = distill(root.url, teacher="full", steps=4, progress=False).model
    assert json.loads((tmp_path / "run/student/status.json").read_text())["state"] == "done"
    assert FleetPipeline.from_pretrained(student, text_encoder=text)(prompts, 2).images.isfinite().all()
    # a model folder whose ddpm expert lost its schedule: one line naming the file
    path = tmp_path / "run/model/expert_1/config.json"
    path.write_text(json.dumps({**recorded[1], "schedule": None}))
    with pytest.raises(ModelFileError, match=r"expert_1/config.json: schedule: a ddpm model needs its VP schedule"):
        FleetPipeline.from_pretrained(model, text_encoder=text)


# --------------------------------------------------------------------------------------------------
#                          The DiT reference model's checkpoints as starting points
# --------------------------------------------------------------------------------------------------

REF = dict(input_size=8, patch=2, channels=4, hidden=32, depth=2, heads=2, classes=10)  # learn_sigma: 2C outputs


def reference_state_dict(seed: int = 0) -> dict[str, torch.Tensor]:
    """A DiT_models state dict in the reference's layout (facebookresearch/DiT models.py names and shapes, the
    fixed sin-cos pos_embed saved with it), random weights."""
    from flowfleet.models.embeddings import sincos_2d

    g = torch.Generator().manual_seed(seed)
    d, p, c, n = REF["hidden"], REF["patch"], REF["channels"], REF["input_size"] // REF["patch"]

    def w(*shape):
        return 0.2 * torch.randn(*shape, generator=g)

    sd = {
        "pos_embed": sincos_2d(d, n, n)[None],
        "x_embedder.proj.weight": w(d, c, p, p),
        "x_embedder.proj.bias": w(d),
        "t_embedder.mlp.0.weight": w(d, 256),
        "t_embedder.mlp.0.bias": w(d),
        "t_embedder.mlp.2.weight": w(d, d),
        "t_embedder.mlp.2.bias": w(d),
        "y_embedder.embedding_table.weight": w(REF["classes"] + 1, d),
        "final_layer.linear.weight": w(p * p * 2 * c, d),
        "final_layer.linear.bias": w(p * p * 2 * c),
        "final_layer.adaLN_modulation.1.weight": w(2 * d, d),
        "final_layer.adaLN_modulation.1.bias": w(2 * d),
    }
    for i in range(REF["depth"]):
        for name, shape in {
            "attn.qkv": (3 * d, d),
            "attn.proj": (d, d),
            "mlp.fc1": (4 * d, d),
            "mlp.fc2": (d, 4 * d),
            "adaLN_modulation.1": (6 * d, d),
        }.items():
            sd[f"blocks.{i}.{name}.weight"], sd[f"blocks.{i}.{name}.bias"] = w(*shape), w(shape[0])
    return sd


def reference_forward(sd: dict[str, torch.Tensor], x: torch.Tensor, tau: torch.Tensor, y: torch.Tensor):
    """DiT's forward (Peebles & Xie, §3.2: patchify, sin-cos positions, adaLN-Zero blocks, the final layer), written
    here from the paper's equations over the reference layout's weights: [B, 2C, H, W] (noise, sigma)."""
    import math

    import torch.nn.functional as F

    d, p, heads = REF["hidden"], REF["patch"], REF["heads"]
    lin = lambda v, name: F.linear(v, sd[f"{name}.weight"], sd[f"{name}.bias"])  # noqa: E731
    norm = lambda v: F.layer_norm(v, (d,), eps=1e-6)  # noqa: E731 - no affine parameters (adaLN supplies them)
    mod = lambda v, shift, scale: v * (1 + scale[:, None]) + shift[:, None]  # noqa: E731
    h = F.conv2d(x, sd["x_embedder.proj.weight"], sd["x_embedder.proj.bias"], stride=p).flatten(2).transpose(1, 2)
    h = h + sd["pos_embed"]
    half = 128
    freqs = torch.exp(-math.log(10000) * torch.arange(half) / half)
    args = tau[:, None].float() * freqs[None]
    temb = torch.cat([torch.cos(args), torch.sin(args)], -1)
    c = lin(F.silu(lin(temb, "t_embedder.mlp.0")), "t_embedder.mlp.2") + sd["y_embedder.embedding_table.weight"][y]
    b, n, _ = h.shape
    for i in range(REF["depth"]):
        s_msa, sc_msa, g_msa, s_mlp, sc_mlp, g_mlp = lin(F.silu(c), f"blocks.{i}.adaLN_modulation.1").chunk(6, 1)
        q, k, v = lin(mod(norm(h), s_msa, sc_msa), f"blocks.{i}.attn.qkv").reshape(b, n, 3, heads, -1).unbind(2)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        h = h + g_msa[:, None] * lin(att.transpose(1, 2).reshape(b, n, d), f"blocks.{i}.attn.proj")
        mlp = lin(
            F.gelu(lin(mod(norm(h), s_mlp, sc_mlp), f"blocks.{i}.mlp.fc1"), approximate="tanh"), f"blocks.{i}.mlp.fc2"
        )
        h = h + g_mlp[:, None] * mlp
    shift, scale = lin(F.silu(c), "final_layer.adaLN_modulation.1").chunk(2, 1)
    out = lin(mod(norm(h), shift, scale), "final_layer.linear")  # [B, N, p*p*2C]
    g_, ch = int(n**0.5), 2 * REF["channels"]
    out = out.reshape(b, g_, g_, p, p, ch).permute(0, 5, 1, 3, 2, 4)  # DiT's unpatchify: (h, w, p, q, c)
    return out.reshape(b, ch, g_ * p, g_ * p)


@pytest.mark.parametrize("objective", ["ddpm", "fm"])
def test_a_dit_reference_checkpoint_starts_an_expert_of_either_objective(tmp_path, objective):
    """As is for a ddpm expert (the noise and sigma halves), its noise half for a flow-matching one (the start of
    its fine-tuning); the same outputs as the reference forward for the same weights."""
    import safetensors.torch

    from flowfleet.models.init import load_expert_init

    sd = reference_state_dict()
    path = tmp_path / "DiT-tiny.safetensors"
    safetensors.torch.save_file(sd, str(path))
    ddpm = {"objective": "ddpm", "schedule": "linear", "out_channels": 8} if objective == "ddpm" else {}
    cfg = DiTConfig(**{**TINY, "in_channels": 4}, conditioning="class", num_classes=10, **ddpm)
    model = DiTModel.from_dit_config(cfg).eval()
    load_expert_init(model, cfg, str(path))
    g = torch.Generator().manual_seed(1)
    x, tau, y = torch.randn(3, 4, 8, 8, generator=g), torch.tensor([0.0, 250.0, 999.0]), torch.tensor([1, 4, 9])
    with torch.no_grad():
        want = reference_forward(sd, x, tau, y)
        got = model.network(x, tau, labels=y)
    want = want if objective == "ddpm" else want[:, :4]
    # two implementations of one network: ~4 roundings per layer over the MLP's 128-term sums, 2 blocks + embeddings
    torch.testing.assert_close(got, want, rtol=0, atol=net_tol(want, 4 * 32, 8))
    # a text expert takes everything but the label table
    text = DiTConfig(**{**cfg.model_dump(), "conditioning": "pooled", "num_classes": 0, "text_dim": 8})
    load_expert_init(DiTModel.from_dit_config(text), text, str(path))


def test_a_dit_checkpoint_that_does_not_fit_is_one_line(tmp_path):
    import safetensors.torch

    from flowfleet.errors import FlowfleetError
    from flowfleet.models.init import load_expert_init

    cfg = DiTConfig(**{**TINY, "in_channels": 4})
    sd = reference_state_dict()

    def save(name: str, state: dict[str, torch.Tensor]) -> str:
        safetensors.torch.save_file(state, str(tmp_path / name))
        return str(tmp_path / name)

    short = save("short.safetensors", {k: v for k, v in sd.items() if k != "blocks.1.mlp.fc2.bias"})
    with pytest.raises(FlowfleetError, match=r"short.safetensors: no blocks.1.mlp.fc2.bias in the checkpoint$"):
        load_expert_init(DiTModel.from_dit_config(cfg), cfg, short)
    wide = DiTConfig(**{**cfg.model_dump(), "hidden_size": 64})
    with pytest.raises(FlowfleetError, match="narrow.safetensors: pos_embed is not the expert's 4 x 4 sin-cos table"):
        load_expert_init(DiTModel.from_dit_config(wide), wide, save("narrow.safetensors", sd))
    (tmp_path / "junk.safetensors").write_bytes(b"not a checkpoint")
    with pytest.raises(FlowfleetError, match=r"junk.safetensors: not a readable DiT checkpoint \(.*\)$"):
        load_expert_init(DiTModel.from_dit_config(cfg), cfg, str(tmp_path / "junk.safetensors"))
    # DiT's own .pt files are pickles: refused, never opened, pointing at the conversion
    (tmp_path / "DiT.pt").write_bytes(b"\x80\x04 anything")
    with pytest.raises(FlowfleetError, match=r"DiT.pt: a pickle, which flowfleet does not load; convert it .*docs/"):
        load_expert_init(DiTModel.from_dit_config(cfg), cfg, str(tmp_path / "DiT.pt"))
