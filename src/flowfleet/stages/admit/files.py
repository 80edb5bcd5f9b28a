"""Check 2, the files: safetensors and JSON only (nothing pickle-capable is read), every safetensors header checked
before a tensor is read; config.json a DiT's, its parameters counted from its numbers (flowfleet.models.flops: no
module is built) within the kit's cap as issued, before any weight is read; the weights the config's tensors, in an
allowed dtype, finite."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flowfleet.errors import validated
from flowfleet.layout import PACKAGE_EXPERT, PACKAGE_HELDOUT, PACKAGE_SAMPLE
from flowfleet.models.config import DiTConfig
from flowfleet.models.dit import DiTExpert
from flowfleet.models.files import WEIGHTS_NAME
from flowfleet.stages.admit.formats import FormatError, load_safetensors, safetensors_header
from flowfleet.stages.admit.refusal import Refused, refusing, shown
from flowfleet.stages.admit.signature import BYTES_PER_PARAM
from flowfleet.stages.kit import parameter_count

if TYPE_CHECKING:
    from flowfleet.stages.admit.gate import Gate

CONFIG = f"{PACKAGE_EXPERT}/config.json"
WEIGHTS = f"{PACKAGE_EXPERT}/{WEIGHTS_NAME}"
HEADER_SLACK = 1 << 20  # a weights file may exceed its tensors' bytes by at most this (its header)


def check_files(gate: Gate) -> None:
    files, kit = gate.sign.manifest.files, gate.sign.kit
    for rel in files:
        if not rel.endswith((".safetensors", ".json")):
            raise Refused("files", f"{shown(rel)}: not safetensors or JSON; a pickle-capable file is never read")
        if rel.endswith(".safetensors"):
            gate.reading = rel
            try:
                safetensors_header(gate.staged / rel)
            except FormatError as err:
                raise Refused("files", f"{rel}: {err}") from None
    for rel in (CONFIG, WEIGHTS):
        if rel not in files:
            raise Refused("files", f"{rel}: missing from the package")
    for rel in files:
        if rel not in (CONFIG, WEIGHTS, PACKAGE_SAMPLE, PACKAGE_HELDOUT):
            raise Refused("files", f"{shown(rel)}: not a file of an expert's package")
    raw = gate.json_file(CONFIG, "files")
    if isinstance(raw, dict):
        raw = {k: v for k, v in raw.items() if not k.startswith("_")}  # diffusers' _class_name, _diffusers_version
    cfg = validated(DiTConfig, raw, CONFIG, refusing("files"))
    params, cap = parameter_count(cfg), kit.max_params
    if params > cap:
        raise Refused("files", f"{CONFIG}: {params:,} parameters, over the kit's cap of {cap:,}")
    size = (gate.staged / WEIGHTS).stat().st_size
    if size > params * BYTES_PER_PARAM + HEADER_SLACK:
        raise Refused("files", f"{WEIGHTS}: {size:,} bytes, more than {params:,} parameters can take")
    gate.reading = WEIGHTS
    tensors, _ = load_safetensors(gate.staged / WEIGHTS)
    with torch.device("meta"):  # (its parameters are within the cap: cheap to lay out)
        expected = {k: tuple(v.shape) for k, v in DiTExpert.from_dit_config(cfg).state_dict().items()}
    for name in sorted(set(expected) | set(tensors)):
        got = tuple(tensors[name].shape) if name in tensors else None
        if got != expected.get(name):
            raise Refused(
                "files", f"{WEIGHTS}: tensor {shown(name)} is {got}, config.json makes it {expected.get(name)}"
            )
    for name, tensor in tensors.items():
        dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype not in kit.dtypes:
            raise Refused("files", f"{WEIGHTS}: tensor {shown(name)} is {dtype}; the kit takes {kit.dtypes}")
        if tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise Refused("files", f"{WEIGHTS}: tensor {shown(name)} holds NaN or inf")
    gate.expert_cfg, gate.tensors = cfg, tensors
