"""Shared test set-up: offline hub, small thread counts, deterministic torch."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# data.source mnist reads MNIST-5k in the suite, whether or not this machine fetched the 10,000 digits into its
# cache (`flowfleet fetch-data`): the tests of the 10,000 (tests/test_mnist_digits.py) make a set of their own.
os.environ["FLOWFLEET_CACHE"] = tempfile.mkdtemp(prefix="flowfleet-test-cache-")
# The default suite is the CPU suite, on any machine: with a GPU visible, every `--device auto` in it would move
# its CPU references onto the GPU. `make test-gpu` (FLOWFLEET_TEST_GPU=1, marker `gpu`: tests/test_gpu.py) keeps
# the GPUs. Set before anything initialises CUDA; the suite's child processes inherit it.
if os.environ.get("FLOWFLEET_TEST_GPU") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The thread policy reads the machine's load (flowfleet.threads); the suite's decisions and thread counts must not
# follow the load of the box it runs on (its own workers among it): the rule of workload and SMT alone, in the
# suite's processes and the commands they start. tests/test_threads.py gives the policy loads of its own.
os.environ["FLOWFLEET_THREADS"] = "static"

import pytest  # noqa: E402
import torch  # noqa: E402
from fixtures.processes import free_port  # noqa: E402

pytest_plugins = ["fixtures.contrib_world"]  # the tiny fleet experts from strangers are tried on (`world`, `run`)

# FLOWFLEET_TEST_THREADS fixes torch's thread count for the whole run, the `one_thread` tests included
# (`make test`'s portability pass runs the numerics tests at 1 and at 2 threads: a reduction split over
# threads is summed in another order). Without it, `make test` runs the suite on pytest-xdist workers
# (`--dist loadfile`: a module's tests share its module-scoped fixtures on one worker), one per core:
# each worker's torch gets its share of the cores, so that two workers on two cores do not fight over four.
FORCED_THREADS = int(os.environ.get("FLOWFLEET_TEST_THREADS", "0"))
if FORCED_THREADS:
    torch.set_num_threads(FORCED_THREADS)
elif os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# The numerics-sensitive tests: two computations equal in exact arithmetic compared within a derived
# tolerance (tests/fixtures/tolerances.py), or a promise of bit-identity. `make test` runs them a second
# time with torch's portable kernels (ATEN_CPU_CAPABILITY=default, MKL_CBWR=COMPATIBLE) at 1 and 2 threads.
NUMERICS = (
    "test_fid.py",  # FID / Fréchet distance paths against torchmetrics
    "test_flow.py",  # flow matching, ensemble decomposition, routing weights
    "test_pipeline.py",  # the fleet against the closed-form oracle and the dense ensemble
    "test_diagnostics.py",
    "test_mixed_experts.py",
    "test_parallel_dit.py",  # sync patch parallelism equals one process
    "test_parallel_unet.py",
    "test_parallel_transformers.py",
    "test_parallel_vae.py",
    "test_export.py",  # diffusers parity
    "test_distill.py",  # distill / reflow parity
    "test_train_loop.py",  # resume is bit-identical (one machine)
    "test_train_parts.py",
)


def pytest_collection_modifyitems(config, items):
    """Mark the fault-injection suite (tests/fault_cases.py) with `faults`, the files in NUMERICS with
    `numerics`."""
    from fault_cases import FAULT_CASES

    ids = {node for _, node, _ in FAULT_CASES}
    for item in items:  # a case without [params] covers every parametrization of its test
        if item.nodeid in ids or item.nodeid.split("[")[0] in ids:
            item.add_marker(pytest.mark.faults)
        if item.nodeid.split("::")[0].rsplit("/", 1)[-1] in NUMERICS:
            item.add_marker(pytest.mark.numerics)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and a 2-core box shared with other processes contends badly
    with two; use with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(FORCED_THREADS or 1)
    yield
    torch.set_num_threads(before)


def pytest_sessionstart(session):
    """FLOWFLEET_EXPECT_DIFFUSERS (make test's run against the oldest supported diffusers): make sure that
    release, not the venv's, is the one imported."""
    expected = os.environ.get("FLOWFLEET_EXPECT_DIFFUSERS")
    if expected:
        import diffusers

        assert diffusers.__version__ == expected, f"diffusers {diffusers.__version__} imported, {expected} expected"


@pytest.fixture
def run_root(tmp_path):
    """An empty local run-root folder."""
    path = tmp_path / "run"
    path.mkdir()
    return path


@pytest.fixture
def model_dir(run_root, monkeypatch):
    """An assembled random 3-expert fleet in run_root/model; opening it builds the hash text encoder
    (fixtures.random_fleet) instead of MiniLM."""
    from fixtures.random_fleet import HashTextEncoder, tiny_run_config, write_random_fleet

    from flowfleet.cli import main

    monkeypatch.setattr(
        "flowfleet.sampling.pipeline.build_text_encoder_from",
        lambda index, device: HashTextEncoder(index.text_width, index.text_len),
    )
    write_random_fleet(str(run_root), tiny_run_config(3))
    assert main(["assemble", str(run_root)]) == 0
    return run_root / "model"


@pytest.fixture(scope="session")
def s3_endpoint():
    """A moto S3 server on 127.0.0.1 for the session; yields its endpoint URL."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_url(s3_endpoint, monkeypatch, request):
    """A fresh bucket on the moto server; AWS_ENDPOINT_URL points every RunRoot at it."""
    import s3fs

    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    bucket = "ff-" + request.node.name.lower().replace("_", "-").replace("[", "-").replace("]", "")[:40]
    fs = s3fs.S3FileSystem(endpoint_url=s3_endpoint)
    fs.mkdir(bucket)
    yield f"s3://{bucket}"
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.fixture(scope="session")
def digit_classifier(tmp_path_factory):
    """The MNIST digit classifier of flowfleet.evaluate.digits, trained once per test run (~40 s on two
    cores) in a run root that every xdist worker shares: the first worker to need it trains it under a
    file lock, the others wait for it and load it (xdist's recipe for a session fixture run once).
    Returns that RunRoot; `install_digit_classifier(src, run_root_path)` copies its files into another
    run root so evaluate there finds it cached."""
    from filelock import FileLock

    from flowfleet.evaluate.digits import DigitJudge
    from flowfleet.storage import RunRoot

    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):  # each worker's base is a folder of the run's own base
        shared = shared.parent
    root = RunRoot(str(shared / "digit-classifier"))
    with FileLock(str(shared / "digit-classifier.lock")):
        DigitJudge.load_or_train(root, progress=False)  # trained by the first, cached for the others
    return root


def install_digit_classifier(src, dest) -> None:
    """Copy a trained digit classifier (src: RunRoot) into the run root folder `dest` (a path)."""
    import shutil
    from pathlib import Path

    from flowfleet.evaluate.digits import FOLDER

    target = Path(dest, *FOLDER)
    shutil.copytree(Path(src.url_of(*FOLDER)), target, dirs_exist_ok=True)
