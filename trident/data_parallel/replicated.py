"""Stage 0 (plain data parallelism) behind the same interface as `trident.zero.ZeroOptimizer`.

Every rank holds the whole model, whole fp32 gradients (the reducer's flat buffer) and the
whole optimizer state; the engine's step talks to this object exactly as it talks to ZeRO.
"""

from __future__ import annotations

import torch

from trident.data_parallel.reducer import GradientReducer
from trident.optim.state import own_state
from trident.optim.step import LocalStep
from trident.precision.mixed import MasterWeights


class ReplicatedOptimizer(LocalStep):
    """The gradient reducer, the fp32 masters and the optimizer of a stage-0 engine
    (a `trident.engine.strategy.GradientStrategy`)."""

    stage = zero_stage = 0
    partitions_parameters = False
    per_rank_state = False  # one optimizer file per (pp, tp) position: the dp replicas are equal
    averaged_gradients = True

    def __init__(self, reducer: GradientReducer, master: MasterWeights, optimizer: torch.optim.Optimizer,
                 mesh, names: list[str], frozen: list[torch.nn.Parameter] = (),
                 expert_reducer: GradientReducer | None = None) -> None:
        self.reducer, self.master, self.optimizer, self.mesh = reducer, master, optimizer, mesh
        # Expert weights (trident.moe) have a reducer of their own over the expert-data-parallel
        # group; `names` and the masters list the dense parameters first, then the experts.
        self.reducers = [reducer] + ([expert_reducer] if expert_reducer is not None else [])
        self.names = names
        self.frozen = list(frozen)  # requires_grad=False: no gradient, no state, no traffic; bytes only
        self.grads = [g for r in self.reducers for g in r.grads]
        sharded = [bool(getattr(p, "tensor_model_parallel", False)) for p in reducer.params]
        self._sharded = [g for g, s in zip(reducer.grads, sharded) if s]
        self._replicated = [g for g, s in zip(reducer.grads, sharded) if not s]
        self.numel = sum(p.numel() for r in self.reducers for p in r.params)

    def start_backward(self, boundary: bool) -> None:
        for r in self.reducers:
            r.start_backward(boundary)

    def finish_backward(self) -> None:
        for r in self.reducers:
            r.finish_backward()

    def zero_grad(self) -> None:
        for r in self.reducers:
            r.zero_grad()

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple]]:
        """Gradients by the groups their norm is summed over: dp replicas hold the same values,
        tensor-parallel shards differ across the tp group, experts across the ep group."""
        if not self._sharded:
            parts = [([self.reducer.buffer.data], ())]
        else:
            tp = (self.mesh.tp_group,) if self.mesh.tp_size > 1 else ()
            parts = [(self._replicated, ()), (self._sharded, tp)]
        if len(self.reducers) > 1:
            parts.append(([self.reducers[1].buffer.data], (self.mesh.ep_group,) if self.mesh.ep_size > 1 else ()))
        return parts

    def nonfinite_names(self) -> list[str]:
        """Parameters whose gradient holds a NaN or inf on this rank."""
        return [n for n, g in zip(self.names, self.grads) if not torch.isfinite(g.sum())]

    @torch.no_grad()
    def optimizer_step(self, grad_coef: float) -> None:
        if grad_coef != 1.0:
            for r in self.reducers:
                r.buffer.data.mul_(grad_coef)
        self.master.attach_grads(self.grads)
        self.optimizer.step()
        self.master.copy_to_model()

    def memory_breakdown(self) -> dict[str, int]:
        trained = [p for r in self.reducers for p in r.params]
        params = sum(p.numel() * p.element_size() for p in [*trained, *self.frozen])
        grads = sum(r.buffer.data.numel() * r.buffer.data.element_size() for r in self.reducers)
        masters = sum(m.numel() * 4 for m, c in zip(self.master.master_params, self.master.is_copy) if c)
        optim = sum(t.numel() * t.element_size() for s in self.optimizer.state.values()
                    for t in s.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
        return {"parameters": params, "gradients": grads, "optimizer_states": masters + optim}

    def optimizer_names(self) -> list[str]:
        """The parameter name of each optimizer index (torch numbers params across groups in order)."""
        name_of = {id(m): n for m, n in zip(self.master.master_params, self.names)}
        return [name_of.get(id(p), "?") for group in self.optimizer.param_groups for p in group["params"]]

    def state_dict(self) -> dict:
        """Optimizer state, fp32 masters (when they are copies) and the names that key them,
        so a checkpoint can be resharded (trident.checkpointing.reshard)."""
        return {"stage": 0, "optimizer": self.optimizer.state_dict(),
                "master_weights": [m.detach() for m, c in zip(self.master.master_params, self.master.is_copy)
                                   if c],
                "master_params_are_copies": list(self.master.is_copy), "names": self.names,
                "optimizer_names": self.optimizer_names()}

    @torch.no_grad()
    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])
            copies = [m for m, c in zip(self.master.master_params, self.master.is_copy) if c]
            for m, saved in zip(copies, state["master_weights"]):
                m.copy_(saved)
        else:
            self.master.copy_from_model()

    def reload_masters(self) -> None:
        self.master.copy_from_model()

    def frozen_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.frozen)

    def placement_bytes(self) -> dict[str, int]:
        return {"device": sum(self.memory_breakdown().values()), "host": 0, "nvme": 0}

    def same_state_layout(self, saved: dict | None) -> bool:
        return True  # keyed by name, whatever the dp size

    def fill_resharded_state(self, skeleton: dict, param_state, where: str) -> None:
        """Optimizer state by optimizer index and the masters that are copies, from whole tensors."""
        states: dict[int, dict] = {}
        by_name = {}
        for index, name in enumerate(skeleton["optimizer_names"]):
            by_name[name] = param_state(name)
            states[index] = own_state(by_name[name].state)
        skeleton["optimizer"]["state"] = states
        copies = [n for n, c in zip(skeleton["names"], skeleton["master_params_are_copies"]) if c]
        skeleton["master_weights"] = [by_name[n].master for n in copies]

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.shape)

    def partitions(self, t: torch.Tensor) -> bool:
        return False

    def close(self) -> None:
        """Nothing outlives a step."""

