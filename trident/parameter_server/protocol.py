"""What parameter servers and workers say to each other: message kinds, headers, tags, records.

Every exchange is a small float64 header, optionally followed by a flat fp32 payload on its own
tag. Tags keep the streams apart, so a worker can send gradient buckets during backward, before
the header that announces them, and the server's pre-posted bucket receives take them at once:

    worker -> server   UP     HELLO, PUSH, PULL, SAVE, LOAD, DONE, FAILED
                       GRAD   a PUSH's gradient buckets (one message per bucket)
                       BLOB   the checkpoint folder of a SAVE / LOAD, as utf-8 bytes
    server -> worker   DOWN   PARAMS, ACK, BYE, ABORT
                       PARAM  a PARAMS reply's flat fp32 shard
    server <-> server  PEER   NORM (squared gradient norm of a shard, for clipping), ABORT

Tags are offset by a per-run session number agreed at start-up, so two runs in one process
group (tests reuse process pools) never match each other's messages.

Versions. A shard's `version` counts the optimizer updates applied to it. A worker's `step` t
counts its pushes (its clock). A shard's `clock` is the smallest number of pushes it has applied
from any live worker: it holds every worker's updates from steps < clock. In async mode a worker
at step t may only compute on parameters whose clock is >= t - k (k = `parameter_server.staleness`)
and otherwise blocks until fresher parameters arrive; so every applied update has staleness
t - base_clock <= k, and k = 0 is bulk-synchronous (step t sees every step < t of every worker).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Sequence

import torch

HEADER_FIELDS = 8  # fixed fields before the per-param-group learning rates


class Kind(IntEnum):
    HELLO = 1
    PUSH = 2
    PULL = 3
    SAVE = 4
    LOAD = 5
    DONE = 6
    FAILED = 7
    PARAMS = 10
    ACK = 11
    BYE = 12
    ABORT = 13
    NORM = 20


class Reason(IntEnum):
    """Why a worker left training; carried by ABORT headers."""

    CONNECTION = 1   # its connection closed: the process died, or timed out and closed its connections
    SILENT = 2       # the server waited longer than distributed.timeout_s for its next message
    RAISED = 3       # its training script raised
    UNEVEN = 4       # it finished while others trained on (sync mode needs equal step counts)
    SERVER = 5       # another server stopped
    DROPPED = 6      # it was dropped earlier (async) and came back


REASON_TEXT = {
    Reason.CONNECTION: "its connection closed (the process died, or gave up waiting and closed it)",
    Reason.SILENT: "it sent nothing for longer than distributed.timeout_s",
    Reason.RAISED: "its training script raised an exception",
    Reason.UNEVEN: "it finished while other workers were still training (sync mode needs every worker to "
                   "take the same number of steps)",
    Reason.SERVER: "it stopped or its connection closed",
    Reason.DROPPED: "it had been dropped as lost and cannot rejoin",
}


@dataclass
class Header:
    """One control message. Field meanings by kind (unused fields are 0):

    PUSH: step, version / clock of the parameters the gradient came from, need = the clock the
    reply must have, value = gradient scale (async clipping). PARAMS: version, clock, step =
    the worker's step the reply answers. HELLO: count = layout fingerprint. SAVE / LOAD: count =
    path bytes, need = LOAD flags. DONE: step = steps taken. ABORT: need = the lost worker's
    index, step = its global rank, count = `Reason`. NORM: value = squared norm.
    """

    kind: int
    step: int = 0
    version: int = 0
    clock: int = 0
    need: int = 0
    value: float = 0.0
    count: int = 0
    spare: int = 0
    lrs: tuple[float, ...] = ()

    def encode(self, out: torch.Tensor) -> torch.Tensor:
        """Write into `out` (float64, HEADER_FIELDS + lr slots); integers below 2**53 are exact."""
        out.zero_()
        values = [float(getattr(self, f.name)) for f in fields(self)[:HEADER_FIELDS]]
        out[:HEADER_FIELDS] = torch.tensor(values, dtype=torch.float64)
        if self.lrs:
            out[HEADER_FIELDS:HEADER_FIELDS + len(self.lrs)] = torch.tensor(self.lrs, dtype=torch.float64)
        return out

    @classmethod
    def decode(cls, buf: torch.Tensor) -> Header:
        v = buf.tolist()
        ints = [x if i == 5 else int(x) for i, x in enumerate(v[:HEADER_FIELDS])]  # value may be inf / NaN
        return cls(kind=ints[0], step=ints[1], version=ints[2], clock=ints[3], need=ints[4],
                   value=float(v[5]), count=ints[6], spare=ints[7], lrs=tuple(v[HEADER_FIELDS:]))


def header_buffer(param_groups: int) -> torch.Tensor:
    return torch.zeros(HEADER_FIELDS + param_groups, dtype=torch.float64)


class Tags:
    """The tag of each stream in one run (see the module docstring)."""

    STREAMS = ("UP", "GRAD", "BLOB", "DOWN", "PARAM", "PEER")

    def __init__(self, session: int) -> None:
        if not 0 < session < 2 ** 27:
            raise ValueError(f"session must be in (0, 2**27), got {session}")
        base = session * 8
        self.UP, self.GRAD, self.BLOB, self.DOWN, self.PARAM, self.PEER = (base + i for i in range(6))


@dataclass(frozen=True)
class UpdateRecord:
    """One applied update of one shard: which worker step it came from and how stale it was."""

    server: int
    worker: int
    step: int
    base_version: int   # shard version of the parameters the gradient was computed from
    base_clock: int     # shard clock of those parameters
    version: int        # shard version the update was applied to
    clock: int          # shard clock when it was applied

    @property
    def staleness(self) -> int:
        """Steps of other workers the gradient may have missed: step - base_clock (<= k)."""
        return self.step - self.base_clock

    @property
    def delay(self) -> int:
        """Updates applied to the shard between reading the parameters and this update."""
        return self.version - self.base_version


def staleness_violations(records: Sequence[UpdateRecord], bound: int) -> list[UpdateRecord]:
    """The records whose staleness exceeds `bound` (none when the protocol holds)."""
    return [r for r in records if r.staleness > bound]


def format_updates(records: Sequence[UpdateRecord], limit: int | None = None) -> str:
    """The update log as an aligned table, plus per-worker totals (steps, max staleness, mean delay)."""
    head = ("server", "worker", "step", "base_version", "base_clock", "version", "clock", "staleness", "delay")
    rows = [head] + [tuple(str(x) for x in (r.server, r.worker, r.step, r.base_version, r.base_clock, r.version,
                                             r.clock, r.staleness, r.delay)) for r in records[:limit]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in rows]
    if limit is not None and len(records) > limit:
        lines.append(f"... {len(records) - limit} more")
    for worker in sorted({r.worker for r in records}):
        mine = [r for r in records if r.worker == worker]
        lines.append(f"worker {worker}: {len(mine)} updates, max staleness {max(r.staleness for r in mine)}, "
                     f"mean delay {sum(r.delay for r in mine) / len(mine):.2f}")
    return "\n".join(lines)


class ParameterServerError(RuntimeError):
    """Training under parameter_server cannot go on; the message says which rank failed and why."""


class WorkerLostError(ParameterServerError):
    """A worker left a sync-mode run (or every worker of an async run was lost)."""

    def __init__(self, message: str, worker: int, reason: Reason) -> None:
        super().__init__(message)
        self.worker, self.reason = worker, reason


def lost_message(index: int, global_rank: int, reason: Reason, detail: str = "") -> str:
    """`worker 1 (global rank 2) was lost: its connection closed (...)`; Reason.SERVER names a server."""
    who = "parameter server" if reason == Reason.SERVER else "worker"
    text = f"{who} {index} (global rank {global_rank}) was lost: {REASON_TEXT[Reason(reason)]}"
    return text + (f" [{detail}]" if detail else "")


SYNC_ADVICE = ("in sync mode every update needs every worker's gradient, so training stops on every rank; "
               "restart the job (from the last checkpoint: engine.load_checkpoint), or set "
               "parameter_server.mode = \"async\" to let the other workers go on without a lost one")
