"""Training jobs as real processes: SIGTERM, DDP under torchrun (gloo), train-all + status, the fan-out."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import safetensors.torch
import torch
from fixtures.synthetic_run import synthetic_config, write_synthetic_run

from flowfleet.cli import main
from flowfleet.config import load_run_config
from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import CheckpointStore
from flowfleet.train.fanout import LocalFanout, ProcessJob, Slot, plan_slots
from flowfleet.train.specs import fleet_jobs, monolith_steps
from flowfleet.train.status import read_status

ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
CLI = [sys.executable, "-m", "flowfleet.cli"]


pytestmark = pytest.mark.usefixtures("one_thread")


def make_run(path, **kw) -> RunRoot:
    root = RunRoot(path)
    write_synthetic_run(root, synthetic_config(**kw))
    return root


def wait_for(predicate, timeout: float, what: str) -> None:
    t0 = time.monotonic()
    while not predicate():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.2)


def metrics_lines(job_dir) -> list[str]:
    path = job_dir / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def test_sigterm_to_the_command_checkpoints_marks_stopped_and_returns_0(tmp_path, capsys):
    root = make_run(tmp_path / "r", steps=100_000, train=dict(log_every=1))

    def terminate_after_two_steps():
        wait_for(lambda: len(metrics_lines(tmp_path / "r/experts/1")) >= 2, 120, "two steps")
        os.kill(os.getpid(), signal.SIGTERM)  # delivered to the main thread, where the command runs

    threading.Thread(target=terminate_after_two_steps, daemon=True).start()
    assert main(["train-expert", str(tmp_path / "r"), "--expert", "1", "--no-progress"]) == 0
    status = read_status(root, "experts/1")
    assert status.state == "stopped" and "SIGTERM" in status.message and 2 <= status.step < 100_000
    assert status.last_checkpoint == f"step-{status.step:07d}" == CheckpointStore(root, "experts/1").latest()
    assert f"expert-1: stopped at step {status.step}/100000" in capsys.readouterr().out
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is given back


@pytest.mark.slow
def test_sigterm_to_a_real_process_checkpoints_marks_stopped_and_exits_cleanly(tmp_path):
    root = make_run(tmp_path / "r", steps=100_000, train=dict(log_every=1))
    proc = subprocess.Popen(
        [*CLI, "train-expert", str(tmp_path / "r"), "--expert", "1", "--no-progress"],
        env=ENV,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        wait_for(lambda: len(metrics_lines(tmp_path / "r/experts/1")) >= 2, 180, "two training steps")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    status = read_status(root, "experts/1")
    assert status.state == "stopped" and "SIGTERM" in status.message
    assert status.last_checkpoint == f"step-{status.step:07d}" == CheckpointStore(root, "experts/1").latest()
    assert f"expert-1: stopped at step {status.step}/100000" in out


def test_ddp_with_two_gloo_processes_matches_one_process_with_accumulation(tmp_path):
    kw = dict(steps=3, batch=8)
    make_run(tmp_path / "ddp", **kw)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "flowfleet.cli",
            "train-expert",
            str(tmp_path / "ddp"),
            "--expert",
            "0",
            "--no-progress",
        ],
        env=ENV,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("expert-0: done (3/3 steps") == 1  # rank 0 reports, rank 1 stays quiet
    ddp_root = RunRoot(tmp_path / "ddp")
    state = CheckpointStore(ddp_root, "experts/0").load("step-0000003").state
    assert state["world_size"] == 2
    metrics = (tmp_path / "ddp/experts/0/metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in metrics] == [1, 2, 3]  # only rank 0 writes

    make_run(tmp_path / "one", **kw, train=dict(grad_accum=2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as each torchrun worker (OMP_NUM_THREADS=1)
    try:
        assert main(["train-expert", str(tmp_path / "one"), "--expert", "0", "--no-progress"]) == 0
    finally:
        torch.set_num_threads(threads)
    name = "experts/0/final/diffusion_pytorch_model.safetensors"
    a = safetensors.torch.load((tmp_path / "ddp" / name).read_bytes())
    b = safetensors.torch.load((tmp_path / "one" / name).read_bytes())
    # Bit-identical on any machine: each rank's gradient of its 4 samples is the one the accumulating
    # process computes for that micro-batch (same shapes and kernels, one thread on both sides), and
    # combining two of them is exact in binary floating point ((a + b) / 2 = a / 2 + b / 2: addition of two
    # terms commutes, halving changes only the exponent). docs/numerics.md.
    moved = 0
    for key in a:
        assert torch.equal(a[key], b[key]), key
        moved += int(not torch.equal(a[key], torch.zeros_like(a[key])))
    assert moved > 10


def test_train_all_runs_every_job_then_status_shows_them_done(tmp_path, capsys):
    root = make_run(tmp_path / "r", k=2, steps=2)
    assert [j.name for j in fleet_jobs(synthetic_config(k=2, monolith=True))] == [
        "expert-0",
        "expert-1",
        "router",
        "monolith",
    ]
    assert main(["train-all", str(tmp_path / "r"), "--parallel", "3", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for job in ("expert-0", "expert-1", "router"):
        assert f"{job}: done" in out
        assert (
            read_status(
                root, "experts/0" if job == "expert-0" else "experts/1" if job == "expert-1" else "router"
            ).state
            == "done"
        )
    assert (tmp_path / "r/experts/1/train.log").exists()

    assert main(["status", str(tmp_path / "r")]) == 0
    table = capsys.readouterr().out
    for job in ("expert-0", "expert-1", "router"):
        row = next(line for line in table.splitlines() if job in line)
        assert "done" in row and "2/2" in row and "100%" in row and " s/step" in row  # its speed (no peak: no MFU)
    assert main(["status", str(tmp_path / "r"), "--json"]) == 0
    jobs = json.loads(capsys.readouterr().out)
    assert [s["state"] for s in jobs] == ["done"] * 3
    assert all(s["step_s"] > 0 and s["model_tflops"] > 0 and s["peak_memory_gib"] > 0 for s in jobs)

    t0 = time.monotonic()
    assert main(["train-all", str(tmp_path / "r"), "--no-progress"]) == 0  # nothing left to do
    out = capsys.readouterr()
    assert "expert-0: skipped" in out.out and time.monotonic() - t0 < 5
    assert "flowfleet: expert-0: already done, skipped" in out.err  # the reason, as a log message


def test_status_of_a_fresh_run_lists_pending_jobs(tmp_path, capsys):
    make_run(tmp_path / "r", k=3, steps=5, monolith=True)
    mono = monolith_steps(load_run_config(RunRoot(tmp_path / "r")))
    assert mono > 15  # 3 experts x 5 steps and the router's FLOPs
    assert main(["status", str(tmp_path / "r"), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["job"], r["state"], r["total_steps"]) for r in rows] == [
        ("expert-0", "pending", 5),
        ("expert-1", "pending", 5),
        ("expert-2", "pending", 5),
        ("router", "pending", 5),
        ("monolith", "pending", mono),
    ]
    (tmp_path / "r/router").mkdir()
    (tmp_path / "r/router/status.json").write_text("{torn")
    assert main(["status", str(tmp_path / "r")]) == 0  # one bad file does not hide the other jobs
    table = capsys.readouterr().out
    assert "expert-2" in table and "monolith" in table
    assert " failed " in next(line for line in table.splitlines() if "router" in line)
    assert main(["status", str(tmp_path / "r"), "--json"]) == 0
    router = json.loads(capsys.readouterr().out)[3]
    assert router["state"] == "failed" and "router/status.json: not valid JSON" in router["message"]


def test_failing_job_is_one_line_from_the_cli(tmp_path, capsys):
    make_run(tmp_path / "r", k=2, steps=2)
    assert main(["train-expert", str(tmp_path / "r"), "--expert", "7"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--expert 7: run.yaml has 2 experts (0..1)" in err[0]


# ------------------------------------------------------------------------------------------------
#                                 The fan-out itself (no torch)
# ------------------------------------------------------------------------------------------------


def _py(code: str) -> list[str]:
    return [sys.executable, "-S", "-c", code]


def test_fanout_runs_at_most_n_at_a_time_and_reports_failures(tmp_path):
    stamp = (
        "import time, sys; open(sys.argv[1], 'w').write(f'{time.time()} '); time.sleep(0.6); "
        "open(sys.argv[1], 'a').write(f'{time.time()}')"
    )
    jobs = [ProcessJob(f"j{i}", [*_py(stamp), str(tmp_path / f"j{i}.t")], tmp_path / f"j{i}.log") for i in range(4)]
    jobs.append(ProcessJob("bad", _py("import sys; print('it broke'); sys.exit(3)"), tmp_path / "bad.log"))
    outcomes = LocalFanout([Slot(1), Slot(1)], poll_every=0.05).run(jobs)
    by_name = {o.name: o for o in outcomes}
    assert sorted(by_name) == ["bad", "j0", "j1", "j2", "j3"]
    assert by_name["bad"].returncode == 3 and by_name["bad"].last_line == "it broke"
    spans = [tuple(map(float, (tmp_path / f"j{i}.t").read_text().split())) for i in range(4)]
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    running = peak = 0
    for _, delta in events:
        running += delta
        peak = max(peak, running)
    assert peak == 2


def test_fanout_stop_forwards_sigterm_and_starts_nothing_new(tmp_path):
    wait = (
        "import signal, sys, time; signal.signal(signal.SIGTERM, lambda *a: sys.exit(0)); "
        "open(sys.argv[1], 'w').write('up'); time.sleep(60)"
    )
    jobs = [ProcessJob(f"j{i}", [*_py(wait), str(tmp_path / f"j{i}.up")], tmp_path / f"j{i}.log") for i in range(3)]
    fanout = LocalFanout([Slot(1), Slot(1)], poll_every=0.05)
    threading.Thread(
        target=lambda: (
            wait_for(lambda: all((tmp_path / f"j{i}.up").exists() for i in range(2)), 30, "jobs up"),
            fanout.request_stop(),
        ),
        daemon=True,
    ).start()
    t0 = time.monotonic()
    outcomes = fanout.run(jobs)
    assert time.monotonic() - t0 < 30
    assert sorted((o.name, o.returncode) for o in outcomes) == [("j0", 0), ("j1", 0)]
    assert not (tmp_path / "j2.up").exists()


def test_fanout_runs_flowfleet_commands_from_a_preloaded_forkserver(tmp_path):
    root = make_run(tmp_path / "run")
    jobs = [
        ProcessJob("version", [*CLI, "--version"], tmp_path / "version.log", forkable=True),
        ProcessJob("status", [*CLI, "status", root.url], tmp_path / "status.log", forkable=True),
        ProcessJob("bad", [*CLI, "status", str(tmp_path / "missing")], tmp_path / "bad.log", forkable=True),
    ]
    pids = {}
    fanout = LocalFanout(
        [Slot(1), Slot(1)],
        poll_every=0.05,
        preload=("flowfleet.cli",),
        on_start=lambda job, pid: pids.__setitem__(job.name, pid),
    )
    outcomes = {o.name: o for o in fanout.run(jobs)}
    assert outcomes["version"].returncode == 0 and outcomes["version"].last_line == "flowfleet 0.1.0"
    assert outcomes["status"].returncode == 0 and "expert-0" in (tmp_path / "status.log").read_text()
    assert outcomes["bad"].returncode == 1 and "run.yaml" in outcomes["bad"].last_line  # the CLI's one-line error
    assert len(set(pids.values())) == 3 and os.getpid() not in pids.values()


@pytest.mark.parametrize("gpus", [0, 2])
def test_train_all_forks_cpu_jobs_and_starts_gpu_jobs_afresh_one_gpu_each(tmp_path, monkeypatch, gpus):
    """A fork cannot use CUDA once the forkserver's imports have asked torch about GPUs (seen on an H100:
    every job failed), so on a GPU machine the jobs are fresh processes, each with its own GPU."""
    started = {}

    class Recording(LocalFanout):
        def run(self, jobs):
            started.update(jobs={job.name: job.forkable for job in jobs}, gpus=[slot.gpu for slot in self.slots])
            return []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    monkeypatch.setattr("flowfleet.stages.train.LocalFanout", Recording)
    root = make_run(tmp_path / "r", k=2)
    main(["train-all", root.url, "--no-progress"])
    assert started["jobs"] == {"expert-0": not gpus, "expert-1": not gpus, "router": not gpus}
    assert started["gpus"] == ([0, 1] if gpus else [None] * len(started["gpus"]))


def test_plan_slots_shares_cores_and_gpus():
    assert [(s.threads, s.gpu) for s in plan_slots(5, None, cpus=2, gpus=0)] == [(1, None), (1, None)]
    assert [(s.threads, s.gpu) for s in plan_slots(5, 1, cpus=8, gpus=0)] == [(8, None)]
    assert [(s.threads, s.gpu) for s in plan_slots(2, None, cpus=16, gpus=4)] == [(8, 0), (8, 1)]
    assert len(plan_slots(9, None, cpus=32, gpus=4)) == 4


def test_a_checkpoint_is_written_while_training_goes_on_and_a_kill_mid_write_leaves_the_last_complete_one(tmp_path):
    """train.async_checkpoint: step 4's checkpoint is held in the middle of its write (a slow store); the job trains
    on past it; SIGTERM, then SIGKILL once the grace is over (a scheduler's preemption): step 2's checkpoint is the
    newest complete one and loads, step 4's half-written folder is never taken for one, and the job resumes from it."""
    root = make_run(tmp_path / "r", steps=100_000, train=dict(log_every=1, ckpt_every=2, stop_grace_s=1.0))
    job = tmp_path / "r/experts/1"
    held = [sys.executable, "-m", "fixtures.held_checkpoint", "4"]
    proc = subprocess.Popen(
        [*held, "train-expert", str(tmp_path / "r"), "--expert", "1", "--no-progress"],
        env=ENV,
        cwd=os.path.dirname(os.path.abspath(__file__)),  # tests/: the fixtures package
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        # steps 5 and 6 trained while step 4 was being written (the next checkpoint, at 6, waits for it: one write
        # at a time)
        wait_for(lambda: len(metrics_lines(job)) >= 6, 180, "six steps")
        assert (job / "checkpoints/step-0000004/model.safetensors").exists()
        assert not (job / "checkpoints/step-0000004/state.json").exists()
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)  # the grace
        proc.kill()
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    store = CheckpointStore(root, "experts/1")
    assert store.latest() == "step-0000002" and store.load("step-0000002").step == 2
    assert read_status(root, "experts/1").last_checkpoint == "step-0000002"
    # the run goes on from there (the held folder is left behind and replaced)
    (tmp_path / "r/run.yaml").write_text((tmp_path / "r/run.yaml").read_text().replace("steps: 100000", "steps: 6"))
    assert main(["train-expert", str(tmp_path / "r"), "--expert", "1", "--no-progress"]) == 0
    status = read_status(root, "experts/1")
    assert status.state == "done" and status.step == 6 and store.latest() == "step-0000006"


@pytest.mark.parametrize("background", [True, False])
def test_a_sigterm_too_late_for_another_write_ends_on_the_newest_complete_checkpoint(tmp_path, capsys, background):
    """train.stop_grace_s shorter than a checkpoint's write: the stop takes no checkpoint of its own step (a write
    cut off by the kill would be lost anyway), says so, and the job is stopped on its newest complete checkpoint;
    written in the background or in the loop's thread alike."""
    train = dict(log_every=1, ckpt_every=3, stop_grace_s=1e-6, async_checkpoint=background)
    root = make_run(tmp_path / "r", steps=100_000, train=train)

    def terminate_after_four_steps():
        wait_for(lambda: len(metrics_lines(tmp_path / "r/experts/1")) >= 4, 120, "four steps")
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=terminate_after_four_steps, daemon=True).start()
    assert main(["train-expert", str(tmp_path / "r"), "--expert", "1", "--no-progress"]) == 0
    status = read_status(root, "experts/1")
    assert status.state == "stopped" and status.step >= 4
    newest = f"step-{3 * ((status.step - 1) // 3):07d}"  # the last periodic one before the stop's step
    assert status.last_checkpoint == newest == CheckpointStore(root, "experts/1").latest()
    assert "expert-1: SIGTERM: no checkpoint of this step" in capsys.readouterr().err  # (the CLI's one line)
