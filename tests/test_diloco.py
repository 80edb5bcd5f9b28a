"""DiLoCo over the run root (flowfleet.train.diloco): workers that share only a folder or a bucket train one model.

Each test runs its workers as threads of this process, at once, as train-all's local fan-out runs them as processes:
they meet only in RUN_ROOT/diloco/rounds/."""

from __future__ import annotations

import json
import threading
import time

import pytest
import safetensors.torch
import torch
from fixtures.synthetic_run import synthetic_config, write_synthetic_run
from fixtures.tolerances import gamma

from flowfleet.config import RunConfig
from flowfleet.layout import DILOCO_DECISION, DILOCO_ROUNDS, diloco_round, diloco_worker
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import load_model
from flowfleet.stages.train import train_diloco
from flowfleet.storage import RunRoot
from flowfleet.train.checkpoint import CheckpointStore
from flowfleet.train.data import derive_seed
from flowfleet.train.loop import Trainer, TrainOptions
from flowfleet.train.specs import JobSpec, fleet_jobs
from flowfleet.train.status import read_status
from flowfleet.train.tasks import WorkerTask, build_task

pytestmark = pytest.mark.usefixtures("one_thread")
OPTIONS = TrainOptions(progress=False, tensorboard=False)
WEIGHTS = "diffusion_pytorch_model.safetensors"


def diloco_run(root: RunRoot, *, steps: int, **diloco) -> RunConfig:
    """A synthetic run (2 clusters of 12 items, hidden-32 depth-1 experts) with run.yaml diloco."""
    raw = synthetic_config(k=2, steps=steps, batch=4).to_dict()
    raw["diloco"] = {"workers": 2, **diloco}
    cfg = RunConfig.from_dict(raw)
    write_synthetic_run(root, cfg)
    return cfg


def run_workers(root: RunRoot, workers=(0, 1)) -> dict:
    """The workers at once, each in a thread; -> worker -> its final status (an error is raised here)."""
    results: dict = {}

    def work(w: int) -> None:
        try:
            results[w] = train_diloco(root, w, options=OPTIONS)
        except Exception as err:  # noqa: BLE001  (handed to the test's thread)
            results[w] = err

    threads = []
    for w in workers:
        threads.append(threading.Thread(target=work, args=(w,)))
        threads[-1].start()
        # the next starts once this one has built its model: torch's global generator, which builds θ_0 from
        # train.seed, is one per process, and worker processes have one each
        while read_status(root, diloco_worker(w)) is None and threads[-1].is_alive():
            time.sleep(0.01)
    for t in threads:
        t.join(timeout=300)
    return results


def final_weights(root: RunRoot, w: int) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(root.read_bytes(diloco_worker(w), "final", WEIGHTS))


def test_h1_local_sgd_with_outer_lr_1_is_one_data_parallel_step(tmp_path):
    """H = 1, inner SGD, outer SGD at lr 1 without momentum: θ_1 = θ_0 − mean_w(θ_0 − θ_w) = θ_0 − lr · mean_w g_w,
    one data-parallel SGD step over both workers' batches."""
    root = RunRoot(str(tmp_path / "run"))
    cfg = diloco_run(root, steps=1, sync_every=1, inner="sgd", outer_lr=1.0, outer_momentum=0.0)
    assert all(s.state == "done" for s in run_workers(root).values())

    lr = cfg.train.lr
    theta0 = None
    grads = []
    for w in (0, 1):
        task = build_task(root, cfg, JobSpec("diloco", worker=w))
        assert isinstance(task, WorkerTask)
        torch.manual_seed(task.train_cfg.seed)  # (the trainer's seed before it builds; the init is train.seed's)
        model = task.build_model()
        if theta0 is None:
            theta0 = {k: v.detach().clone() for k, v in model.named_parameters()}
        assert all(torch.equal(theta0[k], v) for k, v in model.named_parameters())  # one θ_0 for every worker
        items = Trainer(task, root, OPTIONS).sampler().take(0, task.train_cfg.batch_size)
        gen = torch.Generator().manual_seed(derive_seed(task.train_cfg.seed, 0, 0))  # step 0, chunk 0
        loss, _ = task.loss(model, task.data.gather(items), gen)
        loss.backward()
        grads.append({k: p.grad.detach().clone() for k, p in model.named_parameters()})
    assert theta0 is not None
    got = final_weights(root, 0)
    assert all(torch.equal(got[k], v) for k, v in final_weights(root, 1).items())
    for name, t0 in theta0.items():
        mean_g = (grads[0][name] + grads[1][name]) / 2
        want = t0 - lr * mean_g
        # θ_w = θ_0 − lr g_w, Δ_w = θ_0 − θ_w, their mean, θ_0 − mean, and the reference's own three roundings: each
        # is off by at most u of the magnitudes involved, |θ_0| + lr (|g_0| + |g_1|)
        scale = t0.abs() + lr * (grads[0][name].abs() + grads[1][name].abs())
        torch.testing.assert_close(got[name], want, rtol=0, atol=float((gamma(10, torch.float32) * scale).max()))
        # and not either worker's own step: the averaging is what is tested
        assert not torch.allclose(got[name], t0 - lr * grads[0][name], rtol=0, atol=1e-9) or torch.equal(
            grads[0][name], grads[1][name]
        )


