"""`deepspeed.runtime.config`: `DeepSpeedConfigError` is trident's `ConfigError` (every problem of a
config, listed with its JSON path); `DeepSpeedConfig(config)` parses one the way initialize does."""

from __future__ import annotations

from typing import Any

from trident.config import ConfigError as DeepSpeedConfigError
from trident.config import TridentConfig, load_config

__all__ = ["DeepSpeedConfig", "DeepSpeedConfigError"]


def DeepSpeedConfig(config: str | dict, mpu: Any = None, mesh_device: Any = None) -> TridentConfig:  # noqa: N802
    """The parsed config (trident's `TridentConfig`: `cfg.train_batch_size`, `cfg.zero_optimization.stage`...)."""
    return load_config(config)
