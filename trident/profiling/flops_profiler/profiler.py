"""`deepspeed.profiling.flops_profiler.profiler`: the names DeepSpeed's module defines."""

from trident.monitor.flops_profiler import FlopsProfiler, get_model_profile
from trident.monitor.flops_report import (duration_to_string, flops_to_string, macs_to_string, number_to_string,
                                          params_to_string)

__all__ = ["FlopsProfiler", "duration_to_string", "flops_to_string", "get_model_profile", "macs_to_string",
           "number_to_string", "params_to_string"]
