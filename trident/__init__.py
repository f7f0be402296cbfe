"""trident: train models too large or too slow for one device on torch.distributed.

Public API: `initialize` (DeepSpeed's signature) returns an `Engine`; `ParallelMesh` holds the
process groups of a (pp, dp, tp) layout; `load_config` parses a DeepSpeed-style JSON config;
`zero.Init` / `zero.GatheredParameters` build and edit partitioned models; the ZeRO checkpoint
consolidation functions carry DeepSpeed's names; `checkpointing` is activation checkpointing
(`configure`, `checkpoint`, `is_configured`, as `deepspeed.checkpointing`).

DeepSpeed scripts run with `import trident as deepspeed`: `init_distributed` and
`add_config_arguments` are here, and `comm`, `pipe`, `ops.adam`, `utils.zero_to_fp32`, `zero`
and `checkpointing` carry DeepSpeed's module names (thin layers over trident's own modules; the
DeepSpeed dialect itself lives in `trident.deepspeed`).
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


def _gpt_presets():
    from trident.models.gpt import GPT_PRESETS  # imported only when a config names a preset

    return GPT_PRESETS


register_model_presets(_gpt_presets)  # config checks `model.preset` without importing the models

__all__ = ["initialize", "Engine", "ParallelMesh", "load_config", "zero", "checkpointing", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "__version__", "init_distributed", "add_config_arguments", "comm",
           "pipe", "ops", "utils", "hf"]
