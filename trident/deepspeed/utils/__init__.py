"""`deepspeed.utils`' names a training script imports: `zero_to_fp32`, `RepeatingLoader`, `logger`.

`RepeatingLoader` is trident's own (`trident.data.repeating_loader`: the pipeline engine uses it
too), under DeepSpeed's name here.
"""

from trident.data.repeating_loader import RepeatingLoader
from trident.deepspeed.utils import zero_to_fp32
from trident.monitor.log import logger

__all__ = ["RepeatingLoader", "logger", "zero_to_fp32"]
