"""How a rank's end is told to the other ranks and to the launcher.

Two outlets:

- the store channel: an uncaught exception on a rank raises the job's alarm with that rank's
  error, so the other ranks (possibly blocked in a collective that will never complete) stop
  within one watchdog poll instead of waiting for the timeout;
- torchrun's error file (`TORCHELASTIC_ERROR_FILE`, one per worker, the file torch's `@record`
  writes): the traceback in torch's format, plus a `trident` entry saying what kind of end it
  was ("exception", "hang", "divergence", "preflight" are causes; "comm", "peer", "aborted" are
  consequences of another rank's end) and when, to the microsecond. `trident launch` reads
  these entries to name the rank that failed first.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
import traceback
from typing import Any

# Exit status of a rank stopped by the hang detector or by another rank's failure.
ABORT_EXIT_CODE = 3
CAUSES = ("exception", "hang", "divergence", "preflight")


class OneLineError(RuntimeError):
    """An error about the job's set-up that every rank detects alike: the failure hook prints
    its message once (on the rank where `quiet` is False) and no traceback."""

    def __init__(self, message: str, quiet: bool = False) -> None:
        super().__init__(message)
        self.quiet = quiet


def write_error_file(kind: str, message: str, rank: int, details: dict[str, Any] | None = None,
                     callstack: str = "") -> None:
    """Write torchrun's per-worker error file (when running under torchrun)."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")  # set by torchrun for each worker
    if not path:
        return
    now = time.time()
    data = {"message": {"message": message,
                        "extraInfo": {"py_callstack": callstack, "timestamp": str(int(now))}},
            "trident": {"kind": kind, "rank": rank, "time": now, "host": socket.gethostname(), **(details or {})}}
    try:
        tmp = f"{path}.tmp"
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except OSError:
        pass


def flush_and_exit(code: int) -> None:
    """End the process now, from any thread (the main thread may be stuck in a collective)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def error_summary(exc: BaseException) -> str:
    """'RuntimeError: first line of the message'."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


class FailureHook:
    """sys.excepthook for a rank of a multi-process job: print, tell the others, record."""

    def __init__(self, rank: int, announce, is_comm_error) -> None:
        self.rank = rank
        self.announce = announce            # callable(summary) raising the job's alarm
        self.is_comm_error = is_comm_error  # callable(exc): raised by a collective whose peer died
        self.previous = sys.excepthook

    def __call__(self, exc_type, exc, tb) -> None:
        if isinstance(exc, OneLineError):
            if not exc.quiet:
                print(str(exc), file=sys.stderr, flush=True)
            kind = "preflight"
        else:
            self.previous(exc_type, exc, tb)
            kind = "comm" if self.is_comm_error(exc) else "exception"
        summary = error_summary(exc)
        self.announce(summary)
        write_error_file(kind, summary, self.rank, {"error": summary},
                         "".join(traceback.format_exception(exc_type, exc, tb)))
