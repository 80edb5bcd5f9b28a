"""Model folders: diffusers layout, exact round trips, refusal of corrupted or mismatched files."""

from __future__ import annotations

import json

import pytest
import torch

from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert, DiTRouter
from flowfleet.models.files import WEIGHTS_NAME, ModelFileError, load_model, read_dit_config, save_model


def _expert() -> DiTExpert:
    cfg = DiTConfig(
        size="tiny/2",
        input_size=(8, 8),
        in_channels=1,
        conditioning="cross_attn",
        text_dim=12,
        text_len=4,
        add_pooled=True,
        adaln="single",
    )
    model = DiTExpert.from_dit_config(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model.eval()


def _inputs():
    g = torch.Generator().manual_seed(1)
    return (torch.randn(2, 1, 8, 8, generator=g), torch.rand(2, generator=g)), dict(
        text_tokens=torch.randn(2, 4, 12, generator=g), text_pooled=torch.randn(2, 12, generator=g)
    )


def test_round_trip_gives_identical_outputs(tmp_path):
    model = _expert()
    save_model(model, tmp_path / "expert")
    assert sorted(p.name for p in (tmp_path / "expert").iterdir()) == ["config.json", WEIGHTS_NAME]
    loaded = load_model(DiTExpert, tmp_path / "expert")
    args, kw = _inputs()
    with torch.no_grad():
        assert torch.equal(model(*args, **kw), loaded(*args, **kw))
    assert loaded.cfg == model.cfg


def test_diffusers_from_pretrained_reads_the_folder(tmp_path):
    model = _expert()
    save_model(model, tmp_path / "expert")
    loaded = DiTExpert.from_pretrained(str(tmp_path / "expert"), use_safetensors=True).eval()
    args, kw = _inputs()
    with torch.no_grad():
        assert torch.equal(model(*args, **kw), loaded(*args, **kw))


def test_round_trip_through_an_fsspec_url():
    model = _expert()
    save_model(model, "memory://flowfleet-test/expert")
    loaded = load_model(DiTExpert, "memory://flowfleet-test/expert")
    args, kw = _inputs()
    with torch.no_grad():
        assert torch.equal(model(*args, **kw), loaded(*args, **kw))


def test_router_round_trip(tmp_path):
    router = DiTRouter.from_dit_config(DiTConfig(size="tiny/2", input_size=(8, 8), in_channels=1, num_outputs=3))
    save_model(router, tmp_path / "router")
    assert load_model(DiTRouter, tmp_path / "router").cfg.num_outputs == 3


def _one_line(err: pytest.ExceptionInfo) -> str:
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_corrupted_config_is_refused(tmp_path):
    save_model(_expert(), tmp_path / "e")
    (tmp_path / "e" / "config.json").write_text('{"hidden_size": 128,')
    with pytest.raises(ModelFileError) as err:
        load_model(DiTExpert, tmp_path / "e")
    assert "config.json" in _one_line(err) and "corrupted" in str(err.value)


def test_invalid_config_value_names_the_field(tmp_path):
    save_model(_expert(), tmp_path / "e")
    raw = json.loads((tmp_path / "e" / "config.json").read_text())
    raw["num_heads"] = 3
    (tmp_path / "e" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFileError) as err:  # the edited field contradicts the size preset it claims
        read_dit_config(tmp_path / "e")
    assert "num_heads: 3 contradicts size 'tiny/2'" in _one_line(err)
    raw["size"] = None  # without a size: the width is not divisible by the heads
    (tmp_path / "e" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFileError) as err:
        read_dit_config(tmp_path / "e")
    assert "hidden_size" in _one_line(err)


def test_config_that_does_not_match_weights_is_refused(tmp_path):
    save_model(_expert(), tmp_path / "e")
    raw = json.loads((tmp_path / "e" / "config.json").read_text())
    raw["depth"] = raw["depth"] + 1
    raw["size"] = None  # a self-consistent config (no size preset to contradict) that the weights do not fit
    (tmp_path / "e" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFileError) as err:
        load_model(DiTExpert, tmp_path / "e")
    assert "blocks.4" in _one_line(err)
    raw["depth"] -= 1
    raw["mlp_ratio"] = 2.0
    (tmp_path / "e" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFileError, match="shape"):
        load_model(DiTExpert, tmp_path / "e")


def test_other_time_convention_is_refused(tmp_path):
    save_model(_expert(), tmp_path / "e")
    raw = json.loads((tmp_path / "e" / "config.json").read_text())
    raw["time_convention"] = "x_t=t*x0+(1-t)*eps"
    (tmp_path / "e" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelFileError, match="time_convention"):
        load_model(DiTExpert, tmp_path / "e")


def test_truncated_weights_are_refused(tmp_path):
    save_model(_expert(), tmp_path / "e")
    w = tmp_path / "e" / WEIGHTS_NAME
    w.write_bytes(w.read_bytes()[:100])
    with pytest.raises(ModelFileError) as err:
        load_model(DiTExpert, tmp_path / "e")
    assert WEIGHTS_NAME in _one_line(err)


def test_missing_folder_is_refused(tmp_path):
    with pytest.raises(ModelFileError, match="missing"):
        load_model(DiTExpert, tmp_path / "nowhere")


def test_exact_gelu_is_saved_and_computed(tmp_path):
    """mlp_act "gelu" builds exact-GELU MLPs and keeps it through a round trip (config.json); a folder
    written before the field existed (no mlp_act key) loads as DiT's tanh approximation."""
    tanh = _expert()
    exact = DiTExpert.from_dit_config(tanh.cfg.model_copy(update={"mlp_act": "gelu"})).eval()
    exact.load_state_dict(tanh.state_dict())
    assert {block.mlp.act.approximate for block in exact.blocks} == {"none"}
    assert {block.mlp.act.approximate for block in tanh.blocks} == {"tanh"}
    args, kw = _inputs()
    with torch.no_grad():
        assert not torch.equal(exact(*args, **kw), tanh(*args, **kw))  # a different function, same weights
        save_model(exact, tmp_path / "e")
        assert json.loads((tmp_path / "e" / "config.json").read_text())["mlp_act"] == "gelu"
        assert torch.equal(load_model(DiTExpert, tmp_path / "e")(*args, **kw), exact(*args, **kw))
    raw = json.loads((tmp_path / "e" / "config.json").read_text())
    del raw["mlp_act"]
    (tmp_path / "e" / "config.json").write_text(json.dumps(raw))
    assert load_model(DiTExpert, tmp_path / "e").cfg.mlp_act == "gelu_tanh"


def test_experts_start_from_a_flowfleet_dit_folder_named_by_expert_init(run_root, tmp_path):
    """run.yaml expert_init may name a flowfleet DiT of the expert's architecture (a seed model trained on all
    data): the expert's job starts from exactly its weights; another architecture is one line naming the field."""
    from fixtures.random_fleet import tiny_run_config
    from fixtures.synthetic_run import write_synthetic_run

    from flowfleet.config import RunConfig
    from flowfleet.errors import FlowfleetError
    from flowfleet.storage import RunRoot
    from flowfleet.train.specs import JobSpec
    from flowfleet.train.tasks import build_task

    raw = tiny_run_config(2, conditioning="pooled").model_dump()
    seed = DiTExpert.from_dit_config(DiTConfig(**{**raw["expert"], "cond_dropout": 0.2}))
    with torch.no_grad():
        for p in seed.parameters():
            p.normal_(0, 0.2)  # (adaLN-zero starts some tensors at 0: make every one differ from a fresh expert)
    save_model(seed, tmp_path / "seed")
    raw["expert_init"] = str(tmp_path / "seed")
    cfg = RunConfig(**raw)
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg)
    model = build_task(root, cfg, JobSpec("expert", 1)).build_model()
    theirs = seed.state_dict()
    assert model.state_dict().keys() == theirs.keys()
    assert all(torch.equal(v, theirs[name]) for name, v in model.state_dict().items())
    fresh = build_task(root, RunConfig(**{**raw, "expert_init": None}), JobSpec("expert", 1)).build_model()
    assert not all(torch.equal(v, theirs[name]) for name, v in fresh.state_dict().items())
    wrong = RunConfig(**{**raw, "expert": {**raw["expert"], "depth": 2}})
    with pytest.raises(FlowfleetError, match=r"^expert_init .*seed: depth is 1, run.yaml expert.depth is 2$"):
        build_task(root, wrong, JobSpec("expert", 1)).build_model()
