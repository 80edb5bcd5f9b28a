"""Fréchet Inception Distance with torchmetrics, and reference statistics cached in the run root.

    fid = FID(FIDSettings(), device)
    ref = fid.reference(root, "data", lambda: batches_of_real_images, n=5000, fingerprint=...)
    fake = fid.statistics(batches_of_generated_images)
    fid.score(fake, ref)  # float

Images everywhere are float [B, C, H, W] in [-1, 1] (what `generate` and the latent decoder return);
they are quantised to uint8 once, by flowfleet.data.images.to_uint8 (as an image file would be, and as
prepare does for the clustering features).

Feature statistics are kept in torchmetrics' own state form (sum, sum of outer products, count, all
float64), so a cached reference plugs into `FrechetInceptionDistance` unchanged. The distance itself is
torchmetrics' formula (tests hold it to torchmetrics' value), evaluated in a symmetric form (see
`FeatureStats.cov_sqrt`), or through the set's own rows when it has fewer images than features (see
`frechet_distance`). The cache is `reports/fid_ref_<name>_<extractor>_n<N>.safetensors`;
its metadata records what it was computed from, and a mismatch recomputes it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

import safetensors.torch
import torch
from torch import nn
from tqdm.auto import tqdm

from flowfleet.data.images import to_uint8  # the one quantisation: [-1, 1] float -> uint8
from flowfleet.data.inception import EXTRACTORS, MIN_SIZE, STANDARD_SIZE, build_extractor
from flowfleet.errors import FlowfleetError
from flowfleet.layout import REPORTS
from flowfleet.storage import RunRoot

# --------------------------------------------------------------------------------------------------
#                                         Settings
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FIDSettings:
    """Which feature network, at what input size, in what batches. Validated on construction."""

    extractor: str = "default_1"  # or "torch-fidelity" (standard weights, when the user has them)
    weights: str | None = None  # a weights file for the extractor; None = the shipped / cached one
    resize: int = STANDARD_SIZE  # < 299 only with default_1: faster, comparable only at the same size
    batch_size: int = 50

    def __post_init__(self) -> None:
        if self.extractor not in EXTRACTORS:
            raise FlowfleetError(f"fid extractor: unknown {self.extractor!r} (expected one of {', '.join(EXTRACTORS)})")
        if not MIN_SIZE <= self.resize <= STANDARD_SIZE:
            raise FlowfleetError(f"fid resize: {self.resize} outside {MIN_SIZE}..{STANDARD_SIZE}")
        if self.batch_size < 1:
            raise FlowfleetError(f"fid batch_size: {self.batch_size} must be >= 1")

    @property
    def key(self) -> str:
        return f"{self.extractor}-{self.resize}"

    @property
    def standard(self) -> bool:
        """True when the numbers are comparable with published FIDs' feature network and input size."""
        return self.resize == STANDARD_SIZE


# --------------------------------------------------------------------------------------------------
#                                    Feature statistics
# --------------------------------------------------------------------------------------------------


