"""`export diffusers`: an expert as diffusers' PixArtTransformer2DModel (same outputs), its null text as
negative prompt embeddings, diffusers' flow-matching scheduler equal to flowfleet's Euler sampler; and a
PixArt transformer imported as an expert."""

from __future__ import annotations

import json

import numpy as np
import pytest
import safetensors.torch
import torch
from diffusers.models.transformers.pixart_transformer_2d import PixArtTransformer2DModel
from diffusers.schedulers.scheduling_flow_match_euler_discrete import FlowMatchEulerDiscreteScheduler
from fixtures.random_fleet import tiny_run_config, write_random_fleet
from fixtures.tolerances import net_tol
from fixtures.transformers import tiny_pixart

from flowfleet.cli import main
from flowfleet.config import RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.flow import integrate, time_grid
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import load_model
from flowfleet.models.pixart import from_pixart, pixart_config
from flowfleet.stages.assemble import assemble
from flowfleet.stages.export import export_diffusers

pytestmark = pytest.mark.usefixtures("one_thread")

PIXART_LIKE = {"adaln": "single", "cross_norm": False, "add_pooled": False, "depth": 2}


def parity_tol(ref: torch.Tensor, steps: int = 1) -> float:
    """Our DiT and diffusers' PixArt compute the same sums in other orders: the longest reduction is the
    caption projection (384 wide), through 2 blocks of ~4 roundings each plus the embeddings and the final
    layer (~10), for each sampler step."""
    return net_tol(ref, reduction=384, layers=10, steps=steps)


def inputs(b: int = 3, channels: int = 1, length: int = 4, width: int = 384):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(b, channels, 8, 8, generator=g)
    t = torch.rand(b, generator=g)
    tokens = torch.randn(b, length, width, generator=g)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]).bool()[:b]
    return x, t, tokens, mask


def assert_same_outputs(expert, pixart) -> None:
    """Our expert and a diffusers PixArt transformer give the same velocity on the same inputs (parity_tol)."""
    x, t, tokens, mask = inputs()
    with torch.no_grad():
        ours = expert(x, t, text_tokens=tokens, text_mask=mask)
        theirs = pixart(
            x, encoder_hidden_states=tokens, encoder_attention_mask=mask.float(), timestep=1000 * t, return_dict=False
        )[0]
    assert (ours - theirs).abs().max().item() <= parity_tol(theirs)


@pytest.fixture
def fleet(run_root):
    raw = tiny_run_config(2, conditioning="cross_attn").model_dump()
    raw["expert"] = {**raw["expert"], **PIXART_LIKE}
    write_random_fleet(str(run_root), RunConfig(**raw), std=0.2)
    assemble(str(run_root))
    return run_root


def test_an_exported_expert_is_a_pixart_transformer_with_the_same_outputs(fleet, tmp_path):
    out = tmp_path / "pixart"
    assert main(["export", "diffusers", str(fleet / "model"), str(out), "--expert", "1"]) == 0
    expert = load_model(DiTExpert, str(fleet / "model"), "expert_1")
    transformer = PixArtTransformer2DModel.from_pretrained(str(out / "transformer")).eval()
    assert_same_outputs(expert, transformer)
    # the expert's null text is diffusers' negative prompt: the unconditional branch of CFG
    null = safetensors.torch.load_file(str(out / "negative_prompt_embeds.safetensors"))
    x, t, tokens, mask = inputs()
    with torch.no_grad():
        ours_null = expert(x, t, text_tokens=tokens, text_mask=mask, drop=torch.ones(3, dtype=torch.bool))
        theirs_null = transformer(
            x,
            encoder_hidden_states=null["prompt_embeds"].expand(3, -1, -1),
            encoder_attention_mask=null["prompt_attention_mask"].expand(3, -1),
            timestep=1000 * t,
            return_dict=False,
        )[0]
    assert (ours_null - theirs_null).abs().max().item() <= parity_tol(theirs_null)
    assert json.loads((out / "text_encoder.json").read_text())["name"] == "minilm"
    assert "FlowMatchEulerDiscreteScheduler" in (out / "README.md").read_text()


