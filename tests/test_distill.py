"""`distill`: a student trained on the fleet's routed, guided velocity; an ordinary job (interrupted, it
resumes) and an ordinary model folder (one expert, no router, sampled without guidance)."""

from __future__ import annotations

import json
import os
import signal

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F
from fixtures.random_fleet import HashTextEncoder, write_random_fleet
from fixtures.synthetic_run import synthetic_config, write_synthetic_run
from fixtures.tolerances import gamma, net_tol, network_terms, reorder

from flowfleet.cli import main
from flowfleet.config import load_run_config
from flowfleet.errors import FlowfleetError
from flowfleet.flow import flow_matching_loss, interpolate, sample_t
from flowfleet.sampling import FleetPipeline, read_model_index
from flowfleet.sampling.routing import Condition
from flowfleet.sampling.trace import RoutingTrace
from flowfleet.stages.assemble import assemble
from flowfleet.stages.distill import distill
from flowfleet.storage import RunRoot
from flowfleet.train.preview import condition_kwargs
from flowfleet.train.specs import JobSpec
from flowfleet.train.tasks import DistillTask, build_task

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def fleet(run_root):
    """An assembled random fleet of 3 on synthetic data."""
    cfg = synthetic_config(k=3, steps=4)
    root = RunRoot(str(run_root))
    write_synthetic_run(root, cfg)
    write_random_fleet(root.url, cfg)
    assemble(root.url)
    return root


def test_the_student_regresses_onto_the_fleets_guided_velocity(fleet):
    distill(fleet.url, teacher="top2", steps=2, progress=False)
    cfg = load_run_config(fleet)
    task = build_task(fleet, cfg, JobSpec("student"))
    assert isinstance(task, DistillTask) and task.model_cfg.cond_dropout == 0.0
    assert len(task.data) == 3 * 12  # every item of the run
    batch = task.data.gather(torch.arange(5))
    student = task.build_model()
    loss, _ = task.loss(student, batch, torch.Generator().manual_seed(3))

    # The same draws, the teacher computed here: top-2 of the assembled fleet at the run's CFG.
    gen = torch.Generator().manual_seed(3)
    x0 = batch["latents"]
    t = sample_t(5, mode=cfg.train.time_sampling, generator=gen)
    x_t = interpolate(x0, torch.randn(x0.shape, generator=gen), t)
    pipe = FleetPipeline.from_pretrained(fleet.url_of("model"), load_encoders=False)
    cond = condition_kwargs(batch, cfg.expert)
    with torch.no_grad():
        guided = pipe.settings("top2", guidance_scale=cfg.sampling.guidance_scale, route_every=1, guidance_max_t=1.0)
        target = pipe.velocity_fn(Condition(**cond), guided, RoutingTrace(3))(x_t, t, 0)
        want = F.mse_loss(student(x_t, t, **condition_kwargs(batch, task.model_cfg)), target)
        plain = pipe.settings("top2", guidance_scale=1.0, route_every=1, guidance_max_t=1.0)
        unguided = pipe.velocity_fn(Condition(**cond), plain, RoutingTrace(3))(x_t, t, 0)
    # the teacher's target in another batch: the fleet's reordering bound (caption width 384, ~8 roundings)
    assert loss.item() == pytest.approx(want.item(), rel=reorder(network_terms(384, 8)))
    assert not torch.allclose(target, unguided)  # the guidance is in the target


