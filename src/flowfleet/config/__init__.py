"""run.yaml: the whole run's typed, validated configuration, one module per concern (base: what a section is;
data: data, encoders, clusters; training: the jobs' training; sampling: how a fleet samples; fleet: what changes a
fleet after training; compute: backends, machines, storage; run: RunConfig, reading and changing it).

Every stage reads RunConfig from RUN_ROOT/run.yaml before doing any work; a bad key or value is one
line naming it (ConfigError). Derived facts (latent shape, text width) are checked here so that an
expert trained anywhere from the same run.yaml is compatible with every other.
"""

from flowfleet.config.base import ConfigError, Strict
from flowfleet.config.compute import BACKEND_KINDS, CPUS_PER_GPU, BackendConfig, MachineConfig, StorageConfig
from flowfleet.config.data import (
    AUGMENT_DIM,
    AugmentConfig,
    AutoencoderConfig,
    ClusterConfig,
    DataConfig,
    EncodersConfig,
    LatentEncoderConfig,
    SemanticEncoderConfig,
    TextEncoderConfig,
)
from flowfleet.config.fleet import EXPERT_OVERRIDABLE, Addition, Contribution, DistillConfig
from flowfleet.config.run import RunConfig, load_run_config, set_dotted
from flowfleet.config.sampling import SAMPLING_CHOICES, SamplingConfig, SamplingSettings, SettingError, StrategyField
from flowfleet.config.training import DiLoCoConfig, MonolithConfig, TrainConfig

__all__ = [
    "AUGMENT_DIM",
    "Addition",
    "AugmentConfig",
    "AutoencoderConfig",
    "BACKEND_KINDS",
    "BackendConfig",
    "CPUS_PER_GPU",
    "ClusterConfig",
    "ConfigError",
    "Contribution",
    "DataConfig",
    "DiLoCoConfig",
    "DistillConfig",
    "EXPERT_OVERRIDABLE",
    "EncodersConfig",
    "LatentEncoderConfig",
    "MachineConfig",
    "MonolithConfig",
    "RunConfig",
    "SAMPLING_CHOICES",
    "SamplingConfig",
    "SamplingSettings",
    "SemanticEncoderConfig",
    "SettingError",
    "StorageConfig",
    "Strict",
    "StrategyField",
    "TextEncoderConfig",
    "TrainConfig",
    "load_run_config",
    "set_dotted",
]
