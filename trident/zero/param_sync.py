"""Stages 1-2 after the optimizer step: every rank's updated parameter shards back into the
whole flat parameter buffer, so each rank computes the next forward with whole parameters.

Units are gathered in buckets of about `allgather_bucket_size` elements, each bucket as one
coalesced collective whose outputs are the units' own slices of the flat buffer (no joined
input, no copy out of a joint result).
"""

from __future__ import annotations

import torch

from trident.comm import collectives
from trident.comm.logger import CommsLogger
from trident.zero.partition import ShardedLayout, group_units


@torch.no_grad()
def all_gather_params(flat: torch.Tensor, unit_starts: list[int], layout: ShardedLayout, rank: int, world: int,
                      group, bucket_size: int, logger: CommsLogger | None) -> None:
    """Fill every unit of `flat` (unit u at `unit_starts[u]`, padded) from each rank's shard."""
    if world == 1:
        return
    handles = []
    for units in group_units(layout, bucket_size, padded=True):
        outs = [flat[unit_starts[u.index]:unit_starts[u.index] + u.padded] for u in units]
        mine = [out[rank * u.shard:(rank + 1) * u.shard].clone() for out, u in zip(outs, units)]
        handles.append(collectives.all_gather_coalesced(outs, mine, group=group, async_op=True, logger=logger))
    for handle in handles:
        handle.wait()
