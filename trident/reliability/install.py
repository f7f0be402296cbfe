"""Switch the hang detector on or off for this process, as the config's `distributed` section says.

`configure` is called by `trident.initialize` once the mesh exists (every engine calls it; the
last call's settings win). The recorder, the watchdog thread and the failure hook are per
process, like the process group they watch: a second engine in the same process shares them,
and sequence numbers keep counting across engines because the groups are the same.
"""

from __future__ import annotations

import atexit
import faulthandler
import sys

import torch.distributed as dist

from trident.comm import recorder as flight
from trident.reliability.channel import Channel
from trident.reliability.failures import FailureHook
from trident.reliability.watchdog import Watchdog, poll_interval

# Strict mode compares running hashes every this many calls per group.
STRICT_EVERY = 16

_watchdog: Watchdog | None = None


def configure(distributed, mesh=None) -> flight.FlightRecorder | None:
    """Apply `distributed` (a DistributedConfig: timeout_s, hang_detector, flight_recorder_size,
    strict_collectives); returns the active recorder, or None when the detector is off.

    `mesh` is accepted for symmetry with the other set-up calls; the detector watches every
    group this process uses, whatever mesh it belongs to.
    """
    global _watchdog
    if not distributed.hang_detector:
        shutdown()
        return None
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    strict = STRICT_EVERY if distributed.strict_collectives else 0
    recorder = flight.active
    if recorder is None:
        recorder = flight.FlightRecorder(distributed.flight_recorder_size, rank, distributed.timeout_s, strict)
    else:
        if recorder.size != distributed.flight_recorder_size:
            recorder.resize(distributed.flight_recorder_size)
        recorder.timeout_s, recorder.strict_every = distributed.timeout_s, strict
    flight.active = recorder
    if world > 1:
        if _watchdog is None:
            _watchdog = Watchdog(recorder, Channel.open(), world, poll_interval(distributed.timeout_s))
            _watchdog.start()
            atexit.register(shutdown)
            _install_failure_hook(rank, _watchdog)
        else:
            _watchdog.poll_s = poll_interval(distributed.timeout_s)
    return recorder


def shutdown() -> None:
    """Stop recording and the watchdog (normal exit, or the detector switched off)."""
    global _watchdog
    if _watchdog is not None:
        _watchdog.stop()
        _watchdog = None
    flight.active = None
    if isinstance(sys.excepthook, FailureHook):
        sys.excepthook = sys.excepthook.previous


def _install_failure_hook(rank: int, watchdog: Watchdog) -> None:
    if not isinstance(sys.excepthook, FailureHook):
        sys.excepthook = FailureHook(rank, watchdog.announce_failure,
                                     lambda exc: exc is not None and exc is watchdog.comm_error)
    if not faulthandler.is_enabled():
        faulthandler.enable()  # a backend abort (SIGABRT) still shows every thread's Python stack
