"""Gradient checks shared by every strategy: overflow detection and the global norm.

Both take *parts*: gradient tensors paired with the process groups across which ranks hold
different pieces of them. Data-parallel replicas hold identical gradients after the
all-reduce, so plain DP passes no groups; strategies that shard gradients (ZeRO over dp,
tensor parallelism over tp, pipeline stages over pp) pass the groups whose members hold
different pieces, and the partial results are summed (norm) or max-ed (overflow) across them.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.distributed as dist

from trident.comm import collectives


Parts = Sequence[tuple[Sequence[torch.Tensor], Sequence[dist.ProcessGroup]]]
"""Gradient tensors grouped by the process groups across which their ranks hold different pieces."""


def has_overflow_parts(parts: Parts) -> bool:
    """True if any gradient of any part, on any rank of the part's groups, holds inf or nan."""
    local = torch.zeros(1, dtype=torch.float32)
    for tensors, _ in parts:
        if any(not torch.isfinite(g.float().sum()) for g in tensors):
            local.fill_(1.0)
            break
    for group in _all_groups(parts):
        collectives.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    return bool(local.item() > 0)


def global_norm_parts(parts: Parts) -> float:
    """L2 norm of all gradients: each part's squares are summed over the part's groups, then
    the parts are added, so replicated tensors count once and split ones piece by piece."""
    total = 0.0
    for tensors, groups in parts:
        tensors = list(tensors)
        sq = (torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in tensors]).square().sum()
              if tensors else torch.zeros((), dtype=torch.float32)).reshape(1)
        for group in groups:
            collectives.all_reduce(sq, group=group)
        total += float(sq.item())
    return math.sqrt(total)


def _all_groups(parts: Parts) -> list[dist.ProcessGroup]:
    seen, out = set(), []
    for _, groups in parts:
        for g in groups:
            if id(g) not in seen:
                seen.add(id(g))
                out.append(g)
    return out
