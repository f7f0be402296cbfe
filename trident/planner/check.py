"""The old path of the planner's step-time check, kept for scripts that import it from here.

The check builds engines, so it lives above the engine in `trident.tools.planner_check`; the
planner itself is the analytic model only. Nothing inside trident imports this module.
"""

from trident.tools.planner_check import (LAYOUTS, MICRO, MODEL, STEPS_BEFORE_REPORT, TIMED, WARMUP, CheckLayout,
                                         calibrate_on_rank, compare, measure_layout, predict_layout, step_time_report)

__all__ = ["LAYOUTS", "MICRO", "MODEL", "STEPS_BEFORE_REPORT", "TIMED", "WARMUP", "CheckLayout", "calibrate_on_rank",
           "compare", "measure_layout", "predict_layout", "step_time_report"]