@dataclass
class FeatureStats:
    """torchmetrics' FID state for one image set: sum [D], sum of outer products [D, D], count."""

    sum: torch.Tensor
    cov_sum: torch.Tensor
    n: int = 0
    meta: dict[str, str] = field(default_factory=dict)
    # the features themselves [n, D] while n < D (a small generated set), else None; never saved
    rows: torch.Tensor | None = field(default=None, repr=False, compare=False)
    _sqrt: tuple[int, torch.Tensor] | None = field(default=None, init=False, repr=False, compare=False)

    @classmethod
    def empty(cls, dim: int, meta: dict[str, str] | None = None) -> "FeatureStats":
        zeros = torch.zeros(dim, dtype=torch.float64), torch.zeros(dim, dim, dtype=torch.float64)
        return cls(*zeros, 0, dict(meta or {}), rows=torch.zeros(0, dim, dtype=torch.float64))

    def update(self, features: torch.Tensor) -> None:
        """Accumulate features [B, D], exactly as FrechetInceptionDistance.update does (and keep the rows
        while there are fewer than D of them)."""
        f = features.detach().to(device="cpu", dtype=torch.float64)  # [B, D]
        self.sum += f.sum(dim=0)
        self.cov_sum += f.t().mm(f)
        self.n += f.shape[0]
        if self.rows is not None:
            self.rows = torch.cat([self.rows, f]) if self.n < f.shape[1] else None

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / self.n  # [D]

    @property
    def cov(self) -> torch.Tensor:
        """Unbiased covariance [D, D] (torchmetrics' formula)."""
        mu = self.mean[None]
        return (self.cov_sum - self.n * mu.t().mm(mu)) / (self.n - 1)

    def cov_sqrt(self) -> torch.Tensor:
        """The symmetric square root S of the covariance [D, D], computed once per state (cached until
        update() adds features).

        Why by hand: torchmetrics takes tr sqrt(C1 C2) from the eigenvalues of the non-symmetric
        product C1 C2, about 5 s per model at D = 2048 on two CPU cores. The same trace is
        sum sqrt(eigvalsh(S C2 S)) with S = sqrt(C1): one eigendecomposition of the reference per
        evaluation, then one symmetric eigvalsh (~1 s) per generated set.
        """
        if self._sqrt is None or self._sqrt[0] != self.n:
            w, v = torch.linalg.eigh(self.cov)  # [D], [D, D]
            self._sqrt = (self.n, (v * w.clamp_min(0).sqrt()) @ v.t())
        return self._sqrt[1]

    # -- files --------------------------------------------------------------------------------------

    def to_bytes(self) -> bytes:
        tensors = {
            "sum": self.sum.contiguous(),
            "cov_sum": self.cov_sum.contiguous(),
            "n": torch.tensor([self.n], dtype=torch.int64),
        }
        return safetensors.torch.save(tensors, metadata={k: str(v) for k, v in self.meta.items()})

    @classmethod
    def from_bytes(cls, raw: bytes, where: str) -> "FeatureStats":
        try:
            tensors = safetensors.torch.load(raw)
            header_len = int.from_bytes(raw[:8], "little")
            meta = json.loads(raw[8 : 8 + header_len]).get("__metadata__", {}) or {}
            stats = cls(tensors["sum"].double(), tensors["cov_sum"].double(), int(tensors["n"][0]), meta)
        except Exception as err:  # safetensors' own error types, KeyError, JSON errors: all "unreadable"
            raise FlowfleetError(f"{where}: unreadable FID statistics ({str(err).splitlines()[0][:120]})") from None
        d = stats.sum.shape[0]
        if stats.cov_sum.shape != (d, d) or stats.n < 2:
            raise FlowfleetError(f"{where}: FID statistics with inconsistent shapes or fewer than 2 samples")
        return stats


# --------------------------------------------------------------------------------------------------
#                                          The metric
# --------------------------------------------------------------------------------------------------


