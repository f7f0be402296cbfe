"""`deepspeed.ops`' names, as `import trident as deepspeed` finds them (`trident.deepspeed.ops`)."""

from trident.ops import adam

__all__ = ["adam"]
