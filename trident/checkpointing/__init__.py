"""Checkpoints and activation checkpointing.

- `state`: atomic sharded save/load with a manifest; `reshard`: load under any layout;
  `consolidate`: one plain state dict offline; `inspect`: what a checkpoint holds.
- activation checkpointing (`trident.recompute`, re-exported here under DeepSpeed's `configure` / `checkpoint` /
  `is_configured`), selective by module name.
"""

from trident.recompute.activation import (apply_activation_checkpointing, checkpoint, configure, is_configured,
                                              profile_timings, reset)
from trident.checkpointing.consolidate import (get_fp32_state_dict_from_zero_checkpoint,
                                               load_state_dict_from_zero_checkpoint)

__all__ = ["apply_activation_checkpointing", "checkpoint", "configure", "get_fp32_state_dict_from_zero_checkpoint",
           "is_configured", "load_state_dict_from_zero_checkpoint", "profile_timings", "reset"]
