"""Activation checkpointing: recompute layers in backward instead of keeping their activations
(DeepSpeed's `configure` / `checkpoint` / `is_configured`), selective by module name.

Below the parallel packages (the pipeline recomputes its layers with it); `trident.checkpointing`
re-exports it under DeepSpeed's `deepspeed.checkpointing` names.
"""

from trident.recompute.activation import (apply_activation_checkpointing, checkpoint, configure, is_configured,
                                          profile_timings, reset)

__all__ = ["apply_activation_checkpointing", "checkpoint", "configure", "is_configured", "profile_timings", "reset"]
