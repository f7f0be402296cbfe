"""`deepspeed.ops`' names for the optimizers a DeepSpeed script imports (`trident.ops.adam`)."""

from trident.ops import adam

__all__ = ["adam"]
