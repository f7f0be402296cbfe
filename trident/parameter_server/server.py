"""The server loop: one thread per worker, one shard, sync rounds or async updates.

Each worker has a thread that blocks on that worker's next message (gloo has no polling, see
`transport`). What crosses the wire per step: the worker's gradient buckets (fp32, one message
per bucket, the server has the receives posted before they are sent, so they stream in during
the worker's backward), a PUSH header; back, a PARAMS header and the flat fp32 shard.

- sync: a worker's thread deposits its gradient and waits; the thread of the last worker of the
  round averages the gradients (in worker order), clips by the global norm (servers exchange
  squared norms), steps the optimizer and the schedule, and wakes the others, which reply.
- async: each thread applies its worker's gradient as it arrives (under the shard's lock), then
  holds the reply until the shard's clock reaches what the worker asked for (staleness bound).

A lost worker (its connection closed, its script raised, or it was silent past
`distributed.timeout_s`) is dropped in async mode. In sync mode it ends the run: every thread
answers its worker with ABORT naming the lost worker, peer servers get ABORT too, and `serve`
raises WorkerLostError.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trident.monitor.log import logger
from trident.optim.clipping import clip_coefficient
import trident.parameter_server.checkpoint as ckpt
from trident.parameter_server.layout import PSLayout
from trident.parameter_server.protocol import (SYNC_ADVICE, Header, Kind, ParameterServerError, Reason,
                                               UpdateRecord, WorkerLostError, header_buffer, lost_message)
from trident.parameter_server.shard import ShardState
from trident.parameter_server.transport import Endpoint, LinkError, Pending


@dataclass
class ServeResult:
    """What a server hands back when every worker has finished (or, in async mode, was lost)."""

    server: int
    records: list[UpdateRecord]
    parameters: dict[str, torch.Tensor]
    version: int
    clock: int
    worker_steps: dict[int, int]
    lost: dict[int, str]
    traffic: dict[str, int]


class _Abort(Exception):
    """Unwinds a worker's thread after the run failed (sync) or the worker was dropped."""


@dataclass
class _Slot:
    index: int
    rank: int
    grad: torch.Tensor
    header: torch.Tensor
    recvs: list[Pending] = field(default_factory=list)
    state: str = "live"            # live | done | lost
    steps: int = 0                 # pushes applied: this worker's clock
    awaiting_since: float | None = None
    finished: bool = False         # its thread has returned


