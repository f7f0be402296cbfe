"""The old home of the hang detector, failure propagation and preflight: its public names, kept
for scripts that import them from here. The code is in `trident.reliability` (run time) and
`trident.tools` (`trident verify`, the GPU check); import from there."""

from trident.reliability import (ABORT_EXIT_CODE, FlightRecorder, OneLineError, active_recorder, configure, preflight,
                                 shutdown)

__all__ = ["ABORT_EXIT_CODE", "FlightRecorder", "OneLineError", "active_recorder", "configure", "preflight",
           "shutdown"]
