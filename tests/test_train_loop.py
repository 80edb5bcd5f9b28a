"""The training loop in-process on synthetic shard sets: outputs, resume, isolation, bad input, NaN."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
from pathlib import Path

import pytest
import safetensors.torch
import torch
from fixtures import synthetic_run
from fixtures.synthetic_run import synthetic_config, write_synthetic_run
from fixtures.tolerances import gamma, network_terms, reorder

from flowfleet.config import RunConfig, load_run_config
from flowfleet.data.shards import ShardSet, ShardSetManifest
from flowfleet.errors import FlowfleetError
from flowfleet.models.dit import DiTExpert, DiTRouter
from flowfleet.models.files import load_model
from flowfleet.models.flops import train_flops, train_flops_per_sample
from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import CheckpointStore
from flowfleet.train.loop import TrainingDiverged, TrainOptions, learning_rate
from flowfleet.train.specs import JobSpec
from flowfleet.train.status import JobBusyError, JobStatus, read_status
from flowfleet.train.tasks import build_task

EXPERT0 = JobSpec("expert", 0)
OPTIONS = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=False)


pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(path, **kw) -> RunRoot:
    root = RunRoot(path)
    write_synthetic_run(root, synthetic_config(**kw))
    return root


def run_job(root: RunRoot, spec: JobSpec = EXPERT0, on_loss=None, options: TrainOptions = OPTIONS) -> JobStatus:
    """Build the task as the stage does; on_loss(call_number, loss) -> loss may interfere."""
    return synthetic_run.run_job(root, spec, options, on_loss)


def tensors(path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(path.read_bytes())


def assert_bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


# ------------------------------------------------------------------------------------------------


def test_expert_job_writes_everything_the_contract_lists(tmp_path, monkeypatch):
    monkeypatch.setenv("FLOWFLEET_PEAK_TFLOPS", "0.5")  # the device's peak as its owner states it: MFU against it
    root = make_run(tmp_path / "r", steps=4, train=dict(sample_every=2, ckpt_every=2))
    status = run_job(root, options=TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=True))
    job = tmp_path / "r/experts/0"
    on_disk = json.loads((job / "status.json").read_text())
    assert set(on_disk) == {
        "job",
        "state",
        "step",
        "total_steps",
        "samples_seen",
        "last_checkpoint",
        "host",
        "pid",
        "heartbeat",
        "last_loss",
        "message",
        "threads",
        "diloco",  # (null but for a DiLoCo worker)
        "step_s",
        "model_tflops",
        "mfu",
        "peak_memory_gib",
    }
    assert on_disk["threads"] == f"{torch.get_num_threads()} threads (fixed: a repeatable run)"  # the default
    assert on_disk["job"] == "expert-0" and on_disk["state"] == "done" == status.state
    assert (on_disk["step"], on_disk["total_steps"], on_disk["samples_seen"]) == (4, 4, 32)
    assert on_disk["last_checkpoint"] == "step-0000004" and on_disk["pid"] == os.getpid()
    lines = [json.loads(x) for x in (job / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2, 3, 4]
    assert all(x["loss"] > 0 and x["samples_per_s"] > 0 and x["lr"] == 1e-3 for x in lines)
    assert on_disk["last_loss"] == lines[-1]["loss"]
    # a GPU user's figures: the step's time, the model's analytic FLOPs of the samples trained over it, their share
    # of the stated peak, the process's peak memory; status.json has the last line's
    from flowfleet.config import load_run_config
    from flowfleet.models.flops import train_flops_per_sample

    sample_flops = train_flops_per_sample(load_run_config(root).expert_config(0))
    for x in lines:  # one step a line: its samples over its time
        assert x["step_s"] > 0 and x["peak_memory_gib"] > 0.01
        assert x["model_tflops"] == pytest.approx(x["samples_per_s"] * sample_flops / 1e12, rel=1e-3)
        assert x["mfu"] == pytest.approx(x["model_tflops"] / 0.5, rel=1e-9)
    assert {k: on_disk[k] for k in ("step_s", "model_tflops", "mfu", "peak_memory_gib")} == {
        k: lines[-1][k] for k in ("step_s", "model_tflops", "mfu", "peak_memory_gib")
    }
    assert sorted(p.name for p in (job / "samples").iterdir()) == ["step-0000002.png", "step-0000004.png"]
    assert (job / "samples/step-0000002.png").read_bytes()[:4] == b"\x89PNG"
    assert any(p.name.startswith("events.out.tfevents") for p in (job / "tb").iterdir())
    ckpt = job / "checkpoints/step-0000004"
    assert sorted(p.name for p in ckpt.iterdir()) == [
        "ema.safetensors",
        "model.safetensors",
        "optimizer.safetensors",
        "rng.safetensors",
        "state.json",
    ]
    assert not list(job.rglob("*.pt")) and not list(job.rglob("*.bin"))  # nothing pickled
    final = load_model(DiTExpert, RunRoot(job), "final")  # final/ = the EMA weights as a model folder
    ema = tensors(ckpt / "ema.safetensors")
    for key, value in final.state_dict().items():
        assert torch.equal(value, ema[f"module.{key}"]), key
    model = tensors(ckpt / "model.safetensors")
    assert not torch.equal(model["blocks.0.mlp.fc1.weight"], ema["module.blocks.0.mlp.fc1.weight"])
    # a second call finds the job done and trains nothing
    again = run_job(root)
    assert again.state == "done" and json.loads((job / "status.json").read_text())["heartbeat"] == on_disk["heartbeat"]


def test_stop_and_resume_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    kw = dict(steps=6, train=dict(ema_decay=0.8, grad_accum=2, grad_clip=1.0, warmup_steps=2, schedule="cosine"))
    straight = make_run(tmp_path / "a", **kw)
    assert run_job(straight).state == "done"

    resumed = make_run(tmp_path / "b", **kw)

    def sigterm_in_step_3(call, loss):  # grad_accum 2: calls 5 and 6 make step 3
        if call == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # the real handler: finish the step, checkpoint, stop
        return loss

    stopped = run_job(resumed, on_loss=sigterm_in_step_3)
    assert (stopped.state, stopped.step, stopped.last_checkpoint) == ("stopped", 3, "step-0000003")
    assert "SIGTERM" in stopped.message and "resume" in stopped.message
    assert read_status(resumed, "experts/0").state == "stopped"
    assert not (tmp_path / "b/experts/0/final").exists()
    assert run_job(resumed).state == "done"

    for name in ("model.safetensors", "ema.safetensors", "optimizer.safetensors"):
        assert_bit_identical(
            tensors(tmp_path / "a/experts/0/checkpoints/step-0000006" / name),
            tensors(tmp_path / "b/experts/0/checkpoints/step-0000006" / name),
        )
    assert_bit_identical(
        tensors(tmp_path / "a/experts/0/final/diffusion_pytorch_model.safetensors"),
        tensors(tmp_path / "b/experts/0/final/diffusion_pytorch_model.safetensors"),
    )
    metrics_a = [json.loads(x) for x in (tmp_path / "a/experts/0/metrics.jsonl").read_text().splitlines()]
    metrics_b = [json.loads(x) for x in (tmp_path / "b/experts/0/metrics.jsonl").read_text().splitlines()]
    assert [m["loss"] for m in metrics_a] == [m["loss"] for m in metrics_b]


def final_weights(root: RunRoot) -> dict[str, torch.Tensor]:
    return tensors(Path(root.path("experts/0/final/diffusion_pytorch_model.safetensors")))


def first_loss(root: RunRoot) -> float:
    return json.loads(Path(root.path("experts/0/metrics.jsonl")).read_text().splitlines()[0])["loss"]


def test_a_compiled_job_repeats_itself_bit_for_bit_and_starts_from_the_eager_jobs_loss(tmp_path, monkeypatch):
    # a cache of its own: Inductor's cache does not key its kernels by ATEN_CPU_CAPABILITY, and `make test` runs this
    # file again under ATEN_CPU_CAPABILITY=default, where the first pass's vectorised kernels fail to build
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compiler-cache"))
    eager = make_run(tmp_path / "eager", steps=3)
    first, second = (make_run(tmp_path / name, steps=3, train=dict(compile=True)) for name in ("a", "b"))
    for root in (eager, first, second):
        assert run_job(root).state == "done"
    assert_bit_identical(final_weights(first), final_weights(second))
    # step 1's loss is one forward of the same batch and noise: compiled kernels differ from eager ones by rounding
    # alone (the expert: hidden 32, MLP 128, one block; the loss a mean of squares over the batch's 8 x 1 x 8 x 8)
    loss = first_loss(eager)
    assert first_loss(first) == pytest.approx(loss, abs=reorder(network_terms(128, 6) + 512, scale=max(loss, 1.0)))
    assert not all(torch.equal(x, y) for x, y in zip(final_weights(eager).values(), final_weights(first).values()))


def test_compile_without_a_compiler_warns_naming_the_job_and_trains_eagerly(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr("flowfleet.device.shutil.which", lambda name: None)
    eager = make_run(tmp_path / "eager", steps=2)
    asked = make_run(tmp_path / "asked", steps=2, train=dict(compile=True))
    assert run_job(eager).state == "done"
    with caplog.at_level("WARNING", logger="flowfleet.device"):
        assert run_job(asked).state == "done"
    assert any("expert-0: compile" in r.message and "C++ compiler" in r.message for r in caplog.records), caplog.text
    assert_bit_identical(final_weights(eager), final_weights(asked))


def test_crash_during_a_checkpoint_then_resume_matches_uninterrupted(tmp_path, monkeypatch):
    kw = dict(steps=4, train=dict(ckpt_every=2))
    straight = make_run(tmp_path / "a", **kw)
    run_job(straight)
    crashed = make_run(tmp_path / "b", **kw)
    real_write = RunRoot.write_bytes

    def failing_write(self, data, *parts):
        if parts[-1] == "ema.safetensors" and "step-0000004" in parts:
            raise OSError("machine lost (injected)")
        return real_write(self, data, *parts)

    monkeypatch.setattr(RunRoot, "write_bytes", failing_write)
    with pytest.raises(OSError, match="injected"):
        run_job(crashed)
    monkeypatch.undo()
    status = read_status(crashed, "experts/0")
    assert status.state == "failed" and "injected" in status.message
    assert CheckpointStore(crashed, "experts/0").latest() == "step-0000002"
    assert run_job(crashed).state == "done"  # resumes from step 2
    assert_bit_identical(
        tensors(tmp_path / "a/experts/0/final/diffusion_pytorch_model.safetensors"),
        tensors(tmp_path / "b/experts/0/final/diffusion_pytorch_model.safetensors"),
    )


def test_expert_trains_with_every_other_partition_and_data_deleted(tmp_path):
    root = make_run(tmp_path / "r", k=3, steps=2)
    for other in ("partitions/0", "partitions/2", "data", "clusters"):
        shutil.rmtree(tmp_path / "r" / other)
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["partitions", "run.yaml"]
    status = run_job(root, JobSpec("expert", 1))
    assert status.state == "done" and (tmp_path / "r/experts/1/final/config.json").exists()
    assert sorted(p.name for p in (tmp_path / "r").iterdir()) == ["experts", "partitions", "run.yaml"]


def _rewrite_partition(root: RunRoot, k: int, **changes) -> None:
    shards = ShardSet(root, f"partitions/{k}")
    fields, captions = shards.load(with_captions=True)
    fields.update(changes)
    shutil.rmtree(root.local_path(f"partitions/{k}"))
    manifest = ShardSetManifest()
    shards.append(manifest, fields, captions)
    manifest.complete = True
    shards.write_manifest(manifest)


def test_partition_that_does_not_fit_the_expert_is_one_line_naming_both(tmp_path):
    root = make_run(tmp_path / "r", steps=2)
    n = len(ShardSet(root, "partitions/0").load(["index"])["index"])
    _rewrite_partition(root, 0, latents=torch.zeros(n, 1, 4, 4))
    with pytest.raises(FlowfleetError) as err:
        run_job(root)
    msg = str(err.value)
    assert "\n" not in msg and "partitions/0" in msg and "1x4x4" in msg and "1x8x8" in msg and "expert" in msg
    _rewrite_partition(root, 1, text_pooled=torch.zeros(n, 16))
    with pytest.raises(
        FlowfleetError,
        match=r"partitions/1: pooled text width is 16 but run.yaml expert expects "
        r"text_dim 384",
    ):
        run_job(root, JobSpec("expert", 1))
    with pytest.raises(FlowfleetError, match=r"^expert 5: run.yaml has 2 experts"):
        run_job(root, JobSpec("expert", 5))
    manifest = ShardSet(root, "data").manifest()
    manifest.complete = False  # prepare still writing, or it died
    ShardSet(root, "data").write_manifest(manifest)
    with pytest.raises(FlowfleetError, match=r"data/manifest.json: incomplete .* finish `flowfleet prepare"):
        run_job(root, JobSpec("router"))


def test_run_of_non_finite_losses_stops_and_keeps_the_last_good_checkpoint(tmp_path):
    root = make_run(tmp_path / "r", steps=20, train=dict(ckpt_every=2, max_bad_steps=3))

    def nan_from_step_4(call, loss):
        if call == 4:  # one isolated bad step is skipped and training goes on
            return loss * float("nan")
        return loss * float("inf") if call >= 7 else loss

    with pytest.raises(TrainingDiverged, match=r"expert-0: loss was (inf|nan) for 3 consecutive steps") as err:
        run_job(root, on_loss=nan_from_step_4)
    assert "step-0000006" in str(err.value)
    status = read_status(root, "experts/0")
    assert status.state == "failed" and "consecutive" in status.message
    store = CheckpointStore(root, "experts/0")
    assert store.latest() == "step-0000006"
    model = store.load("step-0000006").tensors["model"]
    assert all(torch.isfinite(v).all() for v in model.values())


def test_second_copy_of_a_running_job_is_refused(tmp_path):
    root = make_run(tmp_path / "r", steps=2)
    busy = JobStatus("expert-0", state="running", host="elsewhere", pid=1, heartbeat=__import__("time").time())
    root.write_json(busy.to_dict(), "experts/0", "status.json")
    with pytest.raises(JobBusyError, match="already running on elsewhere"):
        run_job(root)
    busy.heartbeat -= 3600  # a dead job's stale heartbeat does not block
    root.write_json(busy.to_dict(), "experts/0", "status.json")
    assert run_job(root).state == "done"


def test_router_learns_clusters_and_reports_accuracy_per_t_bucket(tmp_path):
    root = make_run(tmp_path / "r", k=2, steps=40, batch=16, train=dict(ema_decay=0.5))
    status = run_job(root, JobSpec("router"))
    assert status.state == "done"
    report = json.loads((tmp_path / "r/router/report.json").read_text())
    assert len(report["accuracy"]) == len(report["t_buckets"]) == 10
    assert report["t_buckets"][0] == [0.0, 0.1] and report["t_buckets"][-1] == [0.9, 1.0]
    # synthetic clusters differ in brightness: clean-ish inputs are easy, pure noise is chance
    assert report["accuracy"][0] > 0.9 > report["chance"] == 0.5
    assert sum(map(sum, report["confusion"])) == 10 * report["items"]
    assert load_model(DiTRouter, RunRoot(tmp_path / "r/router"), "final").cfg.num_outputs == 2
    assert (tmp_path / "r/router/samples/step-0000040.png").exists()


def test_router_refuses_assignments_that_do_not_cover_the_data(tmp_path):
    root = make_run(tmp_path / "r", steps=2)
    root.write_bytes(
        safetensors.torch.save({"assign": torch.zeros(5, dtype=torch.long)}), "clusters", "assignments.safetensors"
    )
    with pytest.raises(FlowfleetError, match=r"assignments.safetensors: 'assign' has shape \(5,\)"):
        run_job(root, JobSpec("router"))


def test_monolith_trains_on_all_data_for_matched_compute(tmp_path):
    root = make_run(tmp_path / "r", k=2, steps=2, monolith=True)
    status = run_job(root, JobSpec("monolith"))
    cfg = load_run_config(root)
    # 2 experts x 2 steps, plus the steps that spend the router's training FLOPs (the same batch)
    router = train_flops(cfg.router, cfg.router_train.steps, cfg.router_train.batch_size)
    steps = 2 * 2 + math.ceil(router / (train_flops_per_sample(cfg.expert) * cfg.train.batch_size))
    assert steps > 4
    assert (status.state, status.total_steps, status.step) == ("done", steps, steps)
    assert load_model(DiTExpert, RunRoot(tmp_path / "r/monolith"), "final").cfg == load_run_config(root).expert


def test_expert_trained_on_augmented_copies_needs_and_reads_them(tmp_path):
    raw = synthetic_config(k=2, steps=3).to_dict()
    raw["expert"]["augment_dim"] = 4
    raw["data"]["augment"] = {"copies": 2}
    raw["train"]["augment_p"] = 0.5
    root = RunRoot(tmp_path / "r")
    write_synthetic_run(root, RunConfig.from_dict(raw))
    missing = r"partitions/0.*has no 'aug_latents' field, which run.yaml expert \(train.augment_p=0.5; prepare"
    with pytest.raises(FlowfleetError, match=missing):
        run_job(root)
    part = ShardSet(root, "partitions/0")
    fields, captions = part.load(with_captions=True)
    n = len(captions)
    fields["aug_latents"] = torch.randn(n, 2, *fields["latents"].shape[1:])  # [N, 2, C, H, W]
    fields["aug_params"] = torch.rand(n, 2, 4) * 2 - 1  # [N, 2, 4]
    manifest = ShardSetManifest(extra=part.manifest().extra)
    root.remove("partitions/0", recursive=True)
    part.append(manifest, fields, captions)
    manifest.complete = True
    part.write_manifest(manifest)

    task = build_task(root, load_run_config(root), EXPERT0)
    batch = task.data.gather(torch.arange(8), torch.device("cpu"))
    assert batch["aug_latents"].shape == (8, 2, *batch["latents"].shape[1:])
    model = DiTExpert.from_dit_config(task.model_cfg)
    for p in model.parameters():  # adaLN-Zero starts at the identity: wake every path
        torch.nn.init.normal_(p, std=0.1)

    def loss(**change):
        return task.loss(model, {**batch, **change}, torch.Generator().manual_seed(0))[0]

    # the loss reads the copies and their parameters (the same draw of which items are replaced each time)
    assert loss() != loss(aug_params=torch.zeros_like(batch["aug_params"]))
    assert loss() != loss(aug_latents=torch.zeros_like(batch["aug_latents"]))
    x, t, text = batch["latents"], torch.full((8,), 0.5), batch["text_pooled"]
    with torch.no_grad():  # zeros add nothing: the unaugmented items train the model sampling then runs
        ref, zero = model(x, t, text_pooled=text), model(x, t, text_pooled=text, augment=torch.zeros(8, 4))
    assert torch.equal(ref, zero)
    assert run_job(root).state == "done"
    assert load_model(DiTExpert, RunRoot(tmp_path / "r/experts/0"), "final").cfg.augment_dim == 4


def test_augment_p_needs_copies_and_the_experts_augmentation_input():
    raw = synthetic_config(k=2, steps=3).to_dict()
    raw["train"]["augment_p"] = 0.2
    with pytest.raises(FlowfleetError, match="train.augment_p: 0.2 draws augmented copies, but data.augment.copies"):
        RunConfig.from_dict(raw)
    raw["data"]["augment"] = {"copies": 1}
    with pytest.raises(FlowfleetError, match="expert.augment_dim: 0, but train.augment_p conditions the experts on 4"):
        RunConfig.from_dict(raw)
    raw["expert"]["augment_dim"] = 4
    assert RunConfig.from_dict(raw).train.augment_p == 0.2
    raw["router_train"]["augment_p"] = 0.2
    with pytest.raises(FlowfleetError, match="router_train.augment_p: the router trains on the prepared items only"):
        RunConfig.from_dict(raw)


def test_learning_rate_schedules():
    cfg = synthetic_config(train=dict(lr=1.0, warmup_steps=2, schedule="cosine")).train
    lrs = [learning_rate(cfg, s, 6) for s in range(6)]
    # cosine decay over steps 2..6: 0.5 (1 + cos(pi p)), p = 1/4 and 3/4; a few float64 roundings and libm's
    # cos (within an ulp or two) on each side
    cosine = [0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.75)]
    assert lrs[:3] == [0.5, 1.0, 1.0]
    assert lrs[3] == pytest.approx(cosine[0], rel=gamma(8)) and lrs[5] == pytest.approx(cosine[1], rel=gamma(8))
    constant = synthetic_config(train=dict(lr=0.1)).train
    assert {learning_rate(constant, s, 6) for s in range(6)} == {0.1}
    # wsd: warm-up over 2 steps, constant, then the last round(0.5 x 8) = 4 of the 10 steps decay linearly
    wsd = synthetic_config(train=dict(lr=1.0, warmup_steps=2, schedule="wsd", cooldown=0.5)).train
    assert [learning_rate(wsd, s, 10) for s in range(10)] == [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.75, 0.5, 0.25]


def test_job_on_an_object_store_run_root_trains_and_resumes(tmp_path):
    url = f"memory://flowfleet-test-{os.getpid()}-{id(tmp_path)}/run"
    root = RunRoot(url)
    write_synthetic_run(root, synthetic_config(steps=4, train=dict(ckpt_every=2)))
    options = TrainOptions(progress=False, heartbeat_every=0.2, tensorboard=True)

    def stop_in_step_2(call, loss):
        if call == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return loss

    assert run_job(root, on_loss=stop_in_step_2, options=options).state == "stopped"
    assert len(root.read_bytes("experts/0", "metrics.jsonl").decode().splitlines()) == 2
    assert run_job(root, options=options).state == "done"
    assert [json.loads(x)["step"] for x in root.read_bytes("experts/0", "metrics.jsonl").decode().splitlines()] == [
        1,
        2,
        3,
        4,
    ]
    assert root.exists("experts/0", "final", "config.json") and root.ls("experts/0", "tb")
    assert load_model(DiTExpert, root, "experts/0", "final").cfg == load_run_config(root).expert
    root.remove(recursive=True)
