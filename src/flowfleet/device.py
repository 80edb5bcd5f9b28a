"""Device choice, in one place: what `--device auto|cpu|cuda|cuda:N` means for every stage and rank, what a
device can do at most (its peak throughput, for a training job's MFU), and whether torch.compile can build kernels
for it."""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
import sys

import torch

from flowfleet.errors import FlowfleetError, ParameterError

log = logging.getLogger(__name__)


def resolve_device(device: str | None = "auto", local_rank: int = 0) -> torch.device:
    """'auto' (or None): this process's GPU when CUDA is available (local_rank's, round-robin over the
    visible GPUs, as torchrun numbers them), else the CPU; 'cuda': that GPU too (a rank of torchrun takes its
    own, never every rank the first). 'cpu', 'cuda', 'cuda:N' are checked: a one-line FlowfleetError when CUDA
    is asked for but absent, or the name is not a device."""
    if device is None or device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device("cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ParameterError("device", f"{device} requested but CUDA is not available")
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    try:
        return torch.device(device)
    except RuntimeError:
        raise ParameterError("device", f"unknown device {device!r} (expected cpu, cuda, cuda:N or auto)") from None


PEAK_TFLOPS_VARIABLE = "FLOWFLEET_PEAK_TFLOPS"  # a device's peak dense TFLOP/s as its owner states it (a CPU's too)
# Dense (no sparsity) tensor-core peaks of NVIDIA data-center GPUs from their data sheets, in TFLOP/s: (bf16 / fp16,
# fp32 as TF32, or plain fp32 where the GPU has no TF32). Matched against torch's device name, longest name first.
GPU_PEAK_TFLOPS: dict[str, tuple[float, float]] = {
    "H100 PCIe": (756.0, 378.0),
    "H200": (989.4, 494.7),
    "H100": (989.4, 494.7),
    "A100": (312.0, 156.0),
    "A40": (149.7, 74.8),
    "L40S": (362.05, 183.0),
    "L4": (121.0, 60.0),
    "V100": (125.0, 15.7),
    "T4": (65.0, 8.1),
}


def peak_flops(device: torch.device, precision: str) -> float | None:
    """The peak dense matrix throughput of one device in FLOP/s at a training precision ("fp32", "bf16", "fp16"):
    FLOWFLEET_PEAK_TFLOPS where set (any device, a CPU included), else an NVIDIA GPU's data-sheet figure by its name;
    None where neither says (a CPU, an unlisted GPU): its MFU is then not reported rather than guessed."""
    stated = os.environ.get(PEAK_TFLOPS_VARIABLE)
    if stated:
        try:
            value = float(stated)
        except ValueError:
            raise FlowfleetError(f"{PEAK_TFLOPS_VARIABLE}: expected a number of TFLOP/s, got {stated!r}") from None
        if value <= 0:
            raise FlowfleetError(f"{PEAK_TFLOPS_VARIABLE}: must be > 0, got {stated}")
        return value * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key in sorted(GPU_PEAK_TFLOPS, key=len, reverse=True):
        if key in name and not (key == "L4" and "L40" in name):
            half, full = GPU_PEAK_TFLOPS[key]
            return (full if precision == "fp32" else half) * 1e12
    return None


def peak_memory(device: torch.device) -> int:
    """The most memory this process has held, in bytes: on a GPU the caching allocator's peak of allocated tensors,
    on a CPU the process's peak resident set (Linux and macOS; 0 where the platform does not say)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        import resource
    except ImportError:  # (Windows)
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS says bytes, Linux KiB


def compiler_missing(device: torch.device) -> str | None:
    """What torch.compile's default backend (Inductor) lacks to build kernels for `device`, or None when it has it:
    a C++ compiler for a CPU (its CXX, else c++ / g++ / clang++ on the PATH), Triton for a GPU."""
    if device.type == "cuda":
        return None if importlib.util.find_spec("triton") is not None else "Triton (pip install triton)"
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    if any(shutil.which(name) for name in candidates):
        return None
    return f"a C++ compiler ({' / '.join(candidates)} not found)"


def compiled(module: torch.nn.Module, device: torch.device, who: str) -> torch.nn.Module:
    """torch.compile(module) where its backend can build kernels for `device`; else `module` itself, with a warning
    naming `who` (a job) and what is missing. The compiled wrapper shares the module's parameters: save the module."""
    missing = compiler_missing(device)
    if missing is not None:
        log.warning("%s: compile asked for, but torch.compile needs %s on %s; running eagerly", who, missing, device)
        return module
    return torch.compile(module)  # type: ignore[return-value]  # an OptimizedModule, which calls as the module does
