"""Moving tokens to their experts and back: one autograd all-to-all pair over the ep group.

    function          forward                                  backward
    all_to_all_rows   rows grouped by destination -> rank j    the same exchange, splits swapped

Dispatch sends each kept assignment's token (a row of `hidden` values) to the ep rank holding
its expert; combine sends the expert's output row back. Splits are uneven (an expert receives
what the router gave it), so both sides must know every split: they come from the routing
table every rank holds (`trident.moe.routing.Routing.kept`), not from an extra exchange.

What crosses the wire per MoE layer and step, with A kept assignments per rank spread evenly:
forward A x hidden x (ep - 1) / ep rows' values out in dispatch and as many back in combine,
backward the same again. The comms logger is given the bytes that leave the rank (rows for
itself stay in memory), so per layer it shows 2 x A x hidden x bytes x (ep - 1) / ep forward
and as much backward, with A = tokens x k when nothing is dropped.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger


def _exchange(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup,
              logger: CommsLogger | None) -> torch.Tensor:
    rows = rows.contiguous()
    out = rows.new_empty((sum(recv),) + tuple(rows.shape[1:]))
    started = time.perf_counter()
    collectives.all_to_all(out, rows, group=group, output_split_sizes=recv, input_split_sizes=send)
    if logger is not None and logger.wants("all_to_all"):
        me = dist.get_rank(group)
        width = rows[0].numel() * rows.element_size() if rows.shape[0] else 0
        logger.record("all_to_all", (sum(send) - send[me]) * width, time.perf_counter() - started,
                      dist.get_world_size(group))
    return out


class _AllToAllRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows, send, recv, group, logger):
        ctx.send, ctx.recv, ctx.group, ctx.logger = send, recv, group, logger
        return _exchange(rows, send, recv, group, logger)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.recv, ctx.send, ctx.group, ctx.logger), None, None, None, None


def all_to_all_rows(rows: torch.Tensor, send: list[int], recv: list[int], group: dist.ProcessGroup | None,
                    logger: CommsLogger | None = None) -> torch.Tensor:
    """Rows [send[0] for rank 0 | send[1] for rank 1 | ...] out; rows [recv[0] from rank 0 | ...]
    back. Backward sends the gradient of each received row to where the row came from."""
    if group is None or dist.get_world_size(group) == 1:
        return rows
    return _AllToAllRows.apply(rows, list(send), list(recv), group, logger)


def gather_counts(counts: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """[k, E] per rank -> [G, k, E] over `group` (None: this rank alone)."""
    if group is None or dist.get_world_size(group) == 1:
        return counts.unsqueeze(0)
    out = counts.new_empty((dist.get_world_size(group),) + tuple(counts.shape))
    collectives.all_gather(out, counts.contiguous(), group=group)
    return out


def moe_all_to_all_bytes(tokens: float, d_model: int, k: int, ep: int, bytes_per: int) -> float:
    """Bytes one rank sends to other ep ranks per MoE layer in forward (as much again in
    backward): dispatch and combine each move tokens x k rows of d_model values, (ep - 1) / ep
    of them to other ranks when routing is even. What trident's comms logger records."""
    return 2 * tokens * d_model * k * bytes_per * (ep - 1) / ep
