"""`deepspeed.ops.adam`'s optimizers, as `import trident as deepspeed` finds them (`trident.deepspeed.ops.adam`)."""

from trident.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]
