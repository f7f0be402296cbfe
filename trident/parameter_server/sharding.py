"""Which server holds which parameter, and how a shard is laid out as flat buckets (pure math).

Both placements keep every server within its share of the parameters plus one tensor, where
the share is total elements / servers:

- `round_robin` walks the tensors in model order and hands each to the next server in turn,
  skipping servers that already hold their share. Every server gets early and late layers, so
  gradients reach all servers throughout backward.
- `balanced` is longest-processing-time-first: largest tensor first, each to the least-loaded
  server. It usually balances more tightly.

Either way a server only takes a tensor while it is below its share, so it ends below share +
that tensor. A shard is one flat buffer: its tensors back to front (backward produces the last
layers' gradients first), cut into buckets of about `bucket_size` elements that never split a
tensor. Workers and servers compute the same layout from the same names and shapes; the
fingerprint lets them check that they did.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import torch

from trident.comm.buckets import Bucket, plan_buckets

PLACEMENTS = ("round_robin", "balanced")


def assign_servers(numels: Sequence[int], servers: int, placement: str) -> list[int]:
    """The server of every tensor (in the order given); every server gets at least one."""
    if placement not in PLACEMENTS:
        raise ValueError(f"parameter_server.placement must be one of {', '.join(PLACEMENTS)}, got {placement!r}")
    if servers < 1:
        raise ValueError(f"parameter_server.servers must be >= 1 to place parameters, got {servers}")
    if servers > len(numels):
        raise ValueError(f"parameter_server.servers = {servers} but the model has only {len(numels)} trainable "
                         f"parameter tensors, so some server would hold nothing; use at most {len(numels)} servers")
    share = sum(numels) / servers
    loads = [0] * servers
    owner = [0] * len(numels)
    if placement == "balanced":
        for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
            s = min(range(servers), key=lambda s: (loads[s], s))
            owner[i] = s
            loads[s] += numels[i]
    else:
        turn = 0
        for i, n in enumerate(numels):
            while loads[turn % servers] >= share:  # some server is below its share until the end
                turn += 1
            owner[i] = turn % servers
            loads[turn % servers] += n
            turn += 1
    empty = [s for s in range(servers) if not any(o == s for o in owner)]
    if empty:
        raise ValueError(f"parameter_server.placement = {placement!r} left server(s) {empty} without parameters "
                         f"({len(numels)} tensors over {servers} servers); use fewer servers or placement "
                         f"\"round_robin\"")
    return owner


@dataclass(frozen=True)
class ShardLayout:
    """One server's tensors as a flat buffer: `tensors` are model-order indices, `offsets[j]` the
    start of tensors[j] in the buffer, `buckets` the slices sent as one message each."""

    server: int
    tensors: tuple[int, ...]
    shapes: tuple[torch.Size, ...]
    offsets: tuple[int, ...]
    buckets: tuple[Bucket, ...]
    numel: int

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of `flat` shaped like this shard's tensors, in `tensors` order."""
        return [flat[o:o + s.numel()].view(s) for o, s in zip(self.offsets, self.shapes)]

    def bucket_of(self) -> dict[int, int]:
        """Position j in `tensors` -> index of the bucket holding it."""
        return {j: b.index for b in self.buckets for j in b.param_ids}


def shard_layouts(shapes: Sequence[torch.Size], owner: Sequence[int], servers: int,
                  bucket_size: int) -> list[ShardLayout]:
    """The layout of every server's shard, given each tensor's shape and server."""
    layouts = []
    for s in range(servers):
        mine = tuple(i for i, o in enumerate(owner) if o == s)
        mine_shapes = tuple(torch.Size(shapes[i]) for i in mine)
        offsets, buckets = plan_buckets([sh.numel() for sh in mine_shapes], bucket_size)
        layouts.append(ShardLayout(s, mine, mine_shapes, tuple(offsets), tuple(buckets),
                                   sum(sh.numel() for sh in mine_shapes)))
    return layouts


def fingerprint(names: Sequence[str], shapes: Sequence[torch.Size], owner: Sequence[int], bucket_size: int) -> int:
    """A 52-bit digest of the layout (exact in a float64 header), to check two ranks agree."""
    text = "|".join(f"{n}:{tuple(s)}:{o}" for n, s, o in zip(names, shapes, owner)) + f"|{bucket_size}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big") >> 12


def describe_placement(names: Sequence[str], numels: Sequence[int], owner: Sequence[int], servers: int) -> str:
    """Start-up table: elements and tensors per server against the share."""
    total = sum(numels)
    lines = [f"parameters over {servers} server(s): {total} elements, share {total / servers:.0f} each"]
    for s in range(servers):
        mine = [i for i, o in enumerate(owner) if o == s]
        size = sum(numels[i] for i in mine)
        lines.append(f"  server {s}: {size} elements ({size / total:.1%}) in {len(mine)} tensors, "
                     f"first {names[mine[0]]}")
    return "\n".join(lines)
