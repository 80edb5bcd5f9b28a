"""Device choice (flowfleet.device) and the one-GPU-per-rank rule of NCCL, on any machine: CUDA is faked
where a test needs a GPU count. What a real GPU does is tests/test_gpu.py's (marker `gpu`)."""

from __future__ import annotations

import pytest
import torch

from flowfleet.device import peak_flops, peak_memory, resolve_device
from flowfleet.distributed import init_process_group
from flowfleet.errors import FlowfleetError


def fake_gpus(monkeypatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_auto_is_the_ranks_gpu_round_robin_else_the_cpu(monkeypatch):
    fake_gpus(monkeypatch, 0)
    assert resolve_device("auto") == resolve_device(None) == torch.device("cpu")
    fake_gpus(monkeypatch, 2)
    assert [resolve_device("auto", rank) for rank in range(3)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
        torch.device("cuda", 0),
    ]
    assert resolve_device("cpu") == torch.device("cpu") and resolve_device("cuda:1") == torch.device("cuda", 1)


def test_cuda_without_an_index_is_the_ranks_own_gpu_that_set_device_takes(monkeypatch):
    """`--device cuda` under torchrun: each rank its local GPU, with the index torch.cuda.set_device needs (a bare
    'cuda' device has none, and would put every rank on the first GPU)."""
    fake_gpus(monkeypatch, 2)
    assert [resolve_device("cuda", rank) for rank in range(3)] == [
        torch.device("cuda", 0),
        torch.device("cuda", 1),
        torch.device("cuda", 0),
    ]
    assert all(resolve_device("cuda", rank).index is not None for rank in range(2))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    chosen = []

    def joined(*args, **kwargs):  # the group formed: the rank's device was set before it
        raise RuntimeError("stop here")

    monkeypatch.setattr(torch.cuda, "set_device", lambda device: chosen.append(torch.device(device)))
    monkeypatch.setattr(torch.distributed, "init_process_group", joined)
    with pytest.raises(FlowfleetError, match="stop here"):
        init_process_group(1, 2, device="cuda", local_rank=1)
    assert chosen == [torch.device("cuda", 1)]


@pytest.mark.parametrize(
    "gpus, name, message",
    [
        (0, "cuda", "device: cuda requested but CUDA is not available"),
        (0, "cuda:1", "device: cuda:1 requested but CUDA is not available"),
        (1, "gpu", "device: unknown device 'gpu' (expected cpu, cuda, cuda:N or auto)"),
    ],
)
def test_a_device_that_is_not_there_is_a_one_line_error(monkeypatch, gpus, name, message):
    fake_gpus(monkeypatch, gpus)
    with pytest.raises(FlowfleetError) as err:
        resolve_device(name)
    assert str(err.value) == message


def test_more_ranks_on_a_node_than_gpus_is_a_one_line_error_before_nccl(monkeypatch):
    """NCCL refuses two ranks on one GPU only after the group forms, in a multi-line error; the check comes
    first and says what to do."""
    fake_gpus(monkeypatch, 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(torch.distributed, "init_process_group", lambda *a, **k: pytest.fail("joined a group"))
    with pytest.raises(FlowfleetError) as err:
        init_process_group(1, 2, device="auto", local_rank=1)
    assert str(err.value) == (
        "rank 1: 2 ranks on this node share 1 GPU(s), and NCCL needs one GPU per rank: start at most 1 per node, "
        "or pass --device cpu"
    )


@pytest.mark.parametrize(
    "name, precision, tflops",
    [
        ("NVIDIA H100 80GB HBM3", "bf16", 989.4),
        ("NVIDIA H100 PCIe", "bf16", 756.0),
        ("NVIDIA H200", "fp32", 494.7),
        ("NVIDIA A100-SXM4-80GB", "fp16", 312.0),
        ("NVIDIA A40", "bf16", 149.7),
        ("NVIDIA L40S", "bf16", 362.05),
        ("NVIDIA L4", "bf16", 121.0),
        ("Tesla V100-SXM2-16GB", "fp32", 15.7),
        ("NVIDIA GeForce RTX 4090", "bf16", None),  # not listed: no MFU rather than a guess
        ("NVIDIA L40", "bf16", None),  # (not the L4's)
    ],
)
def test_a_gpus_peak_is_its_data_sheets_at_the_training_precision(monkeypatch, name, precision, tflops):
    monkeypatch.delenv("FLOWFLEET_PEAK_TFLOPS", raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    peak = peak_flops(torch.device("cuda", 0), precision)
    assert peak == (None if tflops is None else tflops * 1e12)


def test_a_stated_peak_serves_any_device_and_a_cpu_has_none_otherwise(monkeypatch):
    monkeypatch.delenv("FLOWFLEET_PEAK_TFLOPS", raising=False)
    assert peak_flops(torch.device("cpu"), "fp32") is None
    monkeypatch.setenv("FLOWFLEET_PEAK_TFLOPS", "2.5")
    assert peak_flops(torch.device("cpu"), "fp32") == 2.5e12
    for bad, message in (("fast", "expected a number of TFLOP/s, got 'fast'"), ("0", "must be > 0, got 0")):
        monkeypatch.setenv("FLOWFLEET_PEAK_TFLOPS", bad)
        with pytest.raises(FlowfleetError, match=f"FLOWFLEET_PEAK_TFLOPS: {message}"):
            peak_flops(torch.device("cpu"), "fp32")
    held = torch.ones(64, 1024, 1024)  # 256 MiB held at once: the process's peak is at least that
    assert peak_memory(torch.device("cpu")) >= held.numel() * 4
