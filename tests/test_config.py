"""run.yaml: presets validate and round-trip; bad keys and impossible values name the key."""

from __future__ import annotations

import pytest
import yaml

from flowfleet.config import ConfigError, RunConfig, load_run_config
from flowfleet.presets import PRESETS, preset
from flowfleet.stages.init import init_run
from flowfleet.storage import RunRoot


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_presets_validate_and_round_trip(name, tmp_path):
    init_run(str(tmp_path / name), name)
    cfg = load_run_config(RunRoot(tmp_path / name))
    assert cfg == preset(name, name=name)
    assert cfg.router.num_outputs == cfg.cluster.k


def test_paris_presets_follow_the_paper():
    b2, xl2 = preset("paris-b2"), preset("paris-xl2")
    assert (b2.expert.hidden_size, b2.expert.depth, b2.expert.num_heads, b2.expert.patch_size) == (768, 12, 12, 2)
    assert (b2.router.hidden_size, b2.router.depth) == (384, 12)  # DiT-S router
    assert (xl2.expert.hidden_size, xl2.expert.depth, xl2.expert.num_heads) == (1152, 28, 16)
    assert xl2.router.hidden_size == 768  # DiT-B router
    for cfg in (b2, xl2):
        assert cfg.latent_shape == (4, 32, 32)
        assert cfg.encoders.latent.name == "sd-vae-ft-mse" and cfg.encoders.text.name == "clip"
        assert cfg.expert.text_dim == 768 and cfg.train.lr == 1e-4 and cfg.train.ema_decay == 0.9999
        assert cfg.train.batch_size == 256 and cfg.train.grad_accum > 1 and cfg.cluster.k == 8


def _with(change) -> dict:
    raw = preset("mnist").to_dict()
    change(raw)
    return raw


@pytest.mark.parametrize(
    "change, key",
    [
        (lambda r: r["train"].update(bogus=1), "train.bogus: unknown key"),
        (lambda r: r.update(extra=1), "extra: unknown key"),
        (lambda r: r["train"].update(lr=-1), "train.lr"),
        (lambda r: r["train"].update(loss_weighting="snr"), "train.loss_weighting"),
        (lambda r: r["train"].update(min_snr_gamma=0), "train.min_snr_gamma"),
        (lambda r: r["train"].update(time_std=0), "train.time_std"),
        (lambda r: r["train"].update(batch_size=10, grad_accum=3), "train.batch_size"),
        (lambda r: r["expert"].update(hidden_size=130), "expert.hidden_size"),
        (lambda r: r["cluster"].update(k=5), "router.num_outputs"),
        (lambda r: r["expert"].update(text_dim=768), "expert.text_dim"),
        (lambda r: r["expert"].update(input_size=[16, 16]), "expert.input_size"),
        (lambda r: r["data"].update(source="folder"), "data.path"),
        (lambda r: r["data"].update(source="imagenet"), "data.source"),
    ],
)
def test_bad_config_names_the_key(change, key):
    with pytest.raises(ConfigError) as err:
        RunConfig.from_dict(_with(change), "run.yaml")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"run.yaml: {key}"), msg


def test_load_run_config_errors(tmp_path):
    root = RunRoot(tmp_path)
    with pytest.raises(ConfigError, match="missing"):
        load_run_config(root)
    (tmp_path / "run.yaml").write_text("data: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_run_config(root)
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_with(lambda r: r["sampling"].update(steps=0))))
    with pytest.raises(ConfigError, match="sampling.steps"):
        load_run_config(root)


def test_init_on_an_fsspec_url():
    init_run("memory://flowfleet-cfg/run", "mnist-tiny")
    cfg = load_run_config(RunRoot("memory://flowfleet-cfg/run"))
    assert cfg.data.source == "mnist" and cfg.cluster.k == 3


def test_a_run_yaml_written_before_guidance_scale_loads_and_is_written_back_with_it():
    """sampling.cfg / cfg_max_t and distill.cfg, as older run.yaml and model_index.json files say them, load into
    guidance_scale / guidance_max_t; the config then writes the new names only."""
    from flowfleet.config import SamplingConfig

    raw = preset("mnist").to_dict()
    raw["sampling"] = {k: v for k, v in raw["sampling"].items() if k not in ("guidance_scale", "guidance_max_t")}
    raw["sampling"].update(cfg=2.5, cfg_max_t=0.7)
    raw["distill"] = {"cfg": 1.5}
    cfg = RunConfig.from_dict(raw, "run.yaml")
    assert (cfg.sampling.guidance_scale, cfg.sampling.guidance_max_t, cfg.distill.guidance_scale) == (2.5, 0.7, 1.5)
    dumped = cfg.to_dict()
    assert "cfg" not in dumped["sampling"] and dumped["sampling"]["guidance_scale"] == 2.5
    assert SamplingConfig.model_validate({"cfg": 3.0}) == SamplingConfig(guidance_scale=3.0)


def test_sampling_settings_describe_a_scale_as_its_shortest_decimal():
    """A scale the guidance sweep extends to (1.6 * 1.6 / 2) is logged as 1.28, not 1.2800000000000002."""
    from flowfleet.config import SamplingConfig

    past_an_edge = SamplingConfig(guidance_scale=1.6 * 1.6 / 2.0, guidance_max_t=0.78, steps=20)
    assert past_an_edge.guidance_scale != 1.28  # (the float itself is kept: the scale sampled is the one computed)
    assert past_an_edge.describe() == "20 euler steps, guidance 1.28 at t <= 0.78"
    assert SamplingConfig(guidance_scale=10.125).describe() == "30 euler steps, guidance 10.125"


def test_the_configs_load_without_diffusers():
    """run.yaml's sections and their validation import neither diffusers nor the models (the command line's --help
    and every config check stay light): a fresh interpreter importing flowfleet.config and the presets has not
    imported diffusers."""
    import subprocess
    import sys

    code = "import sys, flowfleet.config, flowfleet.presets; print('diffusers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
