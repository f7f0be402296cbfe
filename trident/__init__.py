"""trident: train models too large or too slow for one device on torch.distributed.

Public API: `initialize` (DeepSpeed's signature) returns an `Engine`; `ParallelMesh` holds the
process groups of a (pp, dp, tp) layout; `load_config` parses a DeepSpeed-style JSON config;
`zero.Init` / `zero.GatheredParameters` build and edit partitioned models; the ZeRO checkpoint
consolidation functions carry DeepSpeed's names; `checkpointing` is activation checkpointing
(`configure`, `checkpoint`, `is_configured`, as `deepspeed.checkpointing`).

DeepSpeed scripts run with `import trident as deepspeed` (then `from deepspeed.x import y` follows
it too), or unmodified under `trident launch --as-deepspeed` / `trident.install_as_deepspeed()`:
DeepSpeed's package names are here (`trident.deepspeed.engine.surface.PACKAGE` lists them all; those
trident does not implement raise an error saying what to use), and `comm`, `pipe`, `ops.adam`,
`utils`, `zero`, `checkpointing`, `accelerator`, `runtime` carry DeepSpeed's module names (thin
layers over trident's own modules; the DeepSpeed dialect itself lives in `trident.deepspeed`).
"""

# Registrations, made when these are imported, before anything can load a config or a checkpoint:
# trident.optim's optimizer and scheduler rules and trident.deepspeed.config's DeepSpeed dialect
# (with the config loader), trident.deepspeed.checkpoint's importer (with the engine), the model
# families' adapters (trident.models); the GPT presets that `model.preset` names are registered below.
from trident import checkpointing, comm, hf, models, ops, optim, pipe, utils, zero
from trident.deepspeed import checkpoint as _deepspeed_checkpoint  # noqa: F401
from trident.deepspeed import config as _deepspeed_config  # noqa: F401
from trident.checkpointing import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint
from trident.comm import init_distributed
from trident.config import load_config
from trident.config.loader import register_model_presets
from trident.deepspeed.config import add_config_arguments
from trident.engine.build import initialize
from trident.engine.engine import Engine
from trident.parallel.mesh import ParallelMesh
from trident.version import __version__
from trident.deepspeed import hook as _deepspeed_hook
from trident.deepspeed.package import (  # noqa: F401  (deepspeed.engine.surface.PACKAGE lists them)
    ADAM_OPTIMIZER, DEEPSPEED_VERSION, LAMB_OPTIMIZER, MUON_OPTIMIZER, TORCH_DISTRIBUTED_DEFAULT_PORT, DeepSpeedConfig,
    DeepSpeedConfigError, DeepSpeedDataLoader, DeepSpeedEngine, DeepSpeedOptimizer, DeepSpeedOptimizerCallable,
    DeepSpeedSchedulerCallable, OnDevice, PipelineEngine, PipelineModule, __git_branch__, __git_hash__,
    __version_major__, __version_minor__, __version_patch__, accelerator, add_tuning_arguments, get_accelerator,
    git_branch, git_hash, install_as_deepspeed, is_compile_supported, load_ds_config, log_dist, logger, runtime,
    set_optimizer_flags, version)
from trident.deepspeed.package import missing as _missing

dist = comm  # DeepSpeed's `deepspeed.dist`: its comm module once initialize ran


def _gpt_presets():
    from trident.models.gpt import GPT_PRESETS  # imported only when a config names a preset

    return GPT_PRESETS


register_model_presets(_gpt_presets)  # config checks `model.preset` without importing the models
_deepspeed_hook.register_finder()  # `from deepspeed.x import y` follows `import trident as deepspeed`


def __getattr__(name: str):
    """DeepSpeed's package names trident does not implement: an error saying what to use instead."""
    raise _missing(name)

__all__ = ["initialize", "Engine", "ParallelMesh", "load_config", "zero", "checkpointing", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "__version__", "init_distributed", "add_config_arguments", "comm",
           "pipe", "ops", "utils", "hf", "install_as_deepspeed", "get_accelerator", "accelerator", "runtime"]
