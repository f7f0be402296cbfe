"""The `deepspeed` package's own names that `trident/__init__.py` adds to trident's, so that
`import trident as deepspeed` (and `import deepspeed` under `--as-deepspeed`) finds DeepSpeed's
whole module surface (`trident.deepspeed.engine.surface.PACKAGE`): the accelerator, the runtime
modules, DeepSpeed's class names for trident's engines and config, its constants and version
fields. `missing(name)` is the module-level `__getattr__` answer for the names trident does not
implement (an error saying what to use instead).
"""

from __future__ import annotations

from typing import Callable, Union

import torch

from trident.config import ConfigError as DeepSpeedConfigError
import trident.deepspeed.accelerator as accelerator
import trident.deepspeed.runtime as runtime
from trident.deepspeed.accelerator import get_accelerator
from trident.deepspeed.hook import install_as_deepspeed
from trident.deepspeed.pipe import PipelineModule
from trident.deepspeed.runtime.config import DeepSpeedConfig
from trident.deepspeed.runtime.dataloader import DeepSpeedDataLoader
from trident.deepspeed.runtime.engine import ADAM_OPTIMIZER, LAMB_OPTIMIZER, MUON_OPTIMIZER, DeepSpeedEngine
from trident.deepspeed.runtime.lr_schedules import add_tuning_arguments
from trident.deepspeed.runtime.pipe.engine import PipelineEngine
from trident.deepspeed.engine.surface import unsupported
from trident.deepspeed.utils.logging import OnDevice, log_dist, logger
from trident.optim.muon import flag_muon_params
from trident.version import __version__

DEEPSPEED_VERSION = "0.19.6"
"""The DeepSpeed release whose API (names, meanings, data order) trident follows."""

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
DeepSpeedOptimizer = torch.optim.Optimizer
DeepSpeedOptimizerCallable = Callable[..., torch.optim.Optimizer]
DeepSpeedSchedulerCallable = Callable[[torch.optim.Optimizer], Union[torch.optim.lr_scheduler.LRScheduler, object]]

version = __version__
git_hash = None
git_branch = None
__version_major__, __version_minor__, __version_patch__ = (int(p) for p in __version__.split(".")[:3])
__git_hash__ = git_hash
__git_branch__ = git_branch


def is_compile_supported() -> bool:
    """Whether torch.compile is available (trident's `compile` section uses it)."""
    return hasattr(torch, "compile")


def load_ds_config(config: str | dict) -> dict:
    """A DeepSpeed config file read as JSON (a dict is returned as it is), as DeepSpeed's `load_ds_config`."""
    from trident.config.loader import read_json
    return config if isinstance(config, dict) else read_json(config)


def set_optimizer_flags(config_class, model: torch.nn.Module) -> None:
    """DeepSpeed's tagging of the parameters Muon steps (`use_muon`) when the config's optimizer
    is Muon: matrices whose names hold neither "embed" nor "lm_head" (any case). A config-built
    Muon is tagged by trident.initialize itself, by `optimizer.params.exclude`."""
    optimizer = getattr(config_class, "optimizer", None)
    if optimizer is not None and optimizer.type.lower() == MUON_OPTIMIZER:
        flag_muon_params(model, ("(?i)embed", "(?i)lm_head"))


def missing(name: str):
    """The error for a `deepspeed` package name trident does not implement, else a plain AttributeError."""
    error = unsupported("deepspeed", name)
    return error if error is not None else AttributeError(f"module 'trident' has no attribute {name!r}")


__all__ = ["ADAM_OPTIMIZER", "DEEPSPEED_VERSION", "DeepSpeedConfig", "DeepSpeedConfigError", "DeepSpeedDataLoader",
           "DeepSpeedEngine", "DeepSpeedOptimizer", "DeepSpeedOptimizerCallable", "DeepSpeedSchedulerCallable",
           "LAMB_OPTIMIZER", "MUON_OPTIMIZER", "OnDevice", "PipelineEngine", "PipelineModule",
           "TORCH_DISTRIBUTED_DEFAULT_PORT", "accelerator", "add_tuning_arguments", "get_accelerator",
           "install_as_deepspeed", "is_compile_supported", "load_ds_config", "log_dist", "logger", "missing",
           "runtime", "version", "git_hash", "git_branch"]
