"""`deepspeed.utils`' names a training script imports: `zero_to_fp32`, `RepeatingLoader`, `logger`,
`log_dist`, `log_dist_once`, `OnDevice`.

`RepeatingLoader` is trident's own (`trident.data.repeating_loader`: the pipeline engine uses it
too), under DeepSpeed's name here.
"""

from trident.data.repeating_loader import RepeatingLoader
from trident.deepspeed.utils import zero_to_fp32
from trident.deepspeed.utils.logging import OnDevice, log_dist, log_dist_once, logger

__all__ = ["OnDevice", "RepeatingLoader", "log_dist", "log_dist_once", "logger", "zero_to_fp32"]
