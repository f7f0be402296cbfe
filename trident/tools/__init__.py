"""Offline tools that build engines to check or measure them, above everything they check:

- `verify`, `verify_compare`: `trident verify`, a layout against one process, step by step
- `gpu_check` (with `gpu_common`, `gpu_device`, `gpu_equivalence`) and `rank_launch`: the
  checks behind `trident doctor [--gpu]`, one process per rank
- `calibrate`: `trident plan --calibrate`, this machine measured for the planner
- `planner_check`: the planner's predicted step time against trident's own measured steps
  (`trident train`'s report, tests/distributed/test_planner_step_time.py)

Nothing below this package imports it; each module loads on first use.
"""
