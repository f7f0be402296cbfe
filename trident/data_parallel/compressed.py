"""The gradient strategy of the 1-bit optimizers (OneBitAdam, ZeroOneAdam, OneBitLamb).

It is stage 0 (`trident.data_parallel.ReplicatedOptimizer`) with one switch, asked of the
optimizer before every accumulation window: `wants_averaged_gradients()`. When True (warm-up,
0/1 Adam's variance steps) the window ends with the usual fp32 all-reduce and everything is
exactly stage 0. When False the all-reduce is skipped (DeepSpeed's `enable_backward_allreduce
= False`): each rank keeps the gradient of its own micro-batches and the optimizer's step
averages momentum in 1-bit form itself.

In a local window, as in DeepSpeed (whose norm for clipping is reduced over the model-parallel
group only): the norm is this rank's local gradient's, each rank clips its own gradient by it,
and `step` returns it. Whether the step is skipped (fp16 overflow, a NaN) is agreed over the
data-parallel group with one 4-byte all-reduce, so every rank skips or steps together and the
compressed collectives stay matched.

Checkpoints: the error buffers and, for 0/1 Adam, the parameters differ between ranks, so
every rank writes its own file (`per_rank_state`), with the optimizer state (counters and
error buffers included) and its own parameters, and loads them back exactly. Such a
checkpoint loads only under the data-parallel size that wrote it (or module-only).

DeepSpeed refuses these optimizers with ZeRO (`assert not self.zero_optimization()`); so does
`check_zero_stage`, naming `zero_optimization.stage`.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.config.errors import ConfigError, ConfigIssue
from trident.data_parallel.replicated import ReplicatedOptimizer
from trident.optim.clipping import clip_coefficient, global_norm
from trident.optim.step import PendingRead
from trident.optim.compressed import CompressedOptimizer

ALLOWED_ZERO_STAGES = (0,)


def is_compressed(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` communicates itself in compressed form (a 1-bit optimizer)."""
    return isinstance(optimizer, CompressedOptimizer)


def check_zero_stage(optimizer: torch.optim.Optimizer, stage: int) -> None:
    """A clear error for a 1-bit optimizer under ZeRO (DeepSpeed refuses the combination too)."""
    if is_compressed(optimizer) and stage not in ALLOWED_ZERO_STAGES:
        raise ConfigError([ConfigIssue("zero_optimization.stage", (
            f"{type(optimizer).__name__} works with ZeRO stage {', '.join(map(str, ALLOWED_ZERO_STAGES))} only, got "
            f"{stage}: it averages whole momenta in 1-bit form, which partitioned optimizer states do not hold "
            "(DeepSpeed refuses 1-bit optimizers with ZeRO too). Set zero_optimization.stage to 0, or use "
            "Adam/AdamW with ZeRO"))])


class CompressedStrategy(ReplicatedOptimizer):
    """Stage 0 whose gradient all-reduce the optimizer can switch off (a `GradientStrategy`)."""

    per_rank_state = True
    averaged_gradients = False  # in the compressed phase param.grad is this rank's own gradient

    def __init__(self, *args: Any, logger=None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if len(self.reducers) > 1:
            raise ValueError(f"{type(self.optimizer).__name__} does not support expert (MoE) parameters: their "
                             "gradients are averaged over another group than the dense ones; use Adam/AdamW")
        if not is_compressed(self.optimizer):
            raise TypeError(f"CompressedStrategy needs a 1-bit optimizer, got {type(self.optimizer).__name__}")
        group = self.reducer.group if self.reducer.dp_size > 1 else None
        self.group = group
        self.world = self.reducer.dp_size
        self.rank = dist.get_rank(group) if group is not None else 0
        self.optimizer.bind(group, logger)

    def _averaged(self) -> bool:
        return self.optimizer.wants_averaged_gradients()

    def start_backward(self, boundary: bool) -> None:
        averaged = self._averaged()
        for r in self.reducers:
            r.start_backward(boundary and averaged)

    def zero_grad(self) -> None:
        super().zero_grad()
        if not self._averaged():
            # no boundary all-reduce will run, so nothing zeroes the gradients of parameters that
            # get none in the window: start from zeros instead
            for r in self.reducers:
                r.buffer.zero_()

    def step(self, max_norm: float, loss_scale: float, split_groups: Sequence[dist.ProcessGroup],
             lr_scheduler: Any, pending: PendingRead | None = None, grad_factor: torch.Tensor | None = None) -> float:
        if self._averaged():
            return super().step(max_norm, loss_scale, split_groups, lr_scheduler, pending, grad_factor)
        if pending is not None:
            pending.resolve()
        if grad_factor is not None:  # token weighting: the gradients are this factor times too large
            loss_scale = loss_scale / grad_factor.item()
        parts = [(tensors, tuple(groups) + tuple(split_groups)) for tensors, groups in self.grad_parts()]
        norm = global_norm(parts) / loss_scale  # this rank's local gradient
        if not self._all_finite(norm):
            return math.inf
        self.optimizer_step(clip_coefficient(norm, max_norm) / loss_scale)
        if lr_scheduler is not None:
            lr_scheduler.step()
        return norm

    def _all_finite(self, norm: float) -> bool:
        """Whether every dp rank's local norm is finite (one tiny all-reduce)."""
        if self.group is None:
            return math.isfinite(norm)
        bad = torch.tensor([0.0 if math.isfinite(norm) else 1.0], device=self.reducer.buffer.data.device)
        collectives.all_reduce(bad, op=dist.ReduceOp.MAX, group=self.group)
        return bad.item() == 0.0

    # -- accounting and checkpoints ----------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        mem = super().memory_breakdown()
        mem["optimizer_states"] += self.optimizer.error_bytes()
        return mem

    def state_dict(self) -> dict:
        """Stage 0's state (the optimizer's includes its counters and this rank's error buffers)
        plus this rank's parameters, which 0/1 Adam's local steps let differ between ranks."""
        state = super().state_dict()
        state.update(dp_world_size=self.world, dp_rank=self.rank,
                     rank_parameters=[m.detach().clone() for m in self.master.master_params])
        return state

    @torch.no_grad()
    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        if not self.same_state_layout(state):
            raise ValueError(f"this 1-bit optimizer checkpoint was written by {state.get('dp_world_size')} "
                             f"data-parallel ranks; this run has {self.world}. Its error buffers are per rank: load "
                             "it with the same data-parallel size, or with load_optimizer_states=False")
        super().load_state_dict(state, load_optimizer_states)
        if load_optimizer_states:
            for m, saved in zip(self.master.master_params, state["rank_parameters"]):
                m.copy_(saved)
            self.master.copy_to_model()

    def same_state_layout(self, saved: dict | None) -> bool:
        return saved is not None and saved.get("dp_world_size") == self.world and saved.get("names") == self.names

    def fill_resharded_state(self, skeleton: dict, param_state, where: str) -> None:
        raise ValueError(f"{where}: a checkpoint of {type(self.optimizer).__name__} cannot be resharded (its error "
                         "buffers and counters are per data-parallel rank); load it with the data-parallel size "
                         "that wrote it, or load the module only (load_module_only=True)")
