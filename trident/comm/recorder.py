"""The flight recorder: the last N collective and point-to-point calls of this process.

Every call that trident's comm layer issues goes through `FlightRecorder.collective` or
`FlightRecorder.p2p` first. A call belongs to one or more *streams*, the sequences of calls
that must match across ranks:

- a collective belongs to the stream of its process group; its sequence number counts the
  calls on that group, so call #7 on group [0, 1] is the same call on every member;
- a send or recv belongs to the stream of its direction (`p2p 0->1`): send #3 from 0 to 1 is
  matched by recv #3 from 0 on rank 1.

When a call waits too long, comparing how far each rank got in the stuck call's stream says
which ranks reached it and which did not. The recorder itself only keeps records; the
watchdog (trident/diagnostics/watchdog.py) reads them from its own thread.

Why it is cheap: a call costs one dict lookup, a counter increment, one small object in a
preallocated ring, two clock reads and a walk up a couple of frames for the call site. Nothing
is formatted, published or hashed (outside strict mode) until a report is needed.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from typing import Any, Callable

import torch
import torch.distributed as dist

# Op names the comm layer records; their index is the op's code in strict-mode hashes.
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_list", "reduce_scatter",
       "all_to_all", "gather", "scatter", "barrier", "send", "recv", "exchange",
       "all_gather_object", "broadcast_object_list")
_OP_CODE = {op: i for i, op in enumerate(OPS)}
_DTYPE_CODE = {dt: i for i, dt in enumerate(
    (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
     torch.int8, torch.uint8, torch.bool, torch.complex64, torch.complex128))}

ISSUED, WAITING, DONE, FAILED = "issued", "waiting", "done", "failed"

# Files whose frames are skipped when looking for a call's site (the comm wrappers themselves).
_SKIP_FILES: set[str] = {__file__}


def skip_frames_of(filename: str) -> None:
    """Call sites are looked up above the frames of `filename` (the comm modules register here)."""
    _SKIP_FILES.add(filename)


class Stream:
    """Calls that must line up across `ranks`: one process group, or one p2p direction."""

    __slots__ = ("key", "ranks", "seq", "hash", "collective")

    def __init__(self, key: str, ranks: tuple[int, ...], collective: bool) -> None:
        self.key, self.ranks, self.collective = key, ranks, collective
        self.seq = 0
        self.hash = 0


class Record:
    """One call: what, on which streams at which sequence numbers, from where, and its state."""

    __slots__ = ("index", "op", "streams", "shape", "dtype", "code", "line", "t_issue", "t_wait",
                 "t_done", "state")

    def __init__(self, index: int, op: str, streams: tuple, tensor: torch.Tensor | None,
                 frame: Any, waiting: bool) -> None:
        self.index, self.op, self.streams = index, op, streams
        self.shape = tuple(tensor.shape) if tensor is not None else None
        self.dtype = tensor.dtype if tensor is not None else None
        self.code, self.line = frame.f_code, frame.f_lineno
        self.t_issue = time.monotonic()
        self.t_wait = self.t_issue if waiting else None
        self.t_done = None
        self.state = WAITING if waiting else ISSUED

    def describe(self, now: float) -> dict:
        """JSON-ready description, with times as seconds before `now`."""
        out = {"index": self.index, "op": self.op, "state": self.state,
               "streams": [[s.key, list(s.ranks), seq] for s, seq in self.streams],
               "shape": list(self.shape) if self.shape is not None else None,
               "dtype": str(self.dtype).replace("torch.", "") if self.dtype is not None else None,
               "site": f"{short_path(self.code.co_filename)}:{self.line} in {self.code.co_name}",
               "age": round(now - self.t_issue, 3)}
        if self.t_wait is not None and self.state in (WAITING, FAILED):
            out["waited"] = round(now - self.t_wait, 3)
        if self.t_done is not None:
            out["done_ago"] = round(now - self.t_done, 3)
        return out


def short_path(path: str) -> str:
    """trident/... for trident's own files, a path relative to the working directory for
    files under it, else the path as Python saw it."""
    marker = "/trident/"
    cut = path.rfind(marker)
    if cut >= 0 and "site-packages" not in path[cut:]:
        return path[cut + 1:]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


def _call_site() -> Any:
    frame = sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename in _SKIP_FILES:
        frame = frame.f_back
    return frame


class FlightRecorder:
    """This process's ring of the last `size` calls, its streams, and the calls being waited on.

    `strict_every` > 0 keeps a running hash of (op, element count, dtype) per collective
    stream and queues (stream, seq, hash) every `strict_every` calls for the watchdog to
    compare across ranks.
    """

    def __init__(self, size: int, rank: int, timeout_s: float, strict_every: int = 0) -> None:
        if size < 1:
            raise ValueError(f"distributed.flight_recorder_size must be >= 1, got {size}")
        self.rank = rank
        self.timeout_s = timeout_s
        self.strict_every = strict_every
        self.size = size
        self.ring: list[Record | None] = [None] * size
        self.count = 0
        self.streams: dict[str, Stream] = {}
        self._groups: dict[Any, Stream] = {}
        self.waiting: list[Record] = []
        self.checkpoints: deque = deque()
        # Called with (record, exception) when a recorded call raises; may not return (it ends
        # the job when the failure is a timeout or a peer's failure). Set by the watchdog.
        self.on_failure: Callable[[Record, BaseException], None] | None = None

    def resize(self, size: int) -> None:
        """Keep the newest records in a ring of `size`; streams and counters are kept."""
        if size < 1:
            raise ValueError(f"distributed.flight_recorder_size must be >= 1, got {size}")
        kept = self.records()[-size:]
        self.ring = [None] * size
        self.size = size
        for i, rec in enumerate(kept):
            self.ring[(self.count - len(kept) + i) % size] = rec

    # -- hot path --------------------------------------------------------------------------

    def collective(self, op: str, group: Any, tensor: torch.Tensor | None, waiting: bool,
                   exact: bool = True) -> Record:
        """Record a collective on `group`; `tensor` is its per-rank buffer (None for barrier).

        `waiting` is True for a blocking call (it waits from now on); an async call waits
        only inside `Handle.wait`. `exact` says every rank passes the same element count
        (all but all_to_all), so strict mode may hash it.
        """
        stream = self._groups.get(group)
        if stream is None:
            stream = self._group_stream(group)
        stream.seq += 1
        if self.strict_every:
            numel = tensor.numel() if tensor is not None and exact else -1
            dtype = _DTYPE_CODE.get(tensor.dtype, -1) if tensor is not None else -1
            stream.hash = hash((stream.hash, _OP_CODE[op], numel, dtype))
            if stream.seq % self.strict_every == 0:
                self.checkpoints.append((stream.key, stream.ranks, stream.seq, stream.hash))
        return self._push(op, ((stream, stream.seq),), tensor, waiting)

    def p2p(self, op: str, transfers: list[tuple[str, int]], tensor: torch.Tensor | None,
            waiting: bool) -> Record:
        """Record sends/recvs: `transfers` holds ("send" | "recv", peer's global rank) pairs."""
        streams = []
        for kind, peer in transfers:
            src, dst = (self.rank, peer) if kind == "send" else (peer, self.rank)
            key = f"p2p {src}->{dst}"
            stream = self.streams.get(key)
            if stream is None:
                stream = self.streams[key] = Stream(key, (src, dst), collective=False)
            stream.seq += 1
            streams.append((stream, stream.seq))
        return self._push(op, tuple(streams), tensor, waiting)

    def _push(self, op: str, streams: tuple, tensor: torch.Tensor | None, waiting: bool) -> Record:
        rec = Record(self.count, op, streams, tensor, _call_site(), waiting)
        self.ring[self.count % self.size] = rec
        self.count += 1
        if waiting:
            self.waiting.append(rec)
        return rec

    def wait_begin(self, rec: Record) -> None:
        """An async call's `Handle.wait` starts blocking."""
        if rec.state == ISSUED:
            rec.state, rec.t_wait = WAITING, time.monotonic()
            self.waiting.append(rec)

    def end(self, rec: Record) -> None:
        """The call completed on this rank."""
        rec.state, rec.t_done = DONE, time.monotonic()
        if rec in self.waiting:
            self.waiting.remove(rec)

    def failed(self, rec: Record, err: BaseException) -> None:
        """The call raised `err`; the failure handler may end the process from here."""
        if rec.t_wait is None:
            rec.t_wait = time.monotonic()
        rec.state = FAILED
        if self.on_failure is not None:
            self.on_failure(rec, err)
        if rec in self.waiting:
            self.waiting.remove(rec)

    # -- reading (any thread) --------------------------------------------------------------

    def _group_stream(self, group: Any) -> Stream:
        ranks = tuple(dist.get_process_group_ranks(group))
        key = f"group {group.group_name} {list(ranks)}"
        stream = self.streams.get(key)
        if stream is None:
            stream = self.streams[key] = Stream(key, ranks, collective=True)
        self._groups[group] = stream
        return stream

    def records(self) -> list[Record]:
        """The kept records, oldest first."""
        ring, count, size = list(self.ring), self.count, self.size
        start = max(0, count - size)
        return [r for r in (ring[i % size] for i in range(start, count)) if r is not None]

    def snapshot(self) -> dict:
        """Everything a hang report needs from this rank, JSON-ready."""
        now = time.monotonic()
        return {
            "rank": self.rank,
            "calls": self.count,
            "records": [r.describe(now) for r in self.records()],
            "waiting": [r.describe(now) for r in list(self.waiting)],
            "streams": {s.key: {"ranks": list(s.ranks), "seq": s.seq} for s in list(self.streams.values())},
        }

    def overdue(self, now: float) -> Record | None:
        """The longest-waiting call if it has waited past the timeout."""
        waiting = list(self.waiting)
        if not waiting:
            return None
        oldest = min(waiting, key=lambda r: r.t_wait or now)
        return oldest if now - (oldest.t_wait or now) > self.timeout_s else None


# The recorder of this process, or None when the hang detector is off. One per process: it
# describes what this rank's comm layer issued, whatever mesh or engine asked for it.
active: FlightRecorder | None = None
