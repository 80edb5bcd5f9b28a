"""The prompt-aware router p(k | x_t, t, prompt) next to Paris' prompt-blind p(k | x_t, t)."""

from __future__ import annotations

import pytest
import torch
from fixtures.synthetic_run import synthetic_config, write_synthetic_run
from fixtures.tolerances import net_tol

from flowfleet.config import ConfigError, RunConfig, load_run_config
from flowfleet.models.dit import DiTRouter
from flowfleet.models.files import load_model
from flowfleet.storage import RunRoot
from flowfleet.train.loop import Trainer, TrainOptions
from flowfleet.train.specs import JobSpec, fleet_jobs
from flowfleet.train.tasks import build_task

pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=False)


def prompt_aware_config(steps: int = 80) -> RunConfig:
    raw = synthetic_config(k=2, steps=steps, batch=16).to_dict()
    raw["router"].update(conditioning="pooled", text_dim=384)
    raw["router_baseline"] = True
    return RunConfig.from_dict(raw)


def test_config_accepts_text_routers_and_refuses_class_routers():
    cfg = prompt_aware_config()
    assert [j.name for j in fleet_jobs(cfg)] == ["expert-0", "expert-1", "router", "router-paris"]
    raw = cfg.to_dict()
    raw["router"].update(conditioning="class", num_classes=10)
    with pytest.raises(ConfigError, match="router.conditioning"):
        RunConfig.from_dict(raw)
    raw = cfg.to_dict()
    raw["router"].update(text_dim=768)
    with pytest.raises(ConfigError, match="router.text_dim: 768 differs"):
        RunConfig.from_dict(raw)
    blind = synthetic_config(k=2).to_dict()
    blind["router"].update(conditioning="none", text_dim=0)
    blind["router_baseline"] = True
    with pytest.raises(ConfigError, match="router_baseline"):
        RunConfig.from_dict(blind)


def test_prompt_aware_router_reads_the_prompt_where_x_t_says_nothing(tmp_path):
    root = RunRoot(str(tmp_path))
    # Clusters are told apart by brightness (visible at small t) and by their captions' pooled vector.
    write_synthetic_run(root, prompt_aware_config(), per_cluster=24, text_by_cluster=True)
    cfg = load_run_config(root)
    for spec in (JobSpec("router"), JobSpec("router-paris")):
        assert Trainer(build_task(root, cfg, spec), root, OPTIONS).run().state == "done"
    aware = load_model(DiTRouter, root, "router", "final")
    blind = load_model(DiTRouter, root, "router-paris", "final")
    assert aware.cfg.conditioning == "pooled" and blind.cfg.conditioning == "none"

    # At fixed x_t = pure noise, t = 1, the aware router's answer follows the prompt alone.
    data = build_task(root, cfg, JobSpec("router")).data
    pooled, cluster = data.tensors["text_pooled"].float(), data.tensors["cluster"]
    x = torch.randn(1, *cfg.latent_shape, generator=torch.Generator().manual_seed(0)).expand(len(cluster), -1, -1, -1)
    with torch.no_grad():
        logits = aware(x, torch.ones(len(cluster)), text_pooled=pooled)
        blind_logits = blind(x, torch.ones(len(cluster)))
    assert (logits.argmax(1) == cluster).float().mean() >= 0.95
    assert not torch.allclose(logits[cluster == 0][0], logits[cluster == 1][0], atol=1e-3)
    # same x_t: same answer, up to where a batched matmul puts each row (hidden 32, MLP 128, depth 1: ~8 layers)
    torch.testing.assert_close(
        blind_logits, blind_logits[:1].expand_as(blind_logits), rtol=0, atol=net_tol(blind_logits, 128, 8)
    )

    # The training reports say the same per t-bucket: near noise only the prompt helps.
    aware_rep, blind_rep = root.read_json("router", "report.json"), root.read_json("router-paris", "report.json")
    assert aware_rep["accuracy"][-1] >= 0.95
    assert blind_rep["accuracy"][-1] <= 0.75
    # ... and the prompt-aware one, its prompt dropped (the null posterior of guidance over the mixture), is the
    # blind router again there: trained with condition dropout, one network gives both; the table only for it
    without = aware_rep["without_prompt"]
    assert set(without) == set(aware_rep) - {"without_prompt", "note"} and without["items"] == aware_rep["items"]
    assert without["accuracy"][-1] <= 0.75 and "without_prompt" not in blind_rep
    assert without["accuracy"][0] >= 0.95  # near the data the image alone tells the cluster


def test_router_prompt_trains_a_prompt_aware_router_beside_paris_one():
    """run.yaml router_prompt: a run whose router is Paris' also trains router-prompt/ (the "beyond Paris"
    comparison), the same router reading the caption's pooled text vector; a prompt-aware run router refuses it."""
    from flowfleet.train.specs import router_config, run_routers

    raw = synthetic_config(k=2).to_dict()
    raw["router"].update(conditioning="none", text_dim=0)
    raw["router_prompt"] = True
    cfg = RunConfig.from_dict(raw)
    assert [j.name for j in fleet_jobs(cfg)] == ["expert-0", "expert-1", "router", "router-prompt"]
    assert [j.dir for j in run_routers(cfg)] == ["router", "router-prompt"]
    spec = JobSpec("router-prompt")
    assert spec.cli_args("R") == ["train-router", "R", "--prompt-aware"]
    aware = router_config(cfg, spec)
    assert (aware.conditioning, aware.text_dim) == ("pooled", 384)
    assert aware.model_dump(exclude={"conditioning", "text_dim"}) == cfg.router.model_dump(
        exclude={"conditioning", "text_dim"}
    )
    assert not router_config(cfg, JobSpec("router")).uses_text
    with pytest.raises(ConfigError, match="router_prompt: the run's router already reads the prompt"):
        RunConfig.from_dict({**prompt_aware_config().to_dict(), "router_prompt": True})
