"""`deepspeed.utils`' names a training script imports: `zero_to_fp32`, `RepeatingLoader`, `logger`."""

from trident.monitor.log import logger
from trident.utils import zero_to_fp32
from trident.utils.repeating_loader import RepeatingLoader

__all__ = ["RepeatingLoader", "logger", "zero_to_fp32"]
