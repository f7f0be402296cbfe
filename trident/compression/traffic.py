"""Bytes a rank sends inside its node and across nodes, read from the flight recorder.

The comms logger counts bytes per op name; what ZeRO++ changes is *where* they go. The flight
recorder (`trident.comm.recorder`) keeps every call's group members, shape and dtype, which is
enough to say how many bytes this rank hands to peers on its own node and on others, counting
each collective as a direct exchange (what each peer must receive from this rank):

    all_gather       its input to every peer
    reduce_scatter   one 1/n slice of its input to every peer
    all_to_all       one 1/n slice of its input to every peer
    all_reduce       twice a 1/n slice to every peer (reduce-scatter, then all-gather)
    others           the tensor to every peer (an upper bound)

Nodes are blocks of `node_size` consecutive global ranks, as `zero_hpz_partition_size` lays
them out on the dp axis of a dp-only mesh.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Traffic:
    """Bytes sent by this rank, by reach, with the calls by (op, group members)."""

    intra: int = 0
    cross: int = 0
    calls: dict = field(default_factory=dict)

    @property
    def total(self) -> int:
        return self.intra + self.cross


def _sent_per_peer(op: str, nbytes: int, n: int) -> float:
    if op == "all_gather":
        return nbytes
    if op in ("reduce_scatter", "all_to_all"):
        return nbytes / n
    if op == "all_reduce":
        return 2 * nbytes / n
    return nbytes


def traffic(records, rank: int, node_size: int) -> Traffic:
    """Sum `records` (FlightRecorder.records(), e.g. those of one step) for global `rank`."""
    out = Traffic()
    node = rank // node_size
    for rec in records:
        if rec.shape is None or not rec.streams or not rec.streams[0][0].collective:
            continue
        ranks = rec.streams[0][0].ranks
        numel = 1
        for d in rec.shape:
            numel *= d
        nbytes = numel * rec.dtype.itemsize
        per_peer = _sent_per_peer(rec.op, nbytes, len(ranks))
        peers = [r for r in ranks if r != rank]
        cross = sum(1 for r in peers if r // node_size != node)
        out.cross += int(per_peer * cross)
        out.intra += int(per_peer * (len(peers) - cross))
        key = (rec.op, tuple(ranks))
        out.calls[key] = out.calls.get(key, 0) + 1
    return out
