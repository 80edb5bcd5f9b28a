"""`assemble`: finished experts + router -> model folder; incompatible experts refused naming expert and field;
partial fleets with a warning; FleetPipeline.from_pretrained opens the result."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.random_fleet import FOLDER_SETTINGS, HashTextEncoder, randomize_, tiny_run_config, write_random_fleet
from fixtures.tolerances import gamma

from flowfleet.errors import FlowfleetError
from flowfleet.flow.path import TIME_CONVENTION
from flowfleet.models.dit import DiTExpert, DiTRouter
from flowfleet.models.files import WEIGHTS_NAME, save_model
from flowfleet.sampling import FleetPipeline, read_model_index
from flowfleet.stages.assemble import assemble
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fleet(run_root):
    cfg = tiny_run_config(3)
    write_random_fleet(str(run_root), cfg)
    return run_root, cfg


def replace_expert(run_root, k, dit_cfg, cls=DiTExpert):
    save_model(randomize_(cls.from_dit_config(dit_cfg), seed=k), str(run_root), "experts", str(k), "final")


def set_state(run_root, k, state):
    path = run_root / "experts" / str(k) / "status.json"
    status = json.loads(path.read_text())
    status.update(state=state, step=10, total_steps=30)
    path.write_text(json.dumps(status))


def test_assemble_writes_a_diffusers_style_folder(fleet):
    run_root, cfg = fleet
    result = assemble(str(run_root))
    model = run_root / "model"
    assert result.out == str(model) and result.present == [0, 1, 2] and not result.warnings
    index = json.loads((model / "model_index.json").read_text())
    # diffusers' loader takes the class from the folder's own pipeline.py (tests/test_diffusers_loader.py)
    assert index["_class_name"] == ["pipeline", "FlowfleetDiffusionPipeline"]
    assert "import FlowfleetDiffusionPipeline" in (model / "pipeline.py").read_text()
    assert index["num_experts"] == 3 and index["present_experts"] == [0, 1, 2]
    assert [index[f"expert_{k}"] for k in range(3)] == [["flowfleet", "DiTExpert"]] * 3
    assert index["router"] == ["flowfleet", "DiTRouter"]
    assert index["latent_shape"] == [1, 8, 8] and index["text_width"] == 384 and index["text_len"] == 4
    assert index["scheduler"] == {
        "time_convention": TIME_CONVENTION,
        "steps": 4,
        "sampler": "euler",
        "guidance_scale": 2.0,
        "guidance_max_t": 1.0,
        "shift": 1.0,
        "strategy": "top2",
        "guidance": "mixture",
        "route_every": 1,
    }
    text_ref = json.loads((model / "text_encoder" / "config.json").read_text())
    assert text_ref["name"] == "minilm" and text_ref["width"] == 384 and text_ref["max_length"] == 4
    assert not list((model / "text_encoder").glob("*.safetensors"))  # referenced, not copied
    assert (model / "PIXEL_SPACE.txt").exists() and not (model / "vae").exists()
    assert (model / "run.yaml").read_text() == (run_root / "run.yaml").read_text()
    for k in range(3):  # the EMA weights from final/, byte for byte
        src = run_root / "experts" / str(k) / "final"
        for name in ("config.json", WEIGHTS_NAME):
            assert (model / f"expert_{k}" / name).read_bytes() == (src / name).read_bytes()
    assert (model / "router" / WEIGHTS_NAME).read_bytes() == (run_root / "router" / "final" / WEIGHTS_NAME).read_bytes()

    pipe = FleetPipeline.from_pretrained(str(model), text_encoder=HashTextEncoder(384, 4))
    assert pipe.present == (0, 1, 2) and pipe.experts.resident == ()  # experts load lazily
    out = pipe(["a digit"], n=2, strategy="top1", steps=2)
    assert out.images.shape == (2, 1, 8, 8)
    assert set(pipe.experts.loads) == set(torch.unique(torch.stack(out.trace.experts)).tolist())


def test_assemble_to_another_folder_and_sampler_defaults_from_run_yaml(run_root, tmp_path):
    cfg = tiny_run_config(2, **FOLDER_SETTINGS)
    write_random_fleet(str(run_root), cfg)
    out = tmp_path / "elsewhere"
    assemble(str(run_root), str(out))
    index = read_model_index(str(out))
    assert index.scheduler.model_dump() == {
        "time_convention": TIME_CONVENTION,
        "steps": 7,
        "sampler": "heun",
        "guidance_scale": 3.5,
        "guidance_max_t": 0.6,
        "shift": 2.0,
        "strategy": "top1",
        "guidance": "expert",
        "route_every": 2,
    }
    pipe = FleetPipeline.from_pretrained(str(out), text_encoder=HashTextEncoder(384, 4))
    s = pipe.settings()
    assert (s.steps, s.sampler, s.guidance_scale, s.guidance_max_t, s.shift, s.strategy.name, s.route_every, s.k) == (
        7,
        "heun",
        3.5,
        0.6,
        2.0,
        "top1",
        2,
        1,
    )


@pytest.mark.parametrize(
    "change,field",
    [
        ({"patch_size": 4}, "patch_size"),
        ({"text_dim": 128}, "text_dim"),
        ({"text_len": 8}, "text_len"),
        ({"input_size": (16, 16)}, "latent shape"),
        ({"in_channels": 3}, "latent shape"),
        ({"conditioning": "pooled"}, "conditioning"),
    ],
)
def test_incompatible_expert_is_refused_naming_expert_and_field(fleet, change, field):
    run_root, cfg = fleet
    replace_expert(run_root, 1, cfg.expert.model_copy(update=change))
    with pytest.raises(FlowfleetError) as info:
        assemble(str(run_root))
    msg = str(info.value)
    assert msg.startswith("expert 1 (") and field in msg and "\n" not in msg
    assert not (run_root / "model" / "model_index.json").exists()  # nothing assembled


def test_expert_with_another_time_convention_is_refused(fleet):
    run_root, _ = fleet
    path = run_root / "experts" / "2" / "final" / "config.json"
    raw = json.loads(path.read_text())
    raw["time_convention"] = "x_t=t*x0+(1-t)*eps"  # rectified-flow papers' opposite direction
    path.write_text(json.dumps(raw))
    expected = r"^expert 2 \(.*experts/2/final/config.json\): time_convention 'x_t=t\*x0"
    with pytest.raises(FlowfleetError, match=expected):
        assemble(str(run_root))


def test_router_with_wrong_K_is_refused(fleet):
    run_root, cfg = fleet
    save_model(
        DiTRouter.from_dit_config(cfg.router.model_copy(update={"num_outputs": 4})), str(run_root), "router", "final"
    )
    with pytest.raises(FlowfleetError, match=r"^router \(.*\): num_outputs 4 differs from K = 3 experts"):
        assemble(str(run_root))


def test_router_not_finished_is_refused(fleet):
    run_root, _ = fleet
    (run_root / "router" / "status.json").unlink()
    with pytest.raises(FlowfleetError, match=r"^router: not finished .*status.json: missing"):
        assemble(str(run_root))


def test_unfinished_expert_refused_unless_partial_then_warned_and_renormalised(fleet):
    run_root, cfg = fleet
    assemble(str(run_root))  # a complete fleet first: expert_1 must disappear from the folder below
    set_state(run_root, 1, "running")
    with pytest.raises(
        FlowfleetError,
        match=r"^expert 1 is not finished .*state 'running' at step 10/30.*"
        r"--allow-partial",
    ):
        assemble(str(run_root))
    result = assemble(str(run_root), allow_partial=True)
    assert result.present == [0, 2] and list(result.missing) == [1]
    assert len(result.warnings) == 1 and "expert 1 left out" in result.warnings[0]
    model = run_root / "model"
    assert not (model / "expert_1").exists()
    index = read_model_index(str(model))
    assert index.partial and index.present_experts == [0, 2] and index.num_experts == 3
    assert "expert_1" not in json.loads((model / "model_index.json").read_text())

    pipe = FleetPipeline.from_pretrained(str(model), text_encoder=HashTextEncoder(384, 4))
    out = pipe(["a digit"], n=4, strategy="full", steps=2)
    for probs, weights in zip(out.trace.probs, out.trace.weights):
        # a float32 softmax over 3 experts, renormalised, summed: gamma_{2K+1}
        tol = gamma(2 * 3 + 1, torch.float32)
        assert torch.all(probs[:, 1] == 0) and torch.allclose(probs.sum(1), torch.ones(4), atol=tol, rtol=0)
        assert torch.allclose(weights.sum(1), torch.ones(4), atol=tol, rtol=0)
    assert 1 not in pipe.experts.loads and out.trace.stats.calls[1] == 0


def test_missing_expert_folder_and_no_expert_at_all(fleet):
    run_root, _ = fleet
    RunRoot(str(run_root)).remove("experts", "0", recursive=True)
    with pytest.raises(FlowfleetError, match=r"^expert 0 is not finished .*missing \(never started\)"):
        assemble(str(run_root))
    for k in (1, 2):
        set_state(run_root, k, "failed")
    with pytest.raises(FlowfleetError, match="no finished expert among the 3"):
        assemble(str(run_root), allow_partial=True)


def test_corrupted_expert_weights_are_refused(fleet):
    run_root, _ = fleet
    path = run_root / "experts" / "2" / "final" / WEIGHTS_NAME
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(FlowfleetError, match=f"experts/2/final: {WEIGHTS_NAME} is unreadable"):
        assemble(str(run_root))


def test_missing_run_yaml(run_root):
    with pytest.raises(FlowfleetError, match="run.yaml: missing"):
        assemble(str(run_root))


def test_from_pretrained_refuses_a_missing_expert_folder(fleet):
    run_root, _ = fleet
    assemble(str(run_root))
    RunRoot(str(run_root / "model")).remove("expert_2", recursive=True)
    with pytest.raises(FlowfleetError, match=r"model/expert_2: missing \(model_index.json lists expert 2\)"):
        FleetPipeline.from_pretrained(str(run_root / "model"), text_encoder=HashTextEncoder(384, 4))


def test_assemble_monolith_is_a_one_expert_model_that_generate_opens(fleet):
    run_root, cfg = fleet
    with pytest.raises(FlowfleetError, match="monolith: not finished .*train-monolith"):
        assemble(str(run_root), monolith=True)
    mono = randomize_(DiTExpert.from_dit_config(cfg.expert), seed=7)
    save_model(mono, str(run_root), "monolith", "final")
    (run_root / "monolith" / "status.json").write_text(
        json.dumps({"job": "monolith", "state": "done", "step": 30, "total_steps": 30})
    )
    result = assemble(str(run_root), monolith=True)
    model = run_root / "model-monolith"
    assert result.out == str(model) and result.num_experts == 1 and result.present == [0]
    index = json.loads((model / "model_index.json").read_text())
    assert index["router"] == [None, None] and index["num_experts"] == 1 and index["scheduler"]["strategy"] == "top1"
    assert not (model / "router").exists()
    monolith_weights = run_root / "monolith" / "final" / WEIGHTS_NAME
    assert (model / "expert_0" / WEIGHTS_NAME).read_bytes() == monolith_weights.read_bytes()

    text = HashTextEncoder(384, 4)
    pipe = FleetPipeline.from_pretrained(str(model), text_encoder=text)
    out = pipe(["a digit"], 2, seed=0)
    # The one-expert model samples exactly what evaluate's monolith (monolith/final beside a fleet) does.
    from flowfleet.stages.evaluate.models import monolith_pipeline

    fleet_pipe = FleetPipeline.from_pretrained(assemble(str(run_root)).out, text_encoder=text)
    beside = monolith_pipeline(RunRoot(str(run_root)), fleet_pipe, torch.device("cpu"))
    assert torch.equal(out.images, beside(["a digit"], 2, seed=0).images)
    assert out.trace.stats.calls[0] == cfg.sampling.steps
    with pytest.raises(FlowfleetError, match="k=2 exceeds the 1 experts"):
        pipe(["a digit"], 2, strategy="top2")


def test_assemble_with_the_paris_router(fleet, tmp_path):
    run_root, cfg = fleet
    with pytest.raises(FlowfleetError, match="router-paris: not finished .*train-router .* --paris"):
        assemble(str(run_root), str(tmp_path / "m"), router="router-paris")
    with pytest.raises(FlowfleetError, match="^router: 'nope' is not a router job"):
        assemble(str(run_root), str(tmp_path / "m"), router="nope")
    paris = randomize_(DiTRouter.from_dit_config(cfg.router), seed=5)
    save_model(paris, str(run_root), "router-paris", "final")
    (run_root / "router-paris" / "status.json").write_text(
        json.dumps({"job": "router-paris", "state": "done", "step": 30, "total_steps": 30})
    )
    result = assemble(str(run_root), str(tmp_path / "m"), router="router-paris")
    index = json.loads((tmp_path / "m" / "model_index.json").read_text())
    assert index["source"]["router"]["job"] == "router-paris" and result.present == [0, 1, 2]
    assert (tmp_path / "m" / "router" / WEIGHTS_NAME).read_bytes() == (
        run_root / "router-paris" / "final" / WEIGHTS_NAME
    ).read_bytes()


def test_the_model_folder_carries_a_fleet_card_from_the_run_root(fleet):
    """card.json: each expert's size, parameters and steps, its cluster's size, labels and preview (copied),
    the router's accuracy per t; a folder without it still gets a card from its configs."""
    from flowfleet.sampling.card import card_markdown, read_card

    run_root, cfg = fleet
    (run_root / "clusters").mkdir()
    report = {"count": 60, "sizes": [30, 20, 10], "label_mix": [{"0": 30}, {"1": 15, "7": 5}, {"2": 10}]}
    report["examples"] = {"0": ["a zero"], "1": ["a one", "a seven"], "2": ["a two"]}
    (run_root / "clusters" / "report.json").write_text(json.dumps(report))
    previews = {k: f"png of cluster {k}".encode() for k in range(3)}
    for k, png in previews.items():
        (run_root / "clusters" / f"preview-{k}.png").write_bytes(png)
    router_report = {"overall_accuracy": 0.8, "chance": 1 / 3, "t_buckets": [[0, 0.5], [0.5, 1]], "accuracy": [1, 0.6]}
    (run_root / "router" / "report.json").write_text(json.dumps(router_report))

    model = run_root / "model"
    assemble(str(run_root))
    card = read_card(str(model))
    assert card.kind == "fleet" and card.num_experts == 3 and card.present == [0, 1, 2] and card.name == cfg.name
    for k, e in enumerate(card.experts):
        expert = DiTExpert.from_pretrained(str(model / f"expert_{k}"))
        assert e.params == sum(p.numel() for p in expert.parameters()) and e.hidden_size == cfg.expert.hidden_size
        assert e.steps == cfg.train.steps and e.cluster_size == report["sizes"][k]
        assert e.label_mix == report["label_mix"][k] and e.examples == report["examples"][str(k)]
        assert (model / e.preview).read_bytes() == previews[k]
    assert card.router is not None and card.router.accuracy == [1, 0.6] and card.router.job == "router"
    text = card_markdown(card)
    assert "a fleet of 3 experts" in text and "1: 15, 7: 5" in text and "accuracy 0.800 (chance 0.333)" in text

    (model / "card.json").unlink()  # an older folder: the card comes from its configs
    bare = read_card(str(model))
    assert [e.hidden_size for e in bare.experts] == [cfg.expert.hidden_size] * 3 and bare.router is None
    assert bare.experts[0].cluster_size is None and "no accuracy recorded" in card_markdown(bare)
