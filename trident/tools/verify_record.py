"""Recording one run of `trident verify`: per step the loss, the global gradient norm, the
averaged gradients (where the strategy keeps them on the parameters) and every parameter as a
whole tensor; per micro-batch every module's output and the gradient flowing back into it.

`verify` records the serial and the parallel run with `record_run`; `verify_compare` compares
two `RunRecord`s. Micro-batch m of step s is samples [s*G + m*micro, s*G + (m+1)*micro) of the
data (G = the global batch), and the RNG is reseeded per (step, micro-batch), so dropout draws
the same masks in both runs.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from trident.engine.full_state import full_state_dict, merge_tp_slices


def _first_tensor(out: Any) -> torch.Tensor | None:
    if isinstance(out, torch.Tensor):
        return out if out.is_floating_point() else None
    if isinstance(out, (tuple, list)):
        return next((t for t in map(_first_tensor, out) if t is not None), None)
    if isinstance(out, dict):
        return next((t for t in map(_first_tensor, out.values()) if t is not None), None)
    return None


class Tape:
    """Module outputs and the gradients flowing into them, keyed (step, micro, module, call).

    Gradients are multiplied by `scale` (the run's accumulation steps over its loss scale) so
    both runs record d(micro-batch loss)/d(output), whatever their accumulation.
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.outputs: dict[tuple, torch.Tensor] = {}
        self.grads: dict[tuple, torch.Tensor] = {}
        self.where = (0, 0)
        self.scale = 1.0
        self._calls: Counter = Counter()
        self.owner = {}  # parameter name -> module name
        for name, mod in module.named_modules():
            mod.register_forward_hook(self._hook(name or "(model)"))
            for pname, _ in mod.named_parameters(recurse=False):
                self.owner[f"{name}.{pname}" if name else pname] = name or "(model)"

    def at(self, step: int, micro: int) -> None:
        self.where = (step, micro)
        self._calls.clear()

    def _hook(self, name: str):
        def hook(module, inputs, output) -> None:
            t = _first_tensor(output)
            if t is None:
                return
            key = (*self.where, name, self._calls[name])
            self._calls[name] += 1
            self.outputs[key] = t.detach().float().clone()
            if t.requires_grad:
                t.register_hook(lambda g: self.grads.__setitem__(key, g.detach().float() * self.scale))
        return hook


@dataclass
class RunRecord:
    """One run: per-step loss and grad norm, parameters after every step, and its tape."""

    losses: list[float] = field(default_factory=list)
    norms: list[float | None] = field(default_factory=list)
    grads_at_step: list[dict[str, torch.Tensor]] = field(default_factory=list)
    params: list[dict[str, torch.Tensor]] = field(default_factory=list)  # [0]: initial; [s + 1]: after step s
    outputs: dict = field(default_factory=dict)
    grads: dict = field(default_factory=dict)
    owner: dict = field(default_factory=dict)


def _whole(engine, local: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`local` (name -> this rank's tensor) restricted to parameters, tp slices merged, in fp32."""
    params = {name: local[name] for name, _ in engine.module.named_parameters() if name in local}
    return {n: t.float().clone() for n, t in merge_tp_slices(engine.module, params, engine.mesh).items()}


def _parameters(engine) -> dict[str, torch.Tensor]:
    """Every parameter whole (ZeRO gathered, tp merged), in fp32."""
    names = [name for name, _ in engine.module.named_parameters()]
    return {n: t.float() for n, t in full_state_dict(engine, names).items()}


def _reduced_grads(engine) -> dict[str, torch.Tensor]:
    """The averaged gradients the optimizer is about to use, where the strategy keeps them on the
    parameters (fp32 data parallelism); ZeRO's partitioned gradients are compared through the
    parameters after the step instead."""
    if not engine.strategy.averaged_gradients:
        return {}
    scale = engine.loss_scale
    factor = engine.token_weighting.factor_now()  # a token-weighted window: the step's A / N
    if factor is not None:
        scale = scale / factor.item()
    return _whole(engine, {n: p.grad / scale for n, p in engine.module.named_parameters() if p.grad is not None})


def record_run(engine, data, steps: int, micro_ids: Callable[[int], list[int]], micro: int, global_batch: int,
               seed: int) -> RunRecord:
    """Train `engine` for `steps` steps on this rank's micro-batches (`micro_ids(step)`) and record it."""
    tape = Tape(engine.module)
    rec = RunRecord(owner=tape.owner)
    rec.params.append(_parameters(engine))
    collate = torch.utils.data.default_collate
    for step in range(steps):
        for m in micro_ids(step):
            start = step * global_batch + m * micro
            batch = collate([data[(start + i) % len(data)] for i in range(micro)])
            torch.manual_seed(seed * 1_000_003 + step * 1009 + m)
            tape.at(step, m)
            loss = engine(*batch) if isinstance(batch, (tuple, list)) else engine(batch)
            count = engine.token_weighting.next_count()  # a token-weighted backward carries loss x count
            tape.scale = 1 / (engine.loss_scale * float(count)) if count is not None \
                else engine.gradient_accumulation_steps() / engine.loss_scale
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                rec.grads_at_step.append(_reduced_grads(engine))
            engine.step()
        rec.losses.append(float(engine.last_loss))
        rec.norms.append(engine.get_global_grad_norm())
        rec.params.append(_parameters(engine))
    rec.outputs, rec.grads = tape.outputs, tape.grads
    return rec