def test_workers_on_s3_give_the_weights_of_a_local_folder(tmp_path, s3_url):
    local = RunRoot(str(tmp_path / "run"))
    remote = RunRoot(f"{s3_url}/run")
    for root in (local, remote):
        diloco_run(root, steps=4, sync_every=2)
        assert all(s.state == "done" for s in run_workers(root).values())
    assert remote.exists(*diloco_round(1), DILOCO_DECISION)
    for w in (0, 1):
        a, b = final_weights(local, w), final_weights(remote, w)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), f"worker {w}: s3 and local differ"
    a0, a1 = final_weights(local, 0), final_weights(local, 1)
    assert all(torch.equal(a0[k], a1[k]) for k in a0)  # every worker ends with the same model


def replay(root: RunRoot, cfg: RunConfig, rounds: int) -> dict[str, torch.Tensor]:
    """θ_R rebuilt from the run root alone: θ_0, then per round the mean of the pseudo-gradients its decision names
    and a Nesterov SGD step written out (b = μ b + Δ; θ −= lr (Δ + μ b))."""

    d = cfg.diloco
    assert d is not None
    task = build_task(root, cfg, JobSpec("diloco", worker=0))
    theta = {k: v.detach().clone() for k, v in task.build_model().named_parameters()}
    buf: dict[str, torch.Tensor] = {}
    for r in range(rounds):
        decision = json.loads(root.read_bytes(*diloco_round(r), DILOCO_DECISION))
        deltas = [
            safetensors.torch.load(root.read_bytes(*diloco_round(r), f"worker-{w}.safetensors"))
            for w in decision["workers"]
        ]
        for name in theta:
            total = deltas[0][name].clone()
            for delta in deltas[1:]:
                total += delta[name]
            g = total / len(deltas)
            buf[name] = g.clone() if name not in buf else buf[name] * d.outer_momentum + g
            theta[name] = theta[name] - d.outer_lr * (g + d.outer_momentum * buf[name])
    return theta


def test_a_worker_killed_mid_round_resumes_and_no_round_is_applied_twice_or_lost(tmp_path, monkeypatch):
    root = RunRoot(str(tmp_path / "run"))
    cfg = diloco_run(root, steps=6, sync_every=2, round_timeout_s=1.0)
    calls = {"n": 0}
    loss = WorkerTask.loss

    def dies_at_its_fourth_step(self, model, batch, gen):  # worker 1 dies in round 1 (steps 2..3), unsaved
        if self.spec.worker == 1:
            calls["n"] += 1
            if calls["n"] == 4:
                raise RuntimeError("node lost")
        return loss(self, model, batch, gen)

    monkeypatch.setattr(WorkerTask, "loss", dies_at_its_fourth_step)
    first = run_workers(root)
    assert first[0].state == "done"
    assert isinstance(first[1], RuntimeError)
    gone = [{"round": 1, "workers": [0], "missing": [1]}, {"round": 2, "workers": [0], "missing": [1]}]
    assert read_status(root, diloco_worker(0)).diloco["short_rounds"] == gone
    assert read_status(root, diloco_worker(1)).state == "failed"

    monkeypatch.setattr(WorkerTask, "loss", loss)
    again = run_workers(root, workers=(1,))  # resumes from its checkpoint of round 0 and adopts rounds 1 and 2
    assert again[1].state == "done" and again[1].step == 6
    status = read_status(root, diloco_worker(1))
    assert status.diloco["round"] == 3 and status.diloco["short_rounds"] == gone
    want = replay(root, cfg, rounds=3)
    for w in (0, 1):
        store = CheckpointStore(root, diloco_worker(w))
        ckpt = store.load(store.latest())
        assert ckpt.state["outer_round"] == 3
        for name, value in want.items():  # (the same operations in the same order: rounding aside, equal)
            torch.testing.assert_close(ckpt.tensors["outer"][name], value, rtol=gamma(12, torch.float32), atol=1e-7)
    a0, a1 = final_weights(root, 0), final_weights(root, 1)
    assert all(torch.equal(a0[k], a1[k]) for k in a0)


