"""`deepspeed.utils`' names, as `import trident as deepspeed` finds them (`trident.deepspeed.utils`)."""

from trident.deepspeed.utils import OnDevice, RepeatingLoader, log_dist, log_dist_once, logger
from trident.utils import zero_to_fp32

__all__ = ["OnDevice", "RepeatingLoader", "log_dist", "log_dist_once", "logger", "zero_to_fp32"]
