"""Ulysses (DeepSpeed-Ulysses): trade sequence shards for head shards around attention.

Before attention an all-to-all turns [B, H, T/U, D] on each of U ranks (all heads of a slice
of the sequence) into [B, H/U, T, D] (a slice of the heads over the whole sequence); attention
then runs whole per head, and a second all-to-all turns the output back. Each all-to-all moves
(U - 1)/U of a rank's tensor; the backward of one is the other.

The gathered sequence arrives in the cp layout's order (rank 0's chunks, then rank 1's, ...),
not in position order; `natural_order` gives the permutation that sorts it, so plain causal
attention can run on it.
"""

from __future__ import annotations

import torch

from trident.comm import collectives
from trident.comm.logger import CommsLogger


def seq_to_heads(x: torch.Tensor, group, size: int, logger: CommsLogger | None) -> torch.Tensor:
    """[B, H, T_local, D] -> [B, H/U, U * T_local, D], sequence pieces in group-rank order."""
    b, h, t, d = x.shape
    send = x.reshape(b, size, h // size, t, d).transpose(0, 1).contiguous()
    received = torch.empty_like(send)
    collectives.all_to_all(received, send, group=group, logger=logger)
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def heads_to_seq(y: torch.Tensor, group, size: int, logger: CommsLogger | None) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [B, H/U, U * T_local, D] -> [B, H, T_local, D]."""
    b, hu, tt, d = y.shape
    send = y.reshape(b, hu, size, tt // size, d).permute(2, 0, 1, 3, 4).contiguous()
    received = torch.empty_like(send)
    collectives.all_to_all(received, send, group=group, logger=logger)
    return received.transpose(0, 1).reshape(b, hu * size, tt // size, d)


class _Reshard(torch.autograd.Function):
    """`seq_to_heads` (to_heads=True) or `heads_to_seq`, with the other one as its backward."""

    @staticmethod
    def forward(ctx, x, to_heads: bool, group, size, logger):
        ctx.args = (not to_heads, group, size, logger)
        return (seq_to_heads if to_heads else heads_to_seq)(x, group, size, logger)

    @staticmethod
    def backward(ctx, grad):
        to_heads, group, size, logger = ctx.args
        return (seq_to_heads if to_heads else heads_to_seq)(grad.contiguous(), group, size, logger), \
            None, None, None, None


def to_heads(x: torch.Tensor, group, size: int, logger: CommsLogger | None) -> torch.Tensor:
    """Differentiable `seq_to_heads`."""
    return _Reshard.apply(x, True, group, size, logger)


def to_sequence(y: torch.Tensor, group, size: int, logger: CommsLogger | None) -> torch.Tensor:
    """Differentiable `heads_to_seq`."""
    return _Reshard.apply(y, False, group, size, logger)


def gather_docs(doc_ids: torch.Tensor, group, size: int, logger: CommsLogger | None) -> torch.Tensor:
    """Document ids of the gathered sequence: [B, T_local] -> [B, U * T_local] in group-rank order."""
    pieces = [torch.empty_like(doc_ids) for _ in range(size)]
    collectives.all_gather_list(pieces, doc_ids.contiguous(), group=group, logger=logger)
    return torch.cat(pieces, dim=1)


def natural_order(chunks: list[int], chunk_len: int, device=None) -> torch.Tensor:
    """Indices that put tokens held as `chunks` (global chunk ids, in local order) into position order."""
    order = sorted(range(len(chunks)), key=lambda i: chunks[i])
    return torch.cat([torch.arange(i * chunk_len, (i + 1) * chunk_len, device=device) for i in order])
