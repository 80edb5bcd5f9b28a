"""The Slurm backend's scripts without a cluster: a run root on an object store submitted from a stage folder, a GPU
job's CPUs and threads, an expert over two nodes joined by torchrun's rendezvous, bad settings in one line. (A real
one-node cluster runs the jobs: tests/test_slurm.py.)"""

from __future__ import annotations

import pytest

from flowfleet.backends.slurm import SlurmBackend
from flowfleet.config import BackendConfig, RunConfig
from flowfleet.errors import FlowfleetError
from flowfleet.storage import RunRoot
from flowfleet.train.specs import JobSpec


def fake_sbatch(monkeypatch) -> list[tuple[str, tuple[str, ...]]]:
    """sbatch replaced: each call recorded as (script path, dependencies); ids 101, 102, ..."""
    calls: list[tuple[str, tuple[str, ...]]] = []

    def sbatch(self, path, dependency=()):
        calls.append((path, tuple(dependency)))
        return str(100 + len(calls))

    monkeypatch.setattr(SlurmBackend, "sbatch", sbatch)
    return calls


def test_an_object_store_run_root_is_submitted_from_a_stage_folder_the_nodes_share(s3_url, tmp_path, monkeypatch):
    root = RunRoot(f"{s3_url}/run")
    stage = tmp_path / "stage"
    backend = SlurmBackend(BackendConfig(kind="slurm", stage_dir=str(stage)))
    calls = fake_sbatch(monkeypatch)
    ids = backend.submit(root, [JobSpec("expert", 0), JobSpec("expert", 1), JobSpec("router")], "run")
    assert ids == {"expert-0": "101_0", "expert-1": "101_1", "router": "102", "assemble": "103"}
    assert calls == [
        (str(stage / "experts.sbatch"), ()),
        (str(stage / "router.sbatch"), ()),
        (str(stage / "assemble.sbatch"), ("101", "102")),
    ]
    for name in ("experts.sbatch", "router.sbatch", "assemble.sbatch"):
        staged = (stage / name).read_text()
        assert root.read_bytes("backends", "slurm", name).decode() == staged  # the run root keeps its copy
        assert f" {s3_url}/run" in staged.splitlines()[-1]  # the job reads and writes the run root itself
    experts = (stage / "experts.sbatch").read_text().splitlines()
    assert f"#SBATCH --output={stage}/experts/%a/train.log" in experts  # output on the stage, where Slurm can write
    assert all((stage / folder).is_dir() for folder in ("experts/0", "experts/1", "router", "backends/slurm"))
    # a lost expert comes back from the stage too, alone
    assert backend.resubmit(root, JobSpec("expert", 1), "run") == "104"
    assert calls[-1] == (str(stage / "expert-1.sbatch"), ())
    assert root.exists("backends", "slurm", "expert-1.sbatch")

    monkeypatch.setenv("FLOWFLEET_CACHE", str(tmp_path / "cache"))  # no stage_dir: one per run under the cache
    default = SlurmBackend(BackendConfig(kind="slurm")).stage(root)
    assert default.parent == tmp_path / "cache" / "slurm" and default != SlurmBackend().stage(RunRoot(f"{s3_url}/b"))


def test_a_gpu_job_asks_for_cpus_per_gpu_and_each_rank_runs_its_share_as_threads(tmp_path):
    root = RunRoot(str(tmp_path / "run"))

    def header(**kw) -> list[str]:
        return SlurmBackend(BackendConfig(kind="slurm", **kw)).job_script(root, JobSpec("router"), "run").splitlines()

    cpu = header()
    assert "#SBATCH --cpus-per-task=1" in cpu and "export OMP_NUM_THREADS=1" in cpu
    gpus = header(gpus_per_job=4)  # CPUS_PER_GPU each: 32, shared by the node's 4 ranks
    assert "#SBATCH --cpus-per-task=32" in gpus and "#SBATCH --gpus-per-task=4" in gpus
    assert "export OMP_NUM_THREADS=8" in gpus and "--nproc-per-node=4" in gpus[-1]
    stated = header(gpus_per_job=2, cpus_per_job=6)
    assert "#SBATCH --cpus-per-task=6" in stated and "export OMP_NUM_THREADS=3" in stated
    assert BackendConfig(kind="ray", gpus_per_job=2).threads_per_rank == 8  # Ray's job the same