def test_distill_is_a_resumable_job_and_its_model_folder_samples_without_guidance(fleet, run_root, monkeypatch):
    real = DistillTask.loss
    calls = []

    def sigterm_in_step_2(self, model, batch, gen):
        calls.append(1)
        if len(calls) == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # the trainer's own handler: finish the step, checkpoint, stop
        return real(self, model, batch, gen)

    monkeypatch.setattr(DistillTask, "loss", sigterm_in_step_2)
    with pytest.raises(FlowfleetError, match="student: stopped at step 2/4; re-run the same command to resume"):
        distill(fleet.url, steps=4, student={"size": "tiny"}, progress=False)
    monkeypatch.undo()
    result = distill(fleet.url, steps=4, student={"size": "tiny"}, progress=False)
    metrics = [json.loads(x)["step"] for x in (run_root / "student" / "metrics.jsonl").read_text().splitlines()]
    assert metrics == [1, 2, 3, 4]  # resumed after step 2, not restarted
    assert load_run_config(fleet).distill.model_dump() == {
        "teacher": "top2",
        "student": {"size": "tiny"},
        "steps": 4,
        "guidance_scale": None,
        "method": "velocity",
        "pairs": 2000,
        "teacher_steps": 20,
    }

    index = read_model_index(result.model)
    assert result.model.endswith("model-student") and index.present_experts == [0] and index.router == (None, None)
    assert index.scheduler.guidance_scale == 1.0 and index.scheduler.strategy.name == "top1"
    config = json.loads((run_root / "model-student" / "expert_0" / "config.json").read_text())
    assert config["hidden_size"] == 128 and config["depth"] == 4  # the tiny preset
    pipe = FleetPipeline.from_pretrained(result.model, text_encoder=HashTextEncoder(384, 16))
    out = pipe(["a digit"], n=2, steps=3)
    assert torch.isfinite(out.images).all() and not pipe.guidance_applies(out.settings.guidance_scale)

    # `flowfleet status` lists the student beside the fleet's jobs.
    from flowfleet.stages.train import job_status

    assert [(s.job, s.state) for s in job_status(fleet.url)][-1] == ("student", "done")

    # Other options while student/ exists: refused, nothing changed.
    with pytest.raises(FlowfleetError, match="student: trained with run.yaml distill"):
        distill(fleet.url, steps=8, progress=False)


def test_reflow_learns_the_teachers_noise_to_sample_pairs(fleet, run_root):
    result = distill(fleet.url, steps=2, method="reflow", pairs=6, progress=False)
    pairs = safetensors.torch.load((run_root / "student" / "reflow-pairs.safetensors").read_bytes())
    assert pairs["latents"].shape == pairs["noise"].shape == (6, 1, 8, 8) and pairs["text_pooled"].shape == (6, 384)
    # The pair's sample is the teacher's: top-2 of the fleet at the run's CFG from that noise and condition.
    cfg = load_run_config(fleet)
    pipe = FleetPipeline.from_pretrained(fleet.url_of("model"), load_encoders=False)
    settings = pipe.settings("top2", steps=cfg.distill.teacher_steps, guidance_scale=cfg.sampling.guidance_scale)
    x0, _ = pipe.sample(pairs["noise"][:2], Condition(text_pooled=pairs["text_pooled"][:2]), settings)
    # sampled again in a batch of 2 (6 when the pairs were made): the fleet's reordering bound per step
    tol = net_tol(x0, 384, 8, cfg.distill.teacher_steps)
    assert torch.allclose(x0, pairs["latents"][:2], rtol=0, atol=tol)
    # The student's loss is flow matching on the pairs.
    task = build_task(fleet, cfg, JobSpec("student"))
    batch = task.data.gather(torch.arange(4))
    student = task.build_model()
    loss, _ = task.loss(student, batch, torch.Generator().manual_seed(1))
    t = sample_t(4, mode=cfg.train.time_sampling, generator=torch.Generator().manual_seed(1))
    cond = {"text_pooled": batch["text_pooled"]}
    want = flow_matching_loss(lambda x, tt: student(x, tt, **cond), batch["latents"], t, batch["noise"])
    # the same student on the same batch; the mean over 4 x 64 squared errors may be reordered
    assert loss.item() == pytest.approx(want.item(), rel=gamma(4 * 64, torch.float32))
    assert read_model_index(result.model).present_experts == [0]


def test_distill_cli_errors(fleet, capsys):
    assert main(["distill", fleet.url, "--teacher", "top5"]) == 1
    assert "--teacher: strategy 'top5': k=5 exceeds the 3 experts present" in capsys.readouterr().err
    fleet.remove("model", recursive=True)
    assert main(["distill", fleet.url]) == 1
    assert "model_index.json: missing" in capsys.readouterr().err
