"""The gradient strategy: what the engine asks of plain data parallelism, ZeRO 1-3 (with
offload) and parameter-server workers.

The engine composes: it runs forward and backward, handles loss scaling's overflows and the
counters, and calls the strategy for everything that depends on where gradients, master
weights and optimizer states live, the update included (`step`): strategies whose optimizer
runs on the rank share one implementation (`trident.optim.step.LocalStep`: the global norm
from the pieces they name, clipping, the optimizer and schedule step), while a parameter-server
worker pushes its gradient and the servers clip and step.
Checkpointing, `trident verify` and the trainer ask the strategy the same way; none of them
reads a strategy's private fields or branches on a ZeRO stage. A new strategy (1-bit Adam's
compressed all-reduce, an expert-parallel reducer) implements this protocol and nothing else
needs to change.

Implementations: `trident.data_parallel.ReplicatedOptimizer` (stage 0),
`trident.zero.ZeroOptimizer` (stages 1-3, offload), and
`trident.parameter_server.PushPullStrategy` (workers of a parameter-server run).
"""

from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import torch
import torch.distributed as dist

from trident.optim.clipping import Parts



@runtime_checkable
class GradientStrategy(Protocol):
    """How a rank's gradients become parameter updates."""

    zero_stage: int
    """The ZeRO stage this strategy implements (0 when it does not partition): for logs, the
    planner's memory formula and the checkpoint manifest, never for branching."""

    numel: int
    """Trainable elements of the whole model (the same on every rank of a replica)."""

    partitions_parameters: bool
    """True when parameters are shards between steps (ZeRO-3): the module's state dict then
    holds no whole copy of them, so saving gathers them or skips them."""

    per_rank_state: bool
    """True when each data-parallel rank holds its own part of the optimizer state (ZeRO): every
    rank then writes its own checkpoint file, instead of one per (pp, tp) position."""

    averaged_gradients: bool
    """True when, after backward on a boundary, `param.grad` holds the dp-averaged gradient of
    each parameter (stage 0); `trident verify` compares those directly."""

    # -- backward --------------------------------------------------------------------------

    def start_backward(self, boundary: bool) -> None:
        """Before a micro-batch's backward; `boundary` is True on the accumulation window's last,
        where gradient communication may start as soon as each bucket is complete."""

    def finish_backward(self) -> None:
        """After backward: wait for the communication this backward started."""

    def zero_grad(self) -> None:
        """Start a new accumulation window."""

    def start_window(self) -> None:
        """Before the first forward or backward of an accumulation window (a no-op for local
        strategies; an async parameter-server worker waits here for a pull, but only when the
        parameters it holds are more than `staleness` steps old)."""

    # -- the step --------------------------------------------------------------------------

    def step(self, max_norm: float, loss_scale: float, split_groups: Sequence[dist.ProcessGroup],
             lr_scheduler: Any, pending: Any = None, grad_factor: torch.Tensor | None = None) -> float | None:
        """End the window's update wherever the optimizer runs: clip the gradient to `max_norm`
        (0: off), apply it, and advance `lr_scheduler` with it (a strategy whose schedule runs
        elsewhere ignores it). Gradients are `loss_scale` times too large and also differ across
        `split_groups` (the pipeline stages). Returns the norm before clipping; a non-finite
        norm means nothing was applied (an fp16 overflow, a NaN); None when this rank does not
        learn it (a parameter-server worker without clipping). Local strategies build it from
        `grad_parts` and `optimizer_step` (`trident.optim.step.LocalStep`). `pending`
        (`trident.optim.step.PendingRead`, pipelines) is read with the norm and checked before
        anything is applied; `grad_factor` (a one-element device tensor, token weighting) scales
        the gradients before the norm, the clip and the update."""

    def grad_parts(self) -> Parts:
        """The gradient pieces this rank holds, each with the groups across which ranks hold
        different pieces (each element counted exactly once: `trident.optim.clipping`)."""

    def nonfinite_names(self) -> list[str]:
        """Parameters with a NaN or inf in the part of their gradient this rank holds."""

    def optimizer_step(self, grad_coef: float) -> None:
        """Multiply the gradients by `grad_coef` (1 / loss scale times the clip coefficient), step
        the optimizer, and put the new values into the model's parameters."""

    # -- accounting ------------------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes this rank holds: {"parameters", "gradients", "optimizer_states"} (fp32 masters
        count as optimizer states, as in the ZeRO paper; frozen parameters as parameters only)."""

    def frozen_bytes(self) -> int:
        """The part of memory_breakdown()["parameters"] that is frozen (requires_grad=False)."""

    def placement_bytes(self) -> dict[str, int]:
        """Bytes of model states by where they live: {"device", "host", "nvme"}."""

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self) -> dict:
        """Optimizer state and fp32 masters in this strategy's own layout, with the names that
        key them (what `trident.checkpointing.reshard` reads back under any layout)."""

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        """Restore `state_dict()`'s output (masters always; optimizer state when asked)."""

    def reload_masters(self) -> None:
        """Refresh the fp32 masters from the model's parameters (after a module-only load)."""

    def same_state_layout(self, saved: dict | None) -> bool:
        """Whether `saved` (this rank's saved `state_dict()`, or None where the strategy keeps no
        per-rank file) was written with exactly this rank's partitioning, so it loads as is;
        otherwise the checkpoint is resharded."""

    def fill_resharded_state(self, skeleton: dict, param_state: Callable[[str], Any], where: str) -> None:
        """Fill `skeleton` (a fresh `state_dict()`) from `param_state(name)`: each parameter's
        fp32 master and optimizer states as whole tensors already cut for this tp rank."""

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """The shape of parameter `t` as the model defines it (not its partition)."""

    def partitions(self, t: torch.Tensor) -> bool:
        """True when this strategy holds `t` only as shards between steps (ZeRO-3's parameters):
        the module's state dict then has no whole copy of it (checkpoints ask this)."""

    def close(self) -> None:
        """Release what outlives a step (swap files, I/O threads, connections)."""


@runtime_checkable
class RemoteStrategy(Protocol):
    """What a strategy adds whose parameters and optimizer live on other processes (a
    parameter-server worker's `PushPullStrategy`). The engine offers these under the same
    names, and sends its checkpoints here instead of to `trident.checkpointing`: the state to
    save is on the other processes, and the engine's `global_steps`, `micro_steps` and
    `global_samples` are saved and restored by the strategy with it."""

    server_version: int
    """The oldest version among the parameters this rank holds (updates applied to them)."""

    def fetch_parameters(self) -> None:
        """Bring the newest parameters into the model now (for evaluation, or at the end)."""

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this rank has sent to and received from the other processes: {"sent", "received"}."""

    def save_checkpoint(self, engine: Any, save_dir: str, tag: str | None, client_state: dict,
                        save_latest: bool) -> str:
        """`Engine.save_checkpoint`; returns the checkpoint folder."""

    def load_checkpoint(self, engine: Any, load_dir: str, tag: str | None, load_optimizer_states: bool,
                        load_lr_scheduler_states: bool, load_module_only: bool) -> tuple:
        """`Engine.load_checkpoint`: (folder, client_state), or (None, None) if none exists."""