def test_diffusers_flow_match_scheduler_equals_flowfleets_euler_sampler(fleet, tmp_path):
    export_diffusers(str(fleet / "model"), 0, str(tmp_path / "pixart"))
    expert = load_model(DiTExpert, str(fleet / "model"), "expert_0")
    transformer = PixArtTransformer2DModel.from_pretrained(str(tmp_path / "pixart" / "transformer")).eval()
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(tmp_path / "pixart" / "scheduler"))
    noise, _, tokens, mask = inputs()
    steps = 20
    with torch.no_grad():
        ours = integrate(
            lambda x, t, _: expert(x, t, text_tokens=tokens, text_mask=mask), noise, time_grid(steps), "euler"
        )
        scheduler.set_timesteps(sigmas=np.linspace(1.0, 0.0, steps + 1)[:-1])
        x = noise.clone()
        for step in scheduler.timesteps:
            v = transformer(
                x,
                encoder_hidden_states=tokens,
                encoder_attention_mask=mask.float(),
                timestep=step.expand(3),
                return_dict=False,
            )[0]
            x = scheduler.step(v, step, x).prev_sample
    assert (ours - x).abs().max().item() <= parity_tol(x, steps)


def test_an_expert_that_is_no_pixart_transformer_is_refused_naming_the_field(run_root, tmp_path, capsys):
    write_random_fleet(str(run_root), tiny_run_config(2, conditioning="cross_attn"))  # adaLN-Zero, cross norm
    assemble(str(run_root))
    assert main(["export", "diffusers", str(run_root / "model"), str(tmp_path / "x"), "--expert", "0"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "flowfleet export: error: expert: adaln is 'zero'; PixArtTransformer2DModel needs 'single' "
        "(train the expert with adaln: single to export it)"
    )
    cfg = DiTConfig(**{**tiny_run_config(2).expert.model_dump(), **PIXART_LIKE, "cross_norm": True})
    with pytest.raises(FlowfleetError, match="cross_norm is True; PixArtTransformer2DModel needs False"):
        pixart_config(cfg)
    exact_gelu = DiTConfig(**{**tiny_run_config(2).expert.model_dump(), **PIXART_LIKE, "mlp_act": "gelu"})
    with pytest.raises(FlowfleetError, match="mlp_act is 'gelu'; PixArtTransformer2DModel needs 'gelu_tanh'"):
        pixart_config(exact_gelu)


def random_pixart(folder) -> PixArtTransformer2DModel:
    """A tiny PixArt transformer with every tensor random, saved in `folder`."""
    pixart = tiny_pixart(size=8, channels=1, caption_channels=384)
    with torch.no_grad():
        for p in pixart.parameters():
            p.normal_(0, 0.2)  # (PixArt zero-initialises some tensors: make every one matter)
    pixart.save_pretrained(str(folder))
    return pixart


def test_a_pixart_transformer_imports_as_an_expert_with_the_same_outputs(tmp_path):
    pixart = random_pixart(tmp_path / "pixart")
    config = json.loads((tmp_path / "pixart" / "config.json").read_text())
    fields, state = from_pixart(
        config, safetensors.torch.load_file(str(next((tmp_path / "pixart").glob("*.safetensors")))), 4
    )
    expert = DiTExpert.from_dit_config(DiTConfig(**fields)).eval()
    missing, unexpected = expert.load_state_dict(state, strict=False)
    assert missing == ["text_projector.null"] and unexpected == []  # PixArt has no learned null text
    assert_same_outputs(expert, pixart)


def test_experts_start_from_a_pixart_folder_named_by_expert_init(run_root, tmp_path):
    """run.yaml expert_init: every expert's job starts from the pretrained transformer (fine-tuning)."""
    from fixtures.synthetic_run import write_synthetic_run

    from flowfleet.storage import RunRoot
    from flowfleet.train.specs import JobSpec
    from flowfleet.train.tasks import build_task

    pixart = random_pixart(tmp_path / "pixart")
    raw = tiny_run_config(2, conditioning="cross_attn").model_dump()
    raw["expert"] = {**raw["expert"], **PIXART_LIKE, "hidden_size": 32, "num_heads": 2}
    raw["expert_init"] = str(tmp_path / "pixart")
    cfg = RunConfig(**raw)
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg)
    model = build_task(root, cfg, JobSpec("expert", 1)).build_model().eval()
    assert_same_outputs(model, pixart)
    wrong = RunConfig(**{**raw, "expert": {**raw["expert"], "depth": 1}})
    with pytest.raises(FlowfleetError, match=r"expert_init .*pixart: depth is 2, run.yaml expert.depth is 1"):
        build_task(root, wrong, JobSpec("expert", 1)).build_model()