def test_an_expert_over_two_nodes_runs_one_torchrun_a_node_joined_by_its_rendezvous(tmp_path, monkeypatch):
    from torch.distributed.run import get_args_parser

    config = BackendConfig(kind="slurm", gpus_per_job=4, nodes_per_job=2)
    script = SlurmBackend(config).expert_script(RunRoot(str(tmp_path / "run")), [0, 1], "run").splitlines()
    assert {"#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1", "#SBATCH --gpus-per-task=4"} <= set(script)
    assert "#SBATCH --array=0,1" in script and "export OMP_NUM_THREADS=8" in script
    exports = [line.removeprefix("export ") for line in script if line.startswith("export PET_")]
    assert exports == [
        'PET_NNODES="2"',
        'PET_NPROC_PER_NODE="4"',
        'PET_RDZV_BACKEND="c10d"',
        'PET_RDZV_ENDPOINT="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1):29500"',
        'PET_RDZV_ID="$SLURM_JOB_ID"',
    ]
    command = script[-1]
    assert command.startswith("exec srun --kill-on-bad-exit=1 ") and command.endswith(' "$SLURM_ARRAY_TASK_ID"')
    assert " -m torch.distributed.run -m flowfleet.cli train-expert " in command
    # what torchrun makes of them on a node whose job is 77 on nodes gpu-a and gpu-b
    for variable, value in (
        ("PET_NNODES", "2"),
        ("PET_NPROC_PER_NODE", "4"),
        ("PET_RDZV_BACKEND", "c10d"),
        ("PET_RDZV_ID", "77"),
        ("PET_RDZV_ENDPOINT", "gpu-a:29500"),
    ):
        monkeypatch.setenv(variable, value)
    args = get_args_parser().parse_args(["-m", "flowfleet.cli", "train-expert", "RUN", "--expert", "0"])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend, args.rdzv_id, args.rdzv_endpoint) == (
        "2",
        "4",
        "c10d",
        "77",
        "gpu-a:29500",
    )
    assert args.module and args.training_script == "flowfleet.cli"


def test_an_expert_over_two_cpu_nodes_runs_one_rank_a_node_with_the_nodes_cpus_as_threads(tmp_path):
    config = BackendConfig(kind="slurm", nodes_per_job=2, cpus_per_job=6)
    script = SlurmBackend(config).job_script(RunRoot(str(tmp_path / "run")), JobSpec("router"), "run").splitlines()
    assert {"#SBATCH --nodes=2", "#SBATCH --cpus-per-task=6", "export OMP_NUM_THREADS=6"} <= set(script)
    assert 'export PET_NPROC_PER_NODE="1"' in script and not any("--gpus" in line for line in script)
    assert " -m torch.distributed.run -m flowfleet.cli train-router " in script[-1]


@pytest.mark.parametrize(
    "backend, message",
    [
        ({"kind": "local", "nodes_per_job": 2}, "nodes_per_job: a slurm or ray option, but kind is 'local'"),
        ({"kind": "local", "stage_dir": "/x"}, "stage_dir: a slurm option, but kind is 'local'"),
    ],
)
def test_bad_slurm_settings_are_one_line_naming_the_backend(backend, message):
    from fixtures.synthetic_run import synthetic_config

    raw = synthetic_config(k=2).to_dict()
    raw["backends"] = {"campus": backend}
    with pytest.raises(FlowfleetError) as err:
        RunConfig.from_dict(raw, where="run.yaml")
    assert "backends.campus" in str(err.value) and message in str(err.value) and "\n" not in str(err.value)
