"""`deepspeed.utils`' names, as `import trident as deepspeed` finds them (`trident.deepspeed.utils`)."""

from trident.deepspeed.utils import RepeatingLoader, logger
from trident.utils import zero_to_fp32

__all__ = ["RepeatingLoader", "logger", "zero_to_fp32"]
