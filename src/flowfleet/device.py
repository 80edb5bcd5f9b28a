"""Device choice, in one place: what `--device auto|cpu|cuda|cuda:N` means for every stage and rank."""

from __future__ import annotations

import torch

from flowfleet.errors import FlowfleetError


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
        raise FlowfleetError(f"--device: {device} requested but CUDA is not available")
    if device == "cuda":
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    try:
        return torch.device(device)
    except RuntimeError:
        raise FlowfleetError(f"--device: unknown device {device!r} (expected cpu, cuda, cuda:N or auto)") from None
