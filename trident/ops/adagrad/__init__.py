"""`deepspeed.ops.adagrad`'s optimizer, as `import trident as deepspeed` finds it (`trident.deepspeed.ops.adagrad`)."""

from trident.deepspeed.ops.adagrad import DeepSpeedCPUAdagrad

__all__ = ["DeepSpeedCPUAdagrad"]
