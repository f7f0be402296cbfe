"""`deepspeed.runtime.activation_checkpointing.checkpointing`: activation checkpointing (trident.recompute)."""

from trident.recompute.activation import checkpoint, configure, is_configured, reset

__all__ = ["checkpoint", "configure", "is_configured", "reset"]
