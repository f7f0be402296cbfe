"""Flat gradient buffers cut into buckets.

One contiguous fp32 buffer holds every gradient; each parameter's gradient is a view into it.
Contiguity is what makes bucketed reduction cheap: a bucket is a slice of the buffer, reduced
with one collective, with no packing or unpacking copies. Parameters are laid out in reverse
registration order because backward produces the last layers' gradients first, so the first
bucket fills first and its reduction overlaps with the rest of backward. `GradScaling` is the
averaging every bucketed reduction applies (stage 0's all-reduce and ZeRO's reduce-scatter).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Bucket:
    """A slice [start, end) of the flat buffer covering whole parameters."""

    index: int
    start: int
    end: int
    param_ids: list[int] = field(default_factory=list)

    @property
    def numel(self) -> int:
        return self.end - self.start


def plan_buckets(numels: list[int], bucket_size: int) -> tuple[list[int], list[Bucket]]:
    """Lay out tensors of the given sizes back to front into buckets of about `bucket_size`.

    Returns each tensor's offset in the flat buffer and the buckets. A bucket closes once it
    holds at least `bucket_size` elements, so a tensor is never split across buckets and a
    bucket exceeds `bucket_size` by less than its last tensor.
    """
    if bucket_size < 1:
        raise ValueError(f"bucket size must be >= 1 element, got {bucket_size}")
    offsets = [0] * len(numels)
    buckets: list[Bucket] = []
    cursor = 0
    current = Bucket(index=0, start=0, end=0)
    for i in reversed(range(len(numels))):
        offsets[i] = cursor
        cursor += numels[i]
        current.param_ids.append(i)
        current.end = cursor
        if current.numel >= bucket_size:
            buckets.append(current)
            current = Bucket(index=len(buckets), start=cursor, end=cursor)
    if current.param_ids:
        buckets.append(current)
    return offsets, buckets


class FlatBuffer:
    """A contiguous buffer with one view per tensor, shaped like that tensor."""

    def __init__(self, shapes: list[torch.Size], offsets: list[int], dtype: torch.dtype,
                 device: torch.device) -> None:
        total = sum(int(torch.Size(s).numel()) for s in shapes)
        self.data = torch.zeros(total, dtype=dtype, device=device)
        self.views = [
            self.data[o:o + torch.Size(s).numel()].view(s) for s, o in zip(shapes, offsets)
        ]

    def slice(self, start: int, end: int) -> torch.Tensor:
        return self.data[start:end]

    def zero_(self) -> None:
        self.data.zero_()


class GradScaling:
    """DeepSpeed's averaging over the dp group: divide by N before the sum (prescale), or by a
    predivide factor before and by N / factor after (keeps fp16 sums in range)."""

    def __init__(self, dp_size: int, predivide_factor: float, prescale: bool) -> None:
        self.n, self.factor, self.prescale = dp_size, predivide_factor, prescale

    def before(self, t: torch.Tensor) -> None:
        if self.prescale:
            t.div_(self.n)
        elif self.factor != 1.0:
            t.mul_(1.0 / self.factor)

    def after(self, t: torch.Tensor) -> None:
        if not self.prescale and self.factor != self.n:
            t.mul_(self.factor / self.n)
