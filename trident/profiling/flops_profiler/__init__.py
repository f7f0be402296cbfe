"""`deepspeed.profiling.flops_profiler`: `FlopsProfiler`, `get_model_profile` and the number
formatters, from `trident.monitor.flops_profiler` and `trident.monitor.flops_report`."""

from trident.profiling.flops_profiler.profiler import (FlopsProfiler, duration_to_string, flops_to_string,
                                                       get_model_profile, macs_to_string, number_to_string,
                                                       params_to_string)

__all__ = ["FlopsProfiler", "duration_to_string", "flops_to_string", "get_model_profile", "macs_to_string",
           "number_to_string", "params_to_string"]
