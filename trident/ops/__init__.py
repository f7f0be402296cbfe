"""`deepspeed.ops`' names, as `import trident as deepspeed` finds them (`trident.deepspeed.ops`)."""

from trident.ops import adagrad, adam

__all__ = ["adagrad", "adam"]
