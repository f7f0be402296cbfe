"""The global gradient norm shared by every strategy (its non-finiteness is also the overflow check).

It takes *parts*: gradient tensors paired with the process groups across which ranks hold
different pieces of them. Data-parallel replicas hold identical gradients after the
all-reduce, so plain DP passes no groups; strategies that shard gradients (ZeRO over dp,
tensor parallelism over tp, pipeline stages over pp) pass the groups whose members hold
different pieces, and the partial results are summed across them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from trident.comm import collectives


Parts = Sequence[tuple[Sequence[torch.Tensor], Sequence[dist.ProcessGroup]]]
"""Gradient tensors grouped by the process groups across which their ranks hold different pieces."""


def global_norm_parts(parts: Parts) -> float:
    """L2 norm of all gradients: each part's squares are summed over the part's groups, then
    the parts are added, so replicated tensors count once and split ones piece by piece."""
    total = 0.0
    for tensors, groups in parts:
        tensors = list(tensors)
        sq = (torch.stack([_norm(g) for g in tensors]).square().sum()
              if tensors else torch.zeros((), dtype=torch.float32)).reshape(1)
        for group in groups:
            collectives.all_reduce(sq, group=group)
        total += float(sq.item())
    return math.sqrt(total)



NORM_CHUNK = 1 << 22
"""Elements converted to fp32 at a time for a 16-bit gradient's norm: a whole-partition fp32 copy
would be 2x the gradient's own bytes (ZeRO-Infinity runs near their memory limit)."""


def _norm(g: torch.Tensor) -> torch.Tensor:
    """The fp32 L2 norm of `g`, converting at most NORM_CHUNK elements at a time."""
    if g.dtype == torch.float32 or g.numel() <= NORM_CHUNK:
        return torch.linalg.vector_norm(g, dtype=torch.float32)
    flat = g.reshape(-1)
    parts = [torch.linalg.vector_norm(flat[i:i + NORM_CHUNK], dtype=torch.float32)
             for i in range(0, flat.numel(), NORM_CHUNK)]
    return torch.linalg.vector_norm(torch.stack(parts))