def test_bytes_counted_are_the_files_sizes(tmp_path):

    root = RunRoot(str(tmp_path / "run"))
    diloco_run(root, steps=5, sync_every=2)  # rounds of 2, 2 and 1 steps
    assert all(s.state == "done" for s in run_workers(root).values())
    rounds = root.ls(*DILOCO_ROUNDS)
    assert len(rounds) == 3
    size = lambda *parts: root.fs.size(root.path(*parts))  # noqa: E731
    for w in (0, 1):
        written = read_ = 0
        for r in range(3):
            decision = json.loads(root.read_bytes(*diloco_round(r), DILOCO_DECISION))
            assert decision["workers"] == [0, 1]
            written += size(*diloco_round(r), f"worker-{w}.safetensors")
            if decision["by"] == w:
                written += size(*diloco_round(r), DILOCO_DECISION)
            read_ += size(*diloco_round(r), DILOCO_DECISION)
            read_ += sum(size(*diloco_round(r), f"worker-{v}.safetensors") for v in decision["workers"] if v != w)
        traffic = read_status(root, diloco_worker(w)).diloco
        assert (traffic["bytes_written"], traffic["bytes_read"]) == (written, read_)
        params = sum(p.numel() for p in load_model(DiTExpert, root, diloco_worker(w), "final").parameters())
        assert traffic["bytes_written"] > 3 * 4 * params  # three rounds of a float32 copy of every weight


def test_train_all_runs_the_workers_and_assemble_makes_a_monolith_folder(tmp_path, monkeypatch, capsys):
    from diffusers import DiffusionPipeline
    from fixtures.random_fleet import HashTextEncoder

    from flowfleet.cli import main
    from flowfleet.stages.assemble import assemble
    from flowfleet.stages.generate import generate

    monkeypatch.setattr(
        "flowfleet.sampling.pipeline.build_text_encoder_from",
        lambda index, device: HashTextEncoder(index.text_width, index.text_len),
    )
    root = RunRoot(str(tmp_path / "run"))
    cfg = diloco_run(root, steps=2, sync_every=1)
    assert [s.name for s in fleet_jobs(cfg)][-2:] == ["diloco-0", "diloco-1"]
    assert main(["train-all", root.url, "--no-progress"]) == 0
    assert read_status(root, diloco_worker(1)).diloco["round"] == 2
    capsys.readouterr()
    assert main(["status", root.url]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if " diloco-1 " in line)
    assert " done " in row and "2/2, " in row and "MB out" in row, row
    out = assemble(root.url, diloco=True).out
    assert out.endswith("model-diloco")
    picture = tmp_path / "g.png"
    ours = generate(out, prompts=["item 1 of cluster 0"], n=2, steps=2, seed=3, out=str(picture)).output
    assert picture.exists() and len(ours.images) == 2
    pipe = DiffusionPipeline.from_pretrained(out, trust_remote_code=True)
    theirs = pipe("item 1 of cluster 0", num_inference_steps=2, num_images_per_prompt=2,
                  generator=torch.Generator().manual_seed(3), output_type="np").images  # fmt: skip
    assert len(theirs) == 2


def test_a_worker_of_pace_3_does_three_times_the_inner_steps_in_the_same_rounds(tmp_path):
    """diloco.pace (machines of different speeds): worker 1 at pace 3 trains 3 x steps, 3 x H a round, and meets
    worker 0 at every round: both apply the same decisions and end with the same model."""
    root = RunRoot(str(tmp_path / "run"))
    diloco_run(root, steps=4, sync_every=2, pace=[1, 3])
    done = run_workers(root)
    assert [done[w].step for w in (0, 1)] == [4, 12]
    reports = [read_status(root, diloco_worker(w)).diloco for w in (0, 1)]
    assert [r["sync_every"] for r in reports] == [2, 6] and [r["rounds"] for r in reports] == [2, 2]
    for r in (0, 1):  # every round decided with both workers: neither waited the other out
        assert json.loads(root.read_bytes(*diloco_round(r), DILOCO_DECISION))["workers"] == [0, 1]
    a0, a1 = final_weights(root, 0), final_weights(root, 1)
    assert all(torch.equal(a0[k], a1[k]) for k in a0)


def test_a_pace_for_other_workers_is_refused_naming_it():
    raw = synthetic_config(k=2, steps=2, batch=4).to_dict()
    raw["diloco"] = {"workers": 2, "pace": [1, 2, 4]}
    with pytest.raises(ValueError, match="pace: 3 entries for 2 workers"):
        RunConfig.from_dict(raw)
