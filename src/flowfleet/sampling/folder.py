"""An assembled model folder opened for sampling: its files checked before anything samples (every listed expert
present and of the fleet's latent shape, every weight file its SHA256SUMS line, the router's outputs the fleet's
K), the router loaded, the experts behind an ExpertStore that loads each when first selected."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from flowfleet.errors import FlowfleetError
from flowfleet.layout import INDEX_FILE
from flowfleet.models.files import load_model, read_dit_config
from flowfleet.sampling.checksums import verify_weights
from flowfleet.sampling.index import ModelIndex, expert_folder, read_model_index
from flowfleet.sampling.store import ExpertStore
from flowfleet.storage import RunRoot


@dataclass(frozen=True)
class OpenedFolder:
    root: RunRoot
    index: ModelIndex
    experts: ExpertStore
    router: Any  # a DiTRouter on the device, or None for a one-expert model (the monolith)


def open_folder(model_dir: str, device: torch.device | str, offload: int | None) -> OpenedFolder:
    """Check and open a model folder: a one-line error naming the file at fault, before any sampling."""
    from flowfleet.models.dit import DiTExpert, DiTRouter

    root = RunRoot(model_dir)
    index = read_model_index(root)
    c, h, w = index.latent_shape
    for k in index.present_experts:  # fail now, not when the router first selects a broken expert
        folder = expert_folder(k)
        if not root.exists(folder):
            raise FlowfleetError(f"{root.url_of(folder)}: missing (model_index.json lists expert {k})")
        cfg = read_dit_config(root, folder)
        if (cfg.in_channels, *cfg.input_size) != (c, h, w):
            shape = (cfg.in_channels, *cfg.input_size)
            raise FlowfleetError(
                f"{root.url_of(folder)}: expert {k} denoises {shape}, model_index.json says latent_shape {(c, h, w)}"
            )
    verify_weights(root)  # SHA256SUMS: a corrupted expert is an error now, not different images later
    router = None
    if tuple(index.router) == (None, None):  # a one-expert model (the monolith): nothing to route
        if index.num_experts != 1:
            raise FlowfleetError(f"{root.url_of(INDEX_FILE)}: no router for {index.num_experts} experts")
    elif not root.exists("router"):
        raise FlowfleetError(f"{root.url_of('router')}: missing (the fleet's router)")
    else:
        router = load_model(DiTRouter, root, "router").to(device)
    if router is not None and router.cfg.num_outputs != index.num_experts:
        raise FlowfleetError(
            f"{root.url_of('router')}: num_outputs {router.cfg.num_outputs} differs from "
            f"the fleet's K = {index.num_experts}"
        )

    def load_expert(k: int) -> DiTExpert:
        return load_model(DiTExpert, root, expert_folder(k)).to(device)

    store = ExpertStore(load_expert, index.present_experts, index.num_experts, offload)
    return OpenedFolder(root, index, store, router)
