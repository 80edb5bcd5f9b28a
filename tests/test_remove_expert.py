"""`remove-expert`: the expert and its data leave the fleet; a router trained from scratch without that
data; the model folder re-assembled; the other experts untouched; resume, purge and errors."""

from __future__ import annotations

import json

import pytest
import torch
from fixtures.random_fleet import HashTextEncoder, write_random_fleet
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.cli import main
from flowfleet.config import load_run_config
from flowfleet.errors import FlowfleetError
from flowfleet.sampling import FleetPipeline, read_model_index
from flowfleet.stages.remove_expert import remove_expert
from flowfleet.storage import RunRoot
from flowfleet.train.specs import router_spec
from flowfleet.train.tasks import build_task

pytestmark = pytest.mark.usefixtures("one_thread")

K = 3


@pytest.fixture
def run(run_root):
    """A trained-looking fleet of 3 on synthetic data (12 items per cluster) with a cluster report."""
    cfg = synthetic_config(k=K, steps=4)
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg)
    write_random_fleet(root.url, cfg)
    root.write_json(
        {"label_mix": [{"0": 12}, {"1": 12}, {"2": 12}], "examples": {"1": ["item 1 of cluster 1"]}},
        "clusters",
        "report.json",
    )
    return root


def _files(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_remove_expert_retrains_the_router_without_its_data_and_reassembles(run, run_root):
    kept = {k: _files(run_root / "experts" / str(k)) for k in (0, 2)}
    old_router = _files(run_root / "router")

    result = remove_expert(run.url, 1, progress=False)

    cfg = load_run_config(run)
    assert cfg.removed_experts == [1] and cfg.fleet_experts == [0, 2] and result.removed == [1]
    assert result.routers == ["router-without-1"]
    assert result.lost == {"1": {"labels": {"1": 12}, "examples": ["item 1 of cluster 1"]}}
    # The new router: a job of its own, trained from its first step, on no item of cluster 1.
    status = json.loads((run_root / "router-without-1" / "status.json").read_text())
    assert status["state"] == "done" and status["step"] == status["total_steps"] == cfg.router_train.steps
    first = json.loads((run_root / "router-without-1" / "metrics.jsonl").read_text().splitlines()[0])
    assert first["step"] == 1
    task = build_task(run, cfg, router_spec(cfg))
    assert len(task.data) == 2 * 12 and not (task.data.tensors["cluster"] == 1).any()
    assert all("cluster 1" not in caption for caption in task.data.captions)
    # The model folder: the remaining experts byte for byte, the new router, nothing of expert 1.
    index = read_model_index(result.model)
    assert index.present_experts == [0, 2] and index.num_experts == K
    assert index.source["router"]["job"] == "router-without-1" and index.source["removed_experts"] == [1]
    model = run_root / "model"
    assert sorted(p.name for p in model.iterdir() if p.name.startswith("expert_")) == ["expert_0", "expert_2"]
    new_router = (run_root / "router-without-1" / "final" / "diffusion_pytorch_model.safetensors").read_bytes()
    assert (model / "router" / "diffusion_pytorch_model.safetensors").read_bytes() == new_router
    assert new_router != old_router["final/diffusion_pytorch_model.safetensors"]
    for k in (0, 2):
        assert _files(run_root / "experts" / str(k)) == kept[k]  # untouched
        assert _files(model / f"expert_{k}") == _files(run_root / "experts" / str(k) / "final")
    assert _files(run_root / "router") == old_router  # kept beside the new one until --purge
    # The fleet samples without ever selecting expert 1.
    pipe = FleetPipeline.from_pretrained(result.model, text_encoder=HashTextEncoder(384, cfg.encoders.text.max_length))
    out = pipe(["a", "b", "c"], n=3, strategy="full", steps=2)
    assert torch.isfinite(out.images).all()
    assert 1 not in pipe.experts.loads and set(torch.stack(out.trace.experts).flatten().tolist()) <= {0, 2}

    # Again: nothing to retrain, the same folder. Then a second expert out, and --purge.
    again = remove_expert(run.url, 1, progress=False)
    assert again.removed == [1] and _files(model / "router") == _files(run_root / "router-without-1" / "final")
    last = remove_expert(run.url, 2, purge=True, progress=False)
    assert last.removed == [1, 2] and last.routers == ["router-without-1-2"]
    assert read_model_index(last.model).present_experts == [0]
    assert sorted(last.purged) == sorted(
        ["experts/1", "experts/2", "partitions/1", "partitions/2", "router", "router-without-1"]
    )
    assert sorted(p.name for p in run_root.iterdir() if p.name.startswith("router")) == ["router-without-1-2"]
    with pytest.raises(FlowfleetError, match="the last expert of the fleet cannot be removed"):
        remove_expert(run.url, 0, progress=False)


def test_remove_expert_cli_reports_what_is_lost_and_refuses_bad_experts(run, run_root, capsys):
    assert main(["remove-expert", run.url, "--expert", "1", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"wrote {run_root / 'model'}: the fleet without experts [1] (router: router-without-1)" in out
    assert "expert 1 is gone; the fleet no longer draws: 1 (12) — e.g. item 1 of cluster 1" in out
    assert main(["remove-expert", run.url, "--expert", "7"]) == 1
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "flowfleet remove-expert: error: --expert 7: run.yaml has 3 experts (0..2)"
    )
    # train-all and status know the fleet without expert 1.
    assert main(["status", run.url, "--json"]) == 0
    jobs = [row["job"] for row in json.loads(capsys.readouterr().out)]
    assert jobs == ["expert-0", "expert-2", "router-without-1"]