class FID:
    """One feature network, used for every image set of an evaluation."""

    def __init__(
        self,
        settings: FIDSettings = FIDSettings(),
        device: torch.device | str = "cpu",
        extractor: nn.Module | None = None,
    ):
        self.settings = settings
        self.device = torch.device(device)
        # `extractor` lets tests and callers supply any uint8 -> [B, D] module (torchmetrics' contract).
        net = (
            extractor
            if extractor is not None
            else build_extractor(settings.extractor, weights=settings.weights, resize=settings.resize)
        )
        self.extractor = net.to(self.device).eval()
        # The key names the features in cache files and results; a supplied module never borrows Inception's.
        self.key = getattr(net, "key", None) or f"custom-{type(net).__name__}"
        dim = getattr(net, "num_features", None)
        if not isinstance(dim, int):
            raise ValueError(f"FID extractor {type(net).__name__}: needs an int `num_features` (its feature width)")
        self.dim = dim

    def features(self, images: torch.Tensor) -> torch.Tensor:
        """float images [B, C, H, W] in [-1, 1] -> features [B, D] (float32, on the CPU)."""
        with torch.inference_mode():
            return self.extractor(to_uint8(images).to(self.device)).float().cpu()

    def statistics(
        self,
        batches: Iterable[torch.Tensor],
        total: int | None = None,
        desc: str = "fid features",
        meta: dict[str, str] | None = None,
    ) -> FeatureStats:
        """Stream image batches through the extractor (in chunks of settings.batch_size)."""
        stats = FeatureStats.empty(self.dim, {"extractor": self.key, **(meta or {})})
        bs = self.settings.batch_size
        with tqdm(total=total, desc=desc, unit="img", leave=False) as bar:
            for batch in batches:
                for i in range(0, batch.shape[0], bs):
                    chunk = batch[i : i + bs]
                    stats.update(self.features(chunk))
                    bar.update(chunk.shape[0])
        if stats.n < 2:
            raise FlowfleetError(f"{desc}: FID needs at least 2 images, got {stats.n}")
        return stats

    def score(self, fake: FeatureStats, real: FeatureStats) -> float:
        """The Fréchet distance between the two states (torchmetrics' FrechetInceptionDistance.compute())."""
        for name, s in (("generated", fake), ("reference", real)):
            if s.n < 2:
                raise FlowfleetError(f"FID: the {name} set has {s.n} images; at least 2 are needed")
            if s.sum.shape[0] != self.dim:
                raise FlowfleetError(f"FID: the {name} statistics have {s.sum.shape[0]} features, expected {self.dim}")
        return frechet_distance(real, fake)

    # -- the cached reference ---------------------------------------------------------------------

    def reference_file(self, name: str, n: int) -> str:
        return f"fid_ref_{name}_{self.key}_n{n}.safetensors"

    def reference_from_features(
        self, root: RunRoot, name: str, features: Callable[[], Iterable[torch.Tensor]], n: int, fingerprint: str = ""
    ) -> FeatureStats:
        """As reference(), from features [B, D] that this extractor already computed (e.g. by prepare)."""
        return self.reference(root, name, features, n, fingerprint, are_features=True)

    def _compute(
        self,
        batches: Callable[[], Iterable[torch.Tensor]],
        n: int,
        name: str,
        meta: dict[str, str],
        are_features: bool = False,
    ) -> FeatureStats:
        if not are_features:
            return self.statistics(batches(), total=n, desc=f"fid reference ({name})", meta=meta)
        stats = FeatureStats.empty(self.dim, meta)
        for f in batches():
            if f.ndim != 2 or f.shape[1] != self.dim:
                raise FlowfleetError(
                    f"fid reference ({name}): features of shape {tuple(f.shape)}, expected [N, {self.dim}]"
                )
            stats.update(f)
        return stats

    def reference(
        self,
        root: RunRoot,
        name: str,
        images: Callable[[], Iterable[torch.Tensor]],
        n: int,
        fingerprint: str = "",
        are_features: bool = False,
    ) -> FeatureStats:
        """Statistics of n reference images, read from RUN_ROOT/reports/ when a matching cache exists.

        `images()` yields float batches in [-1, 1] totalling n (with are_features: feature batches
        [B, D] of this extractor); it is only called on a cache miss. `fingerprint` identifies the data
        (a changed dataset must not reuse old statistics).
        """
        path = (REPORTS, self.reference_file(name, n))
        meta = {"extractor": self.key, "name": name, "n": str(n), "fingerprint": fingerprint}
        if root.exists(*path):
            try:
                cached = FeatureStats.from_bytes(root.read_bytes(*path), root.url_of(*path))
            except FlowfleetError:
                cached = None  # a damaged cache is rebuilt below (and overwritten atomically)
            if cached is not None and all(cached.meta.get(k) == v for k, v in meta.items()) and cached.n == n:
                return cached
        stats = self._compute(images, n, name, meta, are_features)
        if stats.n != n:
            raise FlowfleetError(f"fid reference ({name}): expected {n} images, the source gave {stats.n}")
        root.write_bytes(stats.to_bytes(), *path)
        return stats


def frechet_distance(real: FeatureStats, fake: FeatureStats) -> float:
    """|mu_r - mu_f|^2 + tr(C_r) + tr(C_f) - 2 tr sqrt(C_r C_f). Eigenvalues >= 0 up to rounding are
    clamped, as torchmetrics' complex square root drops them.

    tr sqrt(C_r C_f) is taken from a symmetric matrix with the same nonzero eigenvalues as C_r C_f:
    S C_f S with S = sqrt(C_r) [D, D] in general; X C_r X^T / (n - 1) [n, n] when the generated set
    kept its n < D centred rows X (C_f = X^T X / (n - 1)), which needs no square root at all: an
    evaluation of a few hundred images at D = 2048 then costs milliseconds instead of seconds.
    """
    real_cov, fake_cov = real.cov, fake.cov
    if fake.rows is not None and fake.rows.shape[0] == fake.n:
        x = fake.rows - fake.mean  # [n, D]
        eig = torch.linalg.eigvalsh(x @ real_cov @ x.t() / (fake.n - 1))  # [n]
    else:
        s = real.cov_sqrt()
        eig = torch.linalg.eigvalsh(s @ fake_cov @ s)  # [D]
    diff = real.mean - fake.mean
    return float(diff.dot(diff) + real_cov.trace() + fake_cov.trace() - 2 * eig.clamp_min(0).sqrt().sum())


def fid_metadata(settings: FIDSettings, key: str, n_ref: int, n_fake: int) -> dict[str, Any]:
    """What a reader needs to compare two FIDs: same extractor, size and sample counts."""
    return {
        "extractor": key,
        "resize": settings.resize,
        "standard_input": settings.standard,
        "reference_images": n_ref,
        "generated_images": n_fake,
    }
