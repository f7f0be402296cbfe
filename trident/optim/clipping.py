"""The global gradient norm and the clip coefficient, written once for every strategy.

Every strategy (plain data parallelism, ZeRO 1-3 with offload, tensor and pipeline
parallelism, parameter servers) hands over *parts*: the gradient tensors this rank holds,
each paired with the process groups across which ranks hold different pieces of them.
Data-parallel replicas hold identical gradients after their reduction, so a part passes only
the groups that split it (ZeRO's dp shards, tp slices, pipeline stages); replicated elements
are then counted once and split ones piece by piece.

Sums of squares are accumulated in float64. torch's CPU `vector_norm` adds an fp32 tensor in
fp32 lanes without pairwise summation, so a 4M-element flat gradient buffer loses about 1e-4
of its norm; a layout that cuts the same gradient into shards or per-tensor pieces rounds
differently, and clipping by two different norms gives two different trainings. In float64
the norm is exact to the rounding of the gradients themselves, whatever the layout.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

import torch
import torch.distributed as dist

from trident.comm import collectives

Parts = Sequence[tuple[Sequence[torch.Tensor], Sequence[dist.ProcessGroup]]]
"""Gradient tensors grouped by the process groups across which their ranks hold different pieces."""

NORM_CHUNK = 1 << 18
"""Elements converted to float64 at a time (2 MiB): bounds the transient copy, which matters for
ZeRO-Infinity runs near their memory limit, while staying long enough to be fast."""

CLIP_EPS = 1e-6
"""DeepSpeed's and torch's clip rule: coefficient = max_norm / (norm + eps) when that is < 1."""


def sum_of_squares(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """sum(g ** 2) over every element of `tensors`, as a float64 scalar on their device."""
    total = None
    for g in tensors:
        flat = g.detach().reshape(-1)
        for i in range(0, flat.numel(), NORM_CHUNK):
            piece = torch.linalg.vector_norm(flat[i:i + NORM_CHUNK], dtype=torch.float64).square()
            total = piece if total is None else total + piece
    return total if total is not None else torch.zeros((), dtype=torch.float64)


def global_norm(parts: Parts) -> float:
    """L2 norm of all gradients: each part's squares are summed over the part's groups, then
    the parts are added. Non-finite when any element anywhere is (the overflow check)."""
    total = 0.0
    for tensors, groups in parts:
        tensors = list(tensors)
        device = tensors[0].device if tensors else torch.device("cpu")
        sq = sum_of_squares(tensors).to(device).reshape(1)
        for group in groups:
            collectives.all_reduce(sq, group=group)
        total += float(sq.item())
    return math.sqrt(total)


def clip_coefficient(norm: float, max_norm: float) -> float:
    """The factor gradients are multiplied by when clipping to `max_norm` (1.0 when off or inactive)."""
    if max_norm > 0 and max_norm / (norm + CLIP_EPS) < 1.0:
        return max_norm / (norm + CLIP_EPS)
    return 1.0
