"""trident's configuration: DeepSpeed-style JSON parsed once into typed, read-only sections.

`load_config` reads a path, dict or `TridentConfig` and reports every problem at once as a
`ConfigError`; `resolve_batch` turns the batch-size triangle into concrete sizes for a
data-parallel size; `fill_auto` fills Hugging Face's `"auto"` values from a `TrainingArguments`.
This package knows trident's own sections only: DeepSpeed's dialect (and `fill_auto`'s rules)
is `trident.deepspeed.config`, registered with `dialect` when `import trident` runs.
"""

from trident.config.batch import BatchSizes, batch_issues, resolve_batch
from trident.config.errors import ConfigError, ConfigIssue
from trident.config.hf_auto import fill_auto
from trident.config.loader import load_config
from trident.config.schema import (BF16Config, CommsLoggerConfig, CSVMonitorConfig, DataConfig, DistributedConfig,
                                   FP16Config, ModelConfig, OptimizerConfig, SchedulerConfig, TensorBoardConfig,
                                   TrainerConfig, TridentConfig, ZeroConfig)

__all__ = [
    "BatchSizes", "batch_issues", "resolve_batch", "ConfigError", "ConfigIssue", "fill_auto", "load_config",
    "BF16Config", "CommsLoggerConfig", "CSVMonitorConfig", "DataConfig", "DistributedConfig", "FP16Config",
    "ModelConfig", "OptimizerConfig", "SchedulerConfig", "TensorBoardConfig", "TrainerConfig", "TridentConfig",
    "ZeroConfig",
]
