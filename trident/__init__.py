"""trident: train models too large or too slow for one device on torch.distributed.

Public API: `initialize` (DeepSpeed's signature) returns an `Engine`; `ParallelMesh` holds the
process groups of a (pp, dp, tp) layout; `load_config` parses a DeepSpeed-style JSON config;
`zero.Init` / `zero.GatheredParameters` build and edit partitioned models; the ZeRO checkpoint
consolidation functions carry DeepSpeed's names; `checkpointing` is activation checkpointing
(`configure`, `checkpoint`, `is_configured`, as `deepspeed.checkpointing`).

DeepSpeed scripts run with `import trident as deepspeed`: `init_distributed` and
`add_config_arguments` are here, and `comm`, `pipe`, `ops.adam`, `utils.zero_to_fp32`, `zero`
and `checkpointing` carry DeepSpeed's module names (thin layers over trident's own modules).
"""

# trident.optim registers its optimizer and scheduler rules with the config loader when imported;
# importing it here, before anything can load a config, means `load_config` always has them.
from trident import checkpointing, comm, hf, models, ops, optim, pipe, utils, zero
from trident.checkpointing import get_fp32_state_dict_from_zero_checkpoint, load_state_dict_from_zero_checkpoint
from trident.comm import init_distributed
from trident.config import load_config
from trident.config.compat import add_config_arguments
from trident.engine.build import initialize
from trident.engine.engine import Engine
from trident.parallel.mesh import ParallelMesh

__version__ = "0.1.0"

__all__ = ["initialize", "Engine", "ParallelMesh", "load_config", "zero", "checkpointing", "get_fp32_state_dict_from_zero_checkpoint",
           "load_state_dict_from_zero_checkpoint", "__version__", "init_distributed", "add_config_arguments", "comm",
           "pipe", "ops", "utils", "hf"]
