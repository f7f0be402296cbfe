"""Point-to-point messages between servers and workers on torch.distributed (gloo or NCCL).

Two facts of gloo's point-to-point layer shape this module (measured on torch 2.13):

- A send completes only once the peer has posted the matching receive (a rendezvous), and
  `Work.is_completed()` stays False until `wait()` is called, so there is no polling: servers
  block in a thread per worker, workers block only where they need the data.
- A `wait()` that times out closes *every* connection of the process, not just the stuck one.
  A server must survive a lost worker in async mode, so servers wait without a gloo timeout and
  keep time themselves (a watchdog names a worker that stays silent past
  `distributed.timeout_s`). A process that dies closes its connections, and waits on them
  raise at once.

`Endpoint` counts the bytes it sends and receives, for the logs and the benchmark.
"""

from __future__ import annotations

import threading
from datetime import timedelta

import torch
import torch.distributed as dist

# Longer than any run: servers time out by their own clock, never gloo's (see the docstring).
NO_TIMEOUT = timedelta(days=365)

# Receives posted for a peer that was lost never complete; their buffers must outlive the
# process group, or a late message would be written into freed memory.
_ORPHANED: list[tuple[object, torch.Tensor]] = []


class LinkError(RuntimeError):
    """A point-to-point operation failed: the peer's connection closed, or the wait timed out."""

    def __init__(self, message: str, peer: int) -> None:
        super().__init__(message)
        self.peer = peer


class Pending:
    """A send or receive in flight; `wait` returns once it completed or raises LinkError."""

    __slots__ = ("work", "tensor", "peer", "what", "_done")

    def __init__(self, work, tensor: torch.Tensor, peer: int, what: str) -> None:
        self.work, self.tensor, self.peer, self.what = work, tensor, peer, what
        self._done = False

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> torch.Tensor:
        if not self._done:
            try:
                self.work.wait(timeout)
            except RuntimeError as err:
                raise LinkError(f"{self.what} with global rank {self.peer} failed: {_short(err)}", self.peer) from err
            self._done = True
        return self.tensor

    def orphan(self) -> None:
        """Keep this operation's buffer alive for the rest of the process (its peer is gone)."""
        if not self._done:
            _ORPHANED.append((self.work, self.tensor))


class Endpoint:
    """This rank's side of the parameter-server traffic over `group` (peers are global ranks)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self._lock = threading.Lock()
        self.sent_bytes = 0
        self.received_bytes = 0

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent_bytes += sent
            self.received_bytes += received

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "send") -> Pending:
        self._count(sent=tensor.numel() * tensor.element_size())
        return self._issue(dist.isend, tensor, peer, tag, what)

    def irecv(self, tensor: torch.Tensor, peer: int, tag: int, what: str = "receive") -> Pending:
        self._count(received=tensor.numel() * tensor.element_size())
        return self._issue(dist.irecv, tensor, peer, tag, what)

    def _issue(self, fn, tensor: torch.Tensor, peer: int, tag: int, what: str) -> Pending:
        """Start the operation; a connection already known to be closed fails here, not in wait.
        An empty tensor moves nothing, so it is not handed to the backend and is complete at once
        (on both sides, so sender and receiver still agree)."""
        if tensor.numel() == 0:
            return Pending(_Done(), tensor, peer, what)
        try:
            return Pending(fn(tensor, peer, group=self.group, tag=tag), tensor, peer, what)
        except RuntimeError as err:
            raise LinkError(f"{what} with global rank {peer} failed: {_short(err)}", peer) from err

    def traffic(self) -> dict[str, int]:
        """Bytes this rank has sent and received (receives count when posted)."""
        with self._lock:
            return {"sent": self.sent_bytes, "received": self.received_bytes}


class _Done:
    """The work of an operation with nothing to move."""

    def wait(self, timeout: timedelta = NO_TIMEOUT) -> bool:
        return True


def _short(err: BaseException) -> str:
    """gloo's message without its source path prefix."""
    text = str(err).strip()
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically")[0]
