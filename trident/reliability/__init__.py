"""Run-time reliability, what the engine calls while it trains: the hang detector, failure
propagation and preflight.

- `configure(cfg.distributed, mesh)`: turn the hang detector on (the default) or off for this
  process: every collective and point-to-point call is recorded in a per-rank flight recorder,
  and a watchdog thread turns a call stuck past `distributed.timeout_s`, a divergence found by
  strict mode, or another rank's uncaught exception into one report and a prompt stop.
- `preflight(cfg, mesh)`: before training, every rank checks that it sees the same config,
  world size and layout as the others, and that its groups work; a mismatch is one line.

The flight recorder itself lives in the comm layer (trident/comm/recorder.py), which records every
call into it; this package reads it. The offline tools that build engines to check them
(`trident verify`, the GPU check of `trident doctor`) are in `trident.tools`.
"""

from __future__ import annotations

from trident.comm.recorder import FlightRecorder
from trident.reliability.failures import ABORT_EXIT_CODE, OneLineError
from trident.reliability.install import configure, shutdown


def preflight(cfg, mesh=None) -> None:
    """Check, on every rank, that all ranks agree on the config, world size and layout and that
    their process groups work; raises PreflightError (one line) otherwise. Collective."""
    from trident.reliability.preflight_checks import run_preflight

    run_preflight(cfg, mesh)


def active_recorder() -> FlightRecorder | None:
    """This process's flight recorder, or None when the hang detector is off."""
    from trident.comm import recorder as flight

    return flight.active


__all__ = ["ABORT_EXIT_CODE", "FlightRecorder", "OneLineError", "active_recorder", "configure", "preflight",
           "shutdown"]
