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

    def resolve(self, first: torch.Tensor | None = None) -> float | None:
        """Read `first` (a one-element tensor) and the values in one transfer, run `check`, and
        return `first`'s value."""
        if first is None:
            self.check(self.values.reshape(-1).tolist())
            return None
        both = torch.cat([first.reshape(1), self.values.reshape(-1).to(first.device, first.dtype)]).tolist()
        self.check(both[1:])
        return both[0]


class LocalStep:
    """`step` and `start_window` of a strategy with `grad_parts` and `optimizer_step` (a mixin)."""

    def start_window(self) -> None:
        """Nothing to wait for at a window's start: the parameters are this rank's."""

    def step(self, max_norm: float, loss_scale: float, split_groups: Sequence[dist.ProcessGroup],
             lr_scheduler: Any, pending: PendingRead | None = None) -> float:
        """Clip to `max_norm` and step the optimizer and `lr_scheduler`; returns the norm.

        One pass over the gradient pieces this rank holds and one all-reduce per group that
        splits them give the global norm; an inf or NaN anywhere makes it non-finite on every
        rank, which is the overflow check too: then nothing is stepped. Reading the norm is the
        step's one host sync (`pending` values come with it).
        """
        parts = [(tensors, tuple(groups) + tuple(split_groups)) for tensors, groups in self.grad_parts()]
        sq = global_sum_of_squares(parts)
        total = pending.resolve(sq) if pending is not None else sq.item()
        norm = math.sqrt(total) / loss_scale
        if math.isfinite(norm):
            self.optimizer_step(clip_coefficient(norm, max_norm) / loss_scale)
            if lr_scheduler is not None:
                lr_scheduler.step()
        return norm
