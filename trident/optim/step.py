"""The update of a strategy whose optimizer runs on this rank: norm, clip, step, schedule.

`trident.data_parallel.ReplicatedOptimizer` (stage 0) and `trident.zero.ZeroOptimizer` (stages
1-3) take their `GradientStrategy.step` and `start_window` from `LocalStep`; they differ only in
the pieces they name (`grad_parts`) and in how they apply a coefficient (`optimizer_step`). A
parameter-server worker's update runs on the servers instead (`PushPullStrategy.step`).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch.distributed as dist

from trident.optim.clipping import clip_coefficient, global_norm


class LocalStep:
    """`step` and `start_window` of a strategy with `grad_parts` and `optimizer_step` (a mixin)."""

    def start_window(self) -> None:
        """Nothing to wait for at a window's start: the parameters are this rank's."""

    def step(self, max_norm: float, loss_scale: float, split_groups: Sequence[dist.ProcessGroup],
             lr_scheduler: Any) -> float:
        """Clip to `max_norm` and step the optimizer and `lr_scheduler`; returns the norm.

        One pass over the gradient pieces this rank holds and one all-reduce per group that
        splits them give the global norm; an inf or NaN anywhere makes it non-finite on every
        rank, which is the overflow check too: then nothing is stepped.
        """
        parts = [(tensors, tuple(groups) + tuple(split_groups)) for tensors, groups in self.grad_parts()]
        norm = global_norm(parts) / loss_scale
        if math.isfinite(norm):
            self.optimizer_step(clip_coefficient(norm, max_norm) / loss_scale)
            if lr_scheduler is not None:
                lr_scheduler.step()
        return norm
