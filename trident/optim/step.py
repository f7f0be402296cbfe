"""The update of a strategy whose optimizer runs on this rank: norm, clip, step, schedule.

`trident.data_parallel.ReplicatedOptimizer` (stage 0) and `trident.zero.ZeroOptimizer` (stages
1-3) take their `GradientStrategy.step` and `start_window` from `LocalStep`; they differ only in
the pieces they name (`grad_parts`) and in how they apply a coefficient (`optimizer_step`). A
parameter-server worker's update runs on the servers instead (`PushPullStrategy.step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from trident.optim.clipping import clip_coefficient, global_sum_of_squares


@dataclass
class PendingRead:
    """Device values the host must see before an update is applied (a pipeline's failure flag
    and mean loss), read in the same transfer as the gradient norm, so that a step costs one
    host sync. `check` gets them as floats and raises to stop the update."""

    values: torch.Tensor
    check: Callable[[list[float]], None]

    def resolve(self, *first: torch.Tensor) -> list[float]:
        """Read `first` (one-element tensors) and the values in one transfer, run `check`, and
        return `first`'s values."""
        if not first:
            self.check(self.values.reshape(-1).tolist())
            return []
        read = host_values(*first, self.values)
        self.check(read[len(first):])
        return read[:len(first)]


def host_values(*tensors: torch.Tensor) -> list[float]:
    """The elements of small device tensors on the host, in one transfer (one host sync)."""
    if len(tensors) == 1 and tensors[0].numel() == 1:
        return [tensors[0].item()]
    device, dtype = tensors[0].device, tensors[0].dtype
    return torch.cat([t.reshape(-1).to(device, dtype) for t in tensors]).tolist()


class LocalStep:
    """`step` and `start_window` of a strategy with `grad_parts` and `optimizer_step` (a mixin)."""

    def start_window(self) -> None:
        """Nothing to wait for at a window's start: the parameters are this rank's."""

    def step(self, max_norm: float, loss_scale: float, split_groups: Sequence[dist.ProcessGroup],
             lr_scheduler: Any, pending: PendingRead | None = None,
             grad_factor: torch.Tensor | None = None) -> float:
        """Clip to `max_norm` and step the optimizer and `lr_scheduler`; returns the norm.

        One pass over the gradient pieces this rank holds and one all-reduce per group that
        splits them give the global norm; an inf or NaN anywhere makes it non-finite on every
        rank, which is the overflow check too: then nothing is stepped. The gradients are
        `grad_factor` (a device tensor: token weighting's A / N) times too small or large, when
        given. Reading the norm is the step's one host sync (the factor and `pending` values
        come with it).
        """
        parts = [(tensors, tuple(groups) + tuple(split_groups)) for tensors, groups in self.grad_parts()]
        first = [global_sum_of_squares(parts)] + ([grad_factor] if grad_factor is not None else [])
        read = pending.resolve(*first) if pending is not None else host_values(*first)
        factor = read[1] if grad_factor is not None else 1.0
        norm = math.sqrt(read[0]) * factor / loss_scale
        if math.isfinite(norm):
            self.optimizer_step(clip_coefficient(norm, max_norm) * factor / loss_scale)
            if lr_scheduler is not None:
                lr_scheduler.step()
        return norm
