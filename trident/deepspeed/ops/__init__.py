"""`deepspeed.ops`' names for the optimizers a DeepSpeed script imports (`adam`)."""

from trident.deepspeed.ops import adam

__all__ = ["adam"]