class ParameterServer:
    """Serves one shard to every worker of `layout` until they are all done."""

    def __init__(self, layout: PSLayout, shard: ShardState, mode: str, clip: float) -> None:
        self.layout, self.shard, self.mode, self.clip = layout, shard, mode, clip
        self.index = layout.server_index
        self.tags = layout.tags
        self.endpoint = Endpoint(layout.group)
        self.timeout_s = layout.timeout_s
        self._cond = threading.Condition(threading.RLock())
        self.slots = [_Slot(i, r, torch.zeros(shard.numel), header_buffer(len(layout.param_groups)))
                      for i, r in enumerate(layout.worker_ranks)]
        self.records: list[UpdateRecord] = []
        self.lost: dict[int, str] = {}
        self._arrived: dict[int, Header] = {}
        self._loads: set[int] = set()
        self._pending_load: tuple[Path | None, int] = (None, 0)
        self._load_rounds = 0
        self._failure: tuple[int, int, Reason, str] | None = None   # worker, global rank, reason, detail
        self._failed_at = 0.0
        self._crash: BaseException | None = None
        self._last_norm = 0.0  # sync with clipping: the averaged gradient's global norm, for the workers

    # -- the loop --------------------------------------------------------------------------

    def serve(self) -> ServeResult:
        """Run until every worker is done or lost; raise if the run failed."""
        start = time.monotonic()
        for slot in self.slots:
            slot.awaiting_since = start
            threading.Thread(target=self._run, args=(slot,), name=f"ps{self.index}-worker{slot.index}",
                             daemon=True).start()
        tick = min(0.5, self.timeout_s / 20)  # how late a silent worker may be noticed
        with self._cond:
            while not self._finished():
                self._check_silence()
                self._cond.wait(tick)
        if self._crash is not None:
            raise self._crash
        if self._failure is not None:
            worker, rank, reason, detail = self._failure
            message = (f"parameter server {self.index} (global rank {self.layout.rank}): "
                       f"{lost_message(worker, rank, reason, detail)}; {SYNC_ADVICE}")
            if reason == Reason.SERVER:
                raise ParameterServerError(message)
            raise WorkerLostError(message, worker, reason)
        if len(self.lost) == len(self.slots):
            raise WorkerLostError(f"parameter server {self.index}: every worker was lost "
                                  f"({'; '.join(self.lost.values())}); nothing is left to train", 0, Reason.CONNECTION)
        return self._result()

    def _finished(self) -> bool:
        if self._crash is not None:
            return True
        if self._failure is not None:
            waiting = [s for s in self.slots if s.state != "lost" and not s.finished]
            return not waiting or time.monotonic() - self._failed_at > self.timeout_s
        # done workers' threads are still saying BYE; lost workers' may wait forever
        return all(s.state == "lost" or (s.state == "done" and s.finished) for s in self.slots)

    def _check_silence(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.state == "live" and slot.awaiting_since is not None and now - slot.awaiting_since > self.timeout_s:
                self._lose(slot, Reason.SILENT, f"nothing for {now - slot.awaiting_since:.1f} s, "
                                                f"distributed.timeout_s = {self.timeout_s:g}")

    def _run(self, slot: _Slot) -> None:
        try:
            self._post_grad_recvs(slot)
            while self._handle(slot, self._next_header(slot)):
                pass
        except LinkError as err:
            if err.peer in self.layout.server_ranks:
                self._fail(self.layout.server_ranks.index(err.peer), err.peer, Reason.SERVER, str(err))
            else:
                self._lose(slot, Reason.CONNECTION, str(err))
        except _Abort:
            self._send_abort(slot)
        except BaseException as err:  # a bug: stop serving and show it
            with self._cond:
                self._crash = self._crash or err
        finally:
            with self._cond:
                slot.finished = True
                self._cond.notify_all()

    def _next_header(self, slot: _Slot) -> Header:
        slot.awaiting_since = time.monotonic()
        self.endpoint.irecv(slot.header, slot.rank, self.tags.UP, "receiving a worker message").wait()
        slot.awaiting_since = None
        with self._cond:
            if slot.state == "lost" or self._failure is not None:
                raise _Abort
        return Header.decode(slot.header)

    def _handle(self, slot: _Slot, h: Header) -> bool:
        """Serve one message; False once the worker has left."""
        if h.kind == Kind.PUSH:
            for pending in slot.recvs:
                pending.wait()
            self._sync_push(slot, h) if self.mode == "sync" else self._async_push(slot, h)
        elif h.kind in (Kind.PULL, Kind.HELLO):
            self._reply_params(slot, h.step, need=0)
        elif h.kind == Kind.SAVE:
            self._save(slot, self._recv_path(slot, h))
        elif h.kind == Kind.LOAD:  # without a path: a barrier over the workers
            self._load(slot, self._recv_path(slot, h) if h.count else None, h.need)
        elif h.kind == Kind.DONE:
            for pending in slot.recvs:  # the worker flushes the receives posted for a next push
                pending.wait()
            self._finish(slot, h.step)
            self._send(slot, Header(Kind.BYE))
            return False
        elif h.kind == Kind.FAILED:
            self._lose(slot, Reason.RAISED, "it sent FAILED on exit")
            return False
        else:
            raise ParameterServerError(f"parameter server {self.index}: unknown message kind {h.kind} from worker "
                                       f"{slot.index}; workers and servers must run the same trident version")
        return True

    # -- pushes ----------------------------------------------------------------------------

    def _post_grad_recvs(self, slot: _Slot) -> None:
        """Post receives for the worker's next gradient buckets, so they stream in during its backward."""
        slot.recvs = [self.endpoint.irecv(slot.grad[b.start:b.end], slot.rank, self.tags.GRAD, "receiving gradients")
                      for b in self.shard.layout.buckets]

    def _record(self, slot: _Slot, h: Header) -> None:
        self.records.append(UpdateRecord(self.index, slot.index, h.step, h.version, h.clock,
                                         self.shard.version, self.shard.clock))

    def _sync_push(self, slot: _Slot, h: Header) -> None:
        with self._cond:
            early = [s for s in self.slots if s.state == "done" and s.steps <= h.step]
            if early:
                first = early[0]
                self._fail(first.index, first.rank, Reason.UNEVEN,
                           f"it took {first.steps} steps; worker {slot.index} pushed step {h.step + 1}")
                raise _Abort
            self._arrived[slot.index] = h
            target = self.shard.version + 1
            if len(self._arrived) == sum(s.state == "live" for s in self.slots):
                self._sync_step()
            while self.shard.version < target and self._failure is None:
                self._cond.wait()
            if self._failure is not None:
                raise _Abort
            slot.steps = h.step + 1
        self._post_grad_recvs(slot)
        self._reply_params(slot, h.step, need=0)

    def _sync_step(self) -> None:
        order = sorted(self._arrived)
        for i in order:
            self._record(self.slots[i], self._arrived[i])
        self.shard.average_into_grad([self.slots[i].grad for i in order])
        # fp16 workers push gradients of a loss multiplied by the loss scale (PUSH value, spare = 1);
        # every server learns the global norm, unscales and clips by it, and skips the round when
        # it is not finite, so every worker's loss scaler sees the same overflow.
        first = self._arrived[order[0]]
        fp16, loss_scale = bool(first.spare), (first.value if first.spare else 1.0)
        scale = 1.0
        if self.clip > 0 or fp16:
            norm = math.sqrt(self.shard.grad_sq_norm() + self._peer_sq_norms()) / loss_scale
            self._last_norm = norm
            scale = clip_coefficient(norm, self.clip) / loss_scale
        if fp16 and not math.isfinite(self._last_norm):
            self.shard.skip()
        else:
            self.shard.step(scale)
        self.shard.clock = self.shard.version
        self._arrived.clear()
        self._cond.notify_all()

    def _peer_sq_norms(self) -> float:
        """Every other server's squared gradient norm for this round (sync clipping)."""
        peers = [r for r in self.layout.server_ranks if r != self.layout.rank]
        if not peers:
            return 0.0
        mine = Header(Kind.NORM, value=self.shard.grad_sq_norm()).encode(header_buffer(len(self.layout.param_groups)))
        sends = [self.endpoint.isend(mine, r, self.tags.PEER, "sending a gradient norm") for r in peers]
        total = 0.0
        for r in peers:
            buf = header_buffer(len(self.layout.param_groups))
            h = Header.decode(self.endpoint.irecv(buf, r, self.tags.PEER, "receiving a gradient norm").wait())
            if h.kind == Kind.ABORT:
                self._fail_from_peer(h)
                raise _Abort
            total += h.value
        for s in sends:
            s.wait()
        return total

    def _async_push(self, slot: _Slot, h: Header) -> None:
        with self._cond:
            if slot.state != "live":
                raise _Abort
            self._record(slot, h)
            self.shard.grad.copy_(slot.grad)
            self.shard.step(h.value)
            slot.steps = h.step + 1
            self._advance_clock()
        self._post_grad_recvs(slot)
        self._reply_params(slot, h.step, need=h.need)

    def _advance_clock(self) -> None:
        live = [s.steps for s in self.slots if s.state == "live"]
        if live:
            self.shard.clock = max(self.shard.clock, min(live))
        self._cond.notify_all()

    # -- replies ---------------------------------------------------------------------------

    def _reply_params(self, slot: _Slot, step: int, need: int) -> None:
        """PARAMS once the shard's clock has reached `need` (the staleness bound)."""
        with self._cond:
            while self.shard.clock < need and self._failure is None and slot.state == "live":
                self._cond.wait()
            if self._failure is not None or slot.state != "live":
                raise _Abort
            h = Header(Kind.PARAMS, step=step, version=self.shard.version, clock=self.shard.clock,
                       value=self._last_norm, count=self.layout.fingerprint, lrs=self.shard.lrs())
            payload = self.shard.snapshot()
        self._send(slot, h, payload)

    def _send(self, slot: _Slot, h: Header, payload: torch.Tensor | None = None) -> None:
        buf = h.encode(header_buffer(len(self.layout.param_groups)))
        sends = [self.endpoint.isend(buf, slot.rank, self.tags.DOWN, "replying to a worker")]
        if payload is not None:
            sends.append(self.endpoint.isend(payload, slot.rank, self.tags.PARAM, "sending parameters"))
        for s in sends:
            s.wait()

    def _send_abort(self, slot: _Slot) -> None:
        """Answer the worker's pending request with ABORT naming the lost worker."""
        if self._failure is not None:
            worker, rank, reason, _ = self._failure
        else:
            worker, rank, reason = slot.index, slot.rank, Reason.DROPPED
        try:
            self._send(slot, Header(Kind.ABORT, need=worker, step=rank, count=int(reason)))
        except LinkError:
            pass  # that worker is gone too; nothing to tell it

    # -- losing workers --------------------------------------------------------------------

    def _lose(self, slot: _Slot, reason: Reason, detail: str) -> None:
        with self._cond:
            if slot.state != "live":
                return
            slot.state = "lost"
            for pending in slot.recvs:
                pending.orphan()
            self.lost[slot.index] = lost_message(slot.index, slot.rank, reason, detail)
            if self.mode == "sync":
                self._fail(slot.index, slot.rank, reason, detail)
            else:
                live = sum(s.state == "live" for s in self.slots)
                logger.warning("parameter server %d: %s; dropped, %d worker(s) go on", self.index,
                               self.lost[slot.index], live)
                self._arrived.pop(slot.index, None)
                self._advance_clock()
                self._complete_load_round()

    def _fail(self, index: int, rank: int, reason: Reason, detail: str) -> None:
        """End the run: a worker (or, for Reason.SERVER, a server) `index` at global `rank` was lost."""
        with self._cond:
            if self._failure is not None:
                return
            self._failure = (index, rank, reason, detail)
            self._failed_at = time.monotonic()
            logger.error("parameter server %d: %s; stopping every rank (sync mode)", self.index,
                         lost_message(index, rank, reason, detail))
            abort = Header(Kind.ABORT, need=index, step=rank, count=int(reason))
            buf = abort.encode(header_buffer(len(self.layout.param_groups)))
            for r in self.layout.server_ranks:
                if r != self.layout.rank:  # a peer waiting for a norm learns why; nobody waits for these
                    self.endpoint.isend(buf, r, self.tags.PEER, "telling a server to stop").orphan()
            self._cond.notify_all()

    def _fail_from_peer(self, h: Header) -> None:
        self._fail(h.need, h.step, Reason(h.count), "reported by another parameter server")

    def _finish(self, slot: _Slot, steps: int) -> None:
        with self._cond:
            if self.mode == "sync":
                ahead = [i for i, a in self._arrived.items() if a.step >= steps]
                if ahead:
                    self._fail(slot.index, slot.rank, Reason.UNEVEN, f"it took {steps} steps; worker {ahead[0]} "
                                                                     f"pushed step {self._arrived[ahead[0]].step + 1}")
                    raise _Abort
            slot.state, slot.steps = "done", steps
            self._advance_clock()
            self._complete_load_round()

    # -- checkpoints -----------------------------------------------------------------------

    def _recv_path(self, slot: _Slot, h: Header) -> Path:
        blob = torch.zeros(h.count, dtype=torch.uint8)
        self.endpoint.irecv(blob, slot.rank, self.tags.BLOB, "receiving a checkpoint path").wait()
        return Path(bytes(blob.tolist()).decode("utf-8"))

    def _save(self, slot: _Slot, folder: Path) -> None:
        with self._cond:
            state = self.shard.state_dict(self.index, self.layout.servers)
        ckpt.write_shard(folder, self.index, state)
        self._send(slot, Header(Kind.ACK))

    def _load(self, slot: _Slot, folder: Path | None, flags: int) -> None:
        """A round over the live workers: the last to ask loads (unless `folder` is None, a
        barrier), then every one gets the parameters."""
        with self._cond:
            self._loads.add(slot.index)
            self._pending_load = (folder, flags)
            target = self._load_rounds + 1
            self._complete_load_round()
            while self._load_rounds < target and self._failure is None and slot.state == "live":
                self._cond.wait()
            if self._failure is not None or slot.state != "live":
                raise _Abort
        self._reply_params(slot, slot.steps, need=0)

    def _complete_load_round(self) -> None:
        live = {s.index for s in self.slots if s.state == "live"}
        if not self._loads or not live <= self._loads:
            return
        folder, flags = self._pending_load
        if folder is not None:
            ckpt.load_shard(self.shard, folder, self.index, flags)
            for s in self.slots:
                if s.state == "live":
                    s.steps = self.shard.clock
        self._loads.clear()
        self._load_rounds += 1
        self._cond.notify_all()

    def _result(self) -> ServeResult:
        return ServeResult(server=self.index, records=list(self.records),
                           parameters={n: p.detach().clone() for n, p in self.shard.by_name.items()},
                           version=self.shard.version, clock=self.shard.clock,
                           worker_steps={s.index: s.steps for s in self.slots}, lost=dict(self.lost),
                           traffic=self.endpoint.traffic())
