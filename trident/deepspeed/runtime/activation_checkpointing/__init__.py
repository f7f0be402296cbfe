"""`deepspeed.runtime.activation_checkpointing`: `checkpointing` (trident.checkpointing's
`configure`, `checkpoint`, `is_configured`)."""

from trident.deepspeed.runtime.activation_checkpointing import checkpointing

__all__ = ["checkpointing"]
