"""The out-of-band channel: the rendezvous key-value store, used when collectives cannot be.

When a collective hangs, the ranks cannot use collectives to tell each other so. They can
still reach the c10d store the process group was created from (hosted by torchrun's agent, or
by rank 0's process: under `trident launch`, which gives every restart a fresh store, and under
a plain env:// start). Each rank opens its own connection to it (a clone, so the
watchdog thread never queues behind a blocked store call of the main thread) and uses keys
under `trident/diagnostics/<restart count>/`:

  alarm                counter; > 0 means "the job is stopping: publish your state"
  alarm/info           JSON of the first alarm: {"kind": "hang" | "divergence" | "failure", ...}
  reporters            counter that elects the one rank that prints the report
  state/<rank>         JSON of that rank's flight-recorder snapshot
  report/done          set once the report is printed; the other ranks exit after it
  acks                 counter of ranks done with the store (rank 0, which may host it, leaves last)
  strict/<stream>/<seq>/<rank>   strict mode: that rank's running hash at that call
  preflight/<n>/<rank>           preflight round n: what each rank sees (config hash, world size, ...)

Keys also carry torchrun's restart count: when the agent keeps one store across restarts,
the alarm of a failed attempt must not stop the next one.
"""

from __future__ import annotations

import json
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

PREFIX = "trident/diagnostics"
# A store call that takes longer than this means the store's host is gone.
STORE_TIMEOUT_S = 10.0


class Channel:
    """JSON messages between ranks through the c10d store. Every method swallows store errors
    (a gone store host must not turn a report into a second traceback) and returns a neutral
    value instead."""

    def __init__(self, store: dist.Store, rank: int, world_size: int) -> None:
        self.store, self.rank, self.world_size = store, rank, world_size

    @classmethod
    def open(cls) -> Channel | None:
        """A private connection to the default process group's store; None without one."""
        if not dist.is_initialized():
            return None
        try:
            base = dist.distributed_c10d._get_default_store().clone()
            base.set_timeout(timedelta(seconds=STORE_TIMEOUT_S))
        except (AttributeError, RuntimeError, ValueError):
            return None
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # set by torchrun per restart
        return cls(dist.PrefixStore(f"{PREFIX}/{attempt}", base), dist.get_rank(), dist.get_world_size())

    def counter(self, key: str, by: int = 0) -> int:
        """Add `by` to the counter `key` and return its value (0 if the store is unreachable)."""
        try:
            return int(self.store.add(key, by))
        except (RuntimeError, ValueError):
            return 0

    def put(self, key: str, value: Any) -> None:
        try:
            self.store.set(key, json.dumps(value))
        except (RuntimeError, ValueError):
            pass

    def get(self, key: str) -> Any:
        """The JSON value at `key`, or None if it is not (yet) there."""
        try:
            if not self.store.check([key]):
                return None
            return json.loads(self.store.get(key))
        except (RuntimeError, ValueError):
            return None

    def has(self, keys: list[str]) -> bool:
        try:
            return bool(self.store.check(keys))
        except (RuntimeError, ValueError):
            return False

    def delete(self, key: str) -> None:
        try:
            self.store.delete_key(key)
        except (RuntimeError, ValueError):
            pass

    def collect(self, keys: dict[int, str], deadline: float, poll_s: float = 0.05) -> dict[int, Any]:
        """The JSON values of `keys` (rank -> key) that appear before `deadline` (monotonic)."""
        found: dict[int, Any] = {}
        while True:
            for rank, key in keys.items():
                if rank not in found:
                    value = self.get(key)
                    if value is not None:
                        found[rank] = value
            if len(found) == len(keys) or time.monotonic() >= deadline:
                return found
            time.sleep(poll_s)
