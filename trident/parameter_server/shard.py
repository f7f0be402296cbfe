"""A server's shard: fp32 parameters in one flat buffer, their optimizer and lr schedule.

The parameters are views of one flat buffer, so a reply to a worker is a single message, and
their `.grad`s are views of a second one, so a received (or averaged) gradient is in place for
the optimizer without a copy per tensor. Checkpoints key everything by parameter name, so a
checkpoint written with S servers loads with any other number.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trident.optim.clipping import sum_of_squares
from trident.parameter_server.sharding import ShardLayout

CHECKPOINT_FORMAT = "trident-parameter-server/1"


class ShardState:
    """`names[j]` is the model name of layout.tensors[j]; `initial[j]` its starting value."""

    def __init__(self, layout: ShardLayout, names: list[str], initial: list[torch.Tensor],
                 make_optimizer: Callable[[dict[str, torch.nn.Parameter]], torch.optim.Optimizer],
                 make_scheduler: Callable[[torch.optim.Optimizer], Any]) -> None:
        self.layout = layout
        self.names = names
        self.flat = torch.zeros(layout.numel, dtype=torch.float32)
        self.grad = torch.zeros(layout.numel, dtype=torch.float32)
        self.params = [torch.nn.Parameter(v) for v in layout.views(self.flat)]
        with torch.no_grad():
            for p, value in zip(self.params, initial):
                p.copy_(value)
        for p, g in zip(self.params, layout.views(self.grad)):
            p.grad = g
        self.by_name = dict(zip(names, self.params))
        self.optimizer = make_optimizer(self.by_name)
        self.scheduler = make_scheduler(self.optimizer)
        self.version = 0   # updates applied
        self.clock = 0     # every live worker's steps below this are applied

    @property
    def numel(self) -> int:
        return self.layout.numel

    def lrs(self) -> tuple[float, ...]:
        return tuple(float(g["lr"]) for g in self.optimizer.param_groups)

    @torch.no_grad()
    def average_into_grad(self, grads: list[torch.Tensor]) -> None:
        """grad = mean of the workers' flat gradients, summed in the order given."""
        self.grad.copy_(grads[0])
        for g in grads[1:]:
            self.grad.add_(g)
        if len(grads) > 1:
            self.grad.mul_(1.0 / len(grads))

    def grad_sq_norm(self) -> float:
        return float(sum_of_squares([self.grad]))

    @torch.no_grad()
    def step(self, scale: float = 1.0) -> None:
        """One optimizer and schedule step on `grad` times `scale` (clipping, or 1)."""
        if scale != 1.0:
            self.grad.mul_(scale)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.version += 1

    def skip(self) -> None:
        """A round whose gradient overflowed (fp16): no optimizer or schedule step, a new version."""
        self.version += 1

    def snapshot(self) -> torch.Tensor:
        """A copy of the flat parameters, safe to send while the shard keeps training."""
        return self.flat.clone()

    # -- checkpoints -----------------------------------------------------------------------

    def state_dict(self, server: int, servers: int) -> dict:
        def copy(v: Any) -> Any:
            return v.detach().clone() if isinstance(v, torch.Tensor) else v

        return {
            "format": CHECKPOINT_FORMAT,
            "server": server,
            "servers": servers,
            "params": {n: p.detach().clone() for n, p in self.by_name.items()},
            "optimizer": {n: {k: copy(v) for k, v in self.optimizer.state[p].items()}
                          for n, p in self.by_name.items() if p in self.optimizer.state},
            "param_groups": [{k: copy(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups],
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "version": self.version,
            "clock": self.clock,
        }

    @torch.no_grad()
    def load(self, states: list[dict], own_index: int, load_optimizer: bool, load_scheduler: bool,
             module_only: bool) -> None:
        """Take this shard's tensors from the server files of any layout; counters, hyper-parameters
        and schedule from the file of the same server index (the first file if there is none)."""
        found: dict[str, tuple[torch.Tensor, dict | None]] = {}
        for state in states:
            for name, value in state["params"].items():
                found[name] = (value, state["optimizer"].get(name))
        missing = [n for n in self.names if n not in found]
        if missing:
            raise ValueError(f"the checkpoint has no parameter {missing[0]!r} ({len(missing)} missing); it was "
                             "written for a different model; load a checkpoint of this model")
        for name, p in self.by_name.items():
            value, opt_state = found[name]
            if value.shape != p.shape:
                raise ValueError(f"checkpoint parameter {name!r} has shape {tuple(value.shape)}, the model "
                                 f"{tuple(p.shape)}; load a checkpoint of this model")
            p.copy_(value)
            if load_optimizer and not module_only:
                self.optimizer.state.pop(p, None)
                if opt_state is not None:
                    self.optimizer.state[p] = {k: v.clone() if isinstance(v, torch.Tensor) else v
                                               for k, v in opt_state.items()}
        if module_only:
            return
        own = next((s for s in states if s["server"] == own_index), states[0])
        if load_optimizer:
            for group, saved in zip(self.optimizer.param_groups, own["param_groups"]):
                group.update(saved)
        if load_scheduler and self.scheduler is not None and own["scheduler"] is not None:
            self.scheduler.load_state_dict(own["scheduler"])
        self.version, self.clock = int(own["version"]), int(own["clock"])
