"""Point-to-point transfers between two ranks of a group (pipeline stages talk this way).

As in `collectives`, the group is explicit and `dst` / `src` are group-local ranks. A send
must be matched by a recv of the same shape and dtype on the peer; `exchange` issues several
sends and recvs together so that two ranks sending to each other cannot deadlock.

The hang detector records each transfer on the stream of its direction: send #k from rank a
to rank b is matched by recv #k from a on b, so a stuck transfer names the peer that did not
get there.
"""

from __future__ import annotations

from typing import Literal, NamedTuple, Sequence

import torch
import torch.distributed as dist

from trident.comm.collectives import Handle, ProcessGroup, logged_call, to_global_rank
from trident.comm.logger import CommsLogger
import trident.comm.recorder as flight

flight.skip_frames_of(__file__)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def send(tensor: torch.Tensor, dst: int, *, group: ProcessGroup, logger: CommsLogger | None = None) -> None:
    """Send `tensor` to group rank `dst`; returns once it may be reused."""
    gdst = to_global_rank(group, dst, "dst")
    logged_call("send", group, logger, False, lambda: _nbytes(tensor), tensor.device,
                lambda: dist.send(tensor, gdst, group=group), tensor, transfers=[("send", gdst)])


def recv(tensor: torch.Tensor, src: int, *, group: ProcessGroup, logger: CommsLogger | None = None) -> None:
    """Receive into `tensor` what group rank `src` sends."""
    gsrc = to_global_rank(group, src, "src")
    logged_call("recv", group, logger, False, lambda: _nbytes(tensor), tensor.device,
                lambda: dist.recv(tensor, gsrc, group=group), tensor, transfers=[("recv", gsrc)])


def isend(tensor: torch.Tensor, dst: int, *, group: ProcessGroup, logger: CommsLogger | None = None) -> Handle:
    """Start sending `tensor` to group rank `dst`; do not modify it before `wait()`."""
    gdst = to_global_rank(group, dst, "dst")
    return logged_call("send", group, logger, True, lambda: _nbytes(tensor), tensor.device,
                       lambda: dist.isend(tensor, gdst, group=group), tensor, transfers=[("send", gdst)])


def irecv(tensor: torch.Tensor, src: int, *, group: ProcessGroup, logger: CommsLogger | None = None) -> Handle:
    """Start receiving into `tensor` from group rank `src`; read it only after `wait()`."""
    gsrc = to_global_rank(group, src, "src")
    return logged_call("recv", group, logger, True, lambda: _nbytes(tensor), tensor.device,
                       lambda: dist.irecv(tensor, gsrc, group=group), tensor, transfers=[("recv", gsrc)])


class P2POp(NamedTuple):
    """One transfer of an `exchange`: send `tensor` to, or receive it from, group rank `peer`."""

    kind: Literal["send", "recv"]
    tensor: torch.Tensor
    peer: int


class _AllOf:
    """Waits for every work of a batch."""

    def __init__(self, works: list[dist.Work]) -> None:
        self._works = works

    def wait(self) -> bool:
        for work in self._works:
            work.wait()
        return True


def exchange(ops: Sequence[P2POp], *, group: ProcessGroup, logger: CommsLogger | None = None) -> Handle:
    """Issue all `ops` at once (torch's batch_isend_irecv); `wait()` completes all of them."""
    if not ops:
        raise ValueError("exchange needs at least one P2POp; skip the call when there is nothing to move")
    batch, transfers = [], []
    for op in ops:
        if op.kind not in ("send", "recv"):
            raise ValueError(f"P2POp.kind must be 'send' or 'recv', got {op.kind!r}")
        fn = dist.isend if op.kind == "send" else dist.irecv
        peer = to_global_rank(group, op.peer, "peer")
        batch.append(dist.P2POp(fn, op.tensor, peer, group))
        transfers.append((op.kind, peer))
    return logged_call("exchange", group, logger, True, lambda: sum(_nbytes(op.tensor) for op in ops),
                       ops[0].tensor.device, lambda: _AllOf(dist.batch_isend_irecv(batch)), ops[0].tensor,
                       transfers=transfers)
