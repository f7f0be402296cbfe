"""A worker's side of the conversation with the servers: requests, replies, what it holds.

A request is a header (and, for SAVE and LOAD, a path) sent to one server; the receives for the
reply are posted with it: a header and, except for SAVE and DONE, the flat fp32 shard, into that
shard's staging buffer (`push.ShardBuffers`), so a pull lands while the model may still be
computing with the old parameters. Taking a reply makes the staged shard the model's parameters
and records its version and clock (`Held`). Every wait is bounded by 2 x distributed.timeout_s:
a server that is gone or silent stops the worker with a `ParameterServerError` naming it, and a
server that stopped training answers ABORT, which becomes a `WorkerLostError` with its reason.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable, TypeVar

import torch

from trident.parameter_server.layout import PSLayout
from trident.parameter_server.protocol import (SYNC_ADVICE, Header, Kind, ParameterServerError, Reason,
                                               WorkerLostError, header_buffer, lost_message)
from trident.parameter_server.push import GradientPusher
from trident.parameter_server.transport import Endpoint, LinkError, Pending

T = TypeVar("T")


@dataclass
class _Reply:
    header: Pending
    payload: Pending | None


@dataclass(frozen=True)
class Held:
    """Version and clock of the parameters a worker holds for one shard."""

    version: int
    clock: int


class ServerClient:
    """One worker's requests to every server and the replies it is waiting for."""

    def __init__(self, layout: PSLayout, endpoint: Endpoint, pusher: GradientPusher) -> None:
        self.layout, self.endpoint, self.pusher = layout, endpoint, pusher
        self.timeout = timedelta(seconds=2 * layout.timeout_s)
        self.held = [Held(0, 0)] * layout.servers
        self.replies: list[_Reply | None] = [None] * layout.servers
        self.lrs: tuple[float, ...] = ()  # the servers' learning rate per param group, as of the last pull
        self.norm = 0.0  # the last reply's value: in sync mode with clipping, the averaged gradient's norm
        self.broken = False  # a server is lost or stopped training: nothing more is sent

    @property
    def who(self) -> str:
        return f"worker {self.layout.worker_index} (global rank {self.layout.rank})"

    def request(self, s: int, h: Header, blob: bytes = b"", reply: bool = True) -> None:
        """Send a header (and blob) to server s; post the receives for its reply."""
        try:
            self.send(s, h, blob, reply)
        except LinkError as err:
            raise self._server_lost(err) from err

    def send(self, s: int, h: Header, blob: bytes = b"", reply: bool = True) -> None:
        peer, tags = self.layout.server_ranks[s], self.layout.tags
        buf = h.encode(header_buffer(len(self.layout.param_groups)))
        self.pusher.sends.append(self.endpoint.isend(buf, peer, tags.UP, f"sending to parameter server {s}"))
        if blob:
            data = torch.tensor(list(blob), dtype=torch.uint8)
            self.pusher.sends.append(self.endpoint.isend(data, peer, tags.BLOB, f"sending to parameter server {s}"))
        if reply:
            what = f"waiting for parameter server {s}"
            head = self.endpoint.irecv(header_buffer(len(self.layout.param_groups)), peer, tags.DOWN, what)
            payload = (self.endpoint.irecv(self.pusher.shards[s].staging, peer, tags.PARAM, what)
                       if h.kind not in (Kind.SAVE, Kind.DONE) else None)
            self.replies[s] = _Reply(head, payload)

    def exchange(self, h: Header, blob: bytes = b"") -> None:
        """The same request to every server, then every reply (after any reply still due)."""
        self.take_replies()
        for s in range(self.layout.servers):
            self.request(s, h, blob)
        self.wait(self.pusher.wait_sends)
        self.take_replies()

    def take_replies(self) -> None:
        for s in range(self.layout.servers):
            if self.replies[s] is not None:
                self.take_reply(s)

    def take_reply(self, s: int) -> Header:
        reply, self.replies[s] = self.replies[s], None
        h = Header.decode(self.wait(lambda t: reply.header.wait(t)))
        if h.kind == Kind.ABORT:
            if reply.payload is not None:
                reply.payload.orphan()
            self.broken = True
            raise self._abort_error(s, h)
        if h.kind == Kind.PARAMS:
            self.wait(lambda t: reply.payload.wait(t))
            if h.count != self.layout.fingerprint:
                self.broken = True
                raise ParameterServerError(
                    f"worker {self.layout.worker_index}: parameter server {s} placed the parameters differently "
                    "(layout fingerprints differ); every rank must build the same model and use the same config")
            self.pusher.shards[s].adopt_staging()
            self.held[s] = Held(h.version, h.clock)
            self.norm = h.value
            if s == 0:
                self.lrs = h.lrs
        return h

    def wait(self, fn: Callable[[timedelta], T]) -> T:
        """Run a blocking wait; a lost server or a timeout stops this worker with the reason."""
        try:
            return fn(self.timeout)
        except LinkError as err:
            raise self._server_lost(err) from err

    def _server_lost(self, err: LinkError) -> ParameterServerError:
        self.broken = True
        ranks = self.layout.server_ranks
        server = ranks.index(err.peer) if err.peer in ranks else -1
        return ParameterServerError(
            f"{self.who}: {lost_message(server, err.peer, Reason.SERVER, str(err))} (a worker waits at most "
            f"{self.timeout.total_seconds():g} s, 2 x distributed.timeout_s, for a server); check that "
            "server's log")

    def _abort_error(self, s: int, h: Header) -> ParameterServerError:
        reason = Reason(h.count)
        if reason == Reason.DROPPED:
            return WorkerLostError(f"{self.who}: parameter server {s} had dropped this worker as lost (it was "
                                   f"silent for longer than distributed.timeout_s = {self.layout.timeout_s:g}); "
                                   "raise the timeout if steps can take that long", self.layout.worker_index, reason)
        return WorkerLostError(f"{self.who}: parameter server {s} stopped training: "
                               f"{lost_message(h.need, h.step, reason)}; {SYNC_ADVICE}", h.need, reason)
