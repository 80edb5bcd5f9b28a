"""The CUDA paths on a machine with a GPU: `make test-gpu` (marker `gpu`).

The default suite deselects the marker (pyproject addopts) and hides the GPUs (tests/conftest.py); on a
machine without CUDA every test here fails saying so, rather than skipping. Each test asserts what the CPU
suite asserts of the same path, on the GPU: training learns in every precision (fp32, bf16 autocast, fp16
autocast with loss scaling) and saves fp32 weights that load on a CPU; a stopped job resumes to the bits of
an uninterrupted one (deterministic kernels); two ranks of DDP over NCCL give the weights of one GPU
accumulating their two micro-batches (on a machine with two GPUs; skipped, saying so, with one); train-all's jobs
run on the GPU; and a seed draws the same images on the GPU as on the CPU. The CPU comparisons run both sides in
fp32 with TF32 off, so their tolerance is fp32 rounding's (tests/fixtures/tolerances.py), the same bound the CPU
suite uses between two batchings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

# cuBLAS is deterministic only with a fixed workspace, which it reads when its first handle is made: set
# before any test in this process touches CUDA (collection imports this module before any test runs).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
from fixtures import synthetic_run  # noqa: E402
from fixtures.synthetic_run import synthetic_config, write_synthetic_run  # noqa: E402
from fixtures.tolerances import net_tol  # noqa: E402

from flowfleet.cli import main  # noqa: E402
from flowfleet.device import resolve_device  # noqa: E402
from flowfleet.models.dit import DiTExpert  # noqa: E402
from flowfleet.models.files import load_model  # noqa: E402
from flowfleet.sampling import FleetPipeline  # noqa: E402
from flowfleet.storage import RunRoot  # noqa: E402
from flowfleet.train.checkpoint import CheckpointStore  # noqa: E402
from flowfleet.train.loop import TrainOptions  # noqa: E402
from flowfleet.train.specs import JobSpec  # noqa: E402

pytestmark = pytest.mark.gpu

ON_GPU = TrainOptions(progress=False, device="cuda", heartbeat_every=0.2, tensorboard=False)


@pytest.fixture(autouse=True)
def exact_fp32():
    """Fail (not skip) without CUDA; TF32 off in matmuls and convolutions while a test runs."""
    if os.environ.get("FLOWFLEET_TEST_GPU") != "1":
        pytest.fail("marker gpu: the suite hides the GPUs unless FLOWFLEET_TEST_GPU=1; run `make test-gpu`")
    if not torch.cuda.is_available():
        pytest.fail("marker gpu: CUDA is not available here; run `make test-gpu` on a machine with a GPU")
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def make_run(path, **kw) -> RunRoot:
    root = RunRoot(path)
    write_synthetic_run(root, synthetic_config(**kw))
    return root


def run_job(root: RunRoot, spec: JobSpec, on_loss=None):
    return synthetic_run.run_job(root, spec, ON_GPU, on_loss)


def losses(job_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (job_dir / "metrics.jsonl").read_text().splitlines()]


def tensors(path) -> dict[str, torch.Tensor]:
    return safetensors.torch.load(path.read_bytes())


# ------------------------------------------------------------------------------------------------


def test_auto_is_this_processs_gpu():
    count = torch.cuda.device_count()
    assert resolve_device("auto") == torch.device("cuda", 0)
    assert resolve_device("auto", local_rank=count) == torch.device("cuda", 0)  # round-robin
    assert resolve_device("cuda:0") == torch.device("cuda", 0)


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_training_on_the_gpu_learns_in_every_precision_and_saves_fp32_for_the_cpu(tmp_path, precision):
    root = make_run(tmp_path / "r", k=2, steps=60, batch=16, train=dict(precision=precision, ema_decay=0.5))
    # the router: the CPU suite's test_router_learns_clusters_and_reports_accuracy_per_t_bucket, on the GPU
    assert run_job(root, JobSpec("router")).state == "done"
    report = json.loads((tmp_path / "r/router/report.json").read_text())
    assert report["accuracy"][0] > 0.9 > report["chance"] == 0.5
    # an expert: finite losses that fall, fp32 weights on disk that a CPU loads
    assert run_job(root, JobSpec("expert", 0)).state == "done"
    curve = losses(tmp_path / "r/experts/0")
    assert len(curve) == 60 and all(map(torch.isfinite, torch.tensor(curve)))
    assert sum(curve[-10:]) < 0.8 * sum(curve[:10]), curve
    saved = tensors(tmp_path / "r/experts/0/final/diffusion_pytorch_model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    model = load_model(DiTExpert, root, "experts/0", "final")
    assert next(model.parameters()).device.type == "cpu"


def test_stop_and_resume_on_the_gpu_is_bit_identical_to_an_uninterrupted_run(tmp_path):
    """The CPU suite's resume test, bf16 on the GPU, with torch's deterministic kernels."""
    kw = dict(steps=6, train=dict(precision="bf16", ema_decay=0.8, grad_accum=2, grad_clip=1.0, warmup_steps=2))
    torch.use_deterministic_algorithms(True)
    try:
        straight = make_run(tmp_path / "a", **kw)
        assert run_job(straight, JobSpec("expert", 0)).state == "done"
        resumed = make_run(tmp_path / "b", **kw)

        def sigterm_in_step_3(call, loss):  # grad_accum 2: calls 5 and 6 make step 3
            if call == 5:
                os.kill(os.getpid(), signal.SIGTERM)  # the real handler: finish the step, checkpoint, stop
            return loss

        stopped = run_job(resumed, JobSpec("expert", 0), on_loss=sigterm_in_step_3)
        assert (stopped.state, stopped.step) == ("stopped", 3)
        assert run_job(resumed, JobSpec("expert", 0)).state == "done"
    finally:
        torch.use_deterministic_algorithms(False)
    for name in ("model.safetensors", "ema.safetensors", "optimizer.safetensors"):
        a = tensors(tmp_path / "a/experts/0/checkpoints/step-0000006" / name)
        b = tensors(tmp_path / "b/experts/0/checkpoints/step-0000006" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[key], b[key]) for key in a), name
    assert losses(tmp_path / "a/experts/0") == losses(tmp_path / "b/experts/0")


def test_train_all_runs_every_job_on_the_gpu(tmp_path, capsys):
    root = make_run(tmp_path / "r", k=2, steps=6, monolith=True)
    assert main(["train-all", root.url_of(), "--no-progress", "--parallel", "2"]) == 0
    capsys.readouterr()
    for job in ("experts/0", "experts/1", "router", "monolith"):
        status = json.loads((tmp_path / "r" / job / "status.json").read_text())
        assert status["state"] == "done", (job, status)
        log = (tmp_path / "r" / job / "train.log").read_text()
        assert " on cuda:0 in fp32" in log, (job, log[-2000:])


DETERMINISTIC_CLI = """import sys, torch
torch.use_deterministic_algorithms(True)
from flowfleet.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_ddp_over_nccl_on_two_gpus_matches_accumulation_on_one(tmp_path):
    """The CPU suite's two gloo processes against one with grad_accum 2, over NCCL: two torchrun ranks of
    `--device cuda` (each its local GPU), 4 samples each, against one process on cuda:0 accumulating the same two
    micro-batches. Deterministic kernels on both sides; each micro-batch's gradient is the same computation on the
    same kind of GPU, and (a + b) / 2 = a / 2 + b / 2 exactly, so the weights are equal bit for bit."""
    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs; this machine has {torch.cuda.device_count()}")
    kw = dict(steps=3, batch=8)
    make_run(tmp_path / "ddp", **kw)
    script = tmp_path / "deterministic_cli.py"
    script.write_text(DETERMINISTIC_CLI)
    argv = ["train-expert", str(tmp_path / "ddp"), "--expert", "0", "--no-progress", "--device", "cuda"]
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(script), *argv],
        env=dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", CUBLAS_WORKSPACE_CONFIG=":4096:8"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    state = CheckpointStore(RunRoot(tmp_path / "ddp"), "experts/0").load("step-0000003").state
    assert state["world_size"] == 2
    one = make_run(tmp_path / "one", **kw, train=dict(grad_accum=2))
    torch.use_deterministic_algorithms(True)
    try:
        assert run_job(one, JobSpec("expert", 0)).state == "done"
    finally:
        torch.use_deterministic_algorithms(False)
    name = "experts/0/final/diffusion_pytorch_model.safetensors"
    a, b = tensors(tmp_path / "ddp" / name), tensors(tmp_path / "one" / name)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("strategy, guidance_max_t", [("full", 1.0), ("top2", 1.0), ("top2", 0.5)])
def test_a_seed_draws_the_same_images_on_the_gpu_as_on_the_cpu(model_dir, strategy, guidance_max_t):
    """FleetPipeline.noise draws on the CPU and moves the draw, so only rounding separates the two."""
    kw = dict(n=4, strategy=strategy, steps=3, guidance_scale=2.0, seed=11, guidance_max_t=guidance_max_t)
    cpu = FleetPipeline.from_pretrained(str(model_dir), device="cpu")(["a digit", "two small digits"], **kw)
    gpu = FleetPipeline.from_pretrained(str(model_dir), device="cuda")(["a digit", "two small digits"], **kw)
    assert torch.equal(torch.stack(cpu.trace.experts), torch.stack(gpu.trace.experts).cpu())
    # model_dir's fleet (tiny_run_config(3)): the 384-wide caption projection is its longest reduction,
    # ~8 roundings deep (tests/test_pipeline.py fleet_tol), over 3 sampler steps
    tol = net_tol(cpu.images, reduction=384, layers=8, steps=3)
    assert torch.allclose(gpu.images.cpu(), cpu.images, rtol=0, atol=tol)
    assert not torch.equal(gpu.images.cpu(), torch.zeros_like(cpu.images))
