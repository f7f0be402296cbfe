"""0/1 Adam (Lu et al., 2022, https://arxiv.org/abs/2202.06009), DeepSpeed's `ZeroOneAdam`.

Two ideas on top of 1-bit Adam: the variance is updated only on a sparse, exponentially
spaced set of steps (adaptive freezing), and after `var_freeze_step` ranks take local steps,
synchronising only every few steps (1-bit sync). Step t (counted from 1):

* variance phase (t <= var_freeze_step):
  - if t % var_interval == 0 (the gradient was dp-averaged, in full precision):
        v = b2 v + (1 - b2) g^2,   m = b1 m + (1 - b1) g
  - else:  m = b1 m + (1 - b1) compressed_average(g_r)
  - every var_update_scaler variance steps var_interval doubles (kappa in the paper)
* local-step phase (t > var_freeze_step; the error buffers are reset once when it starts):
        m = b1 m + (1 - b1) g_r,  lrs += lr
  - the update below is also added to u (the accumulated local updates); every
    local_step_interval steps the ranks sync: undo the local updates, average
    u * (sqrt(v) + eps) in 1-bit form, set m = -u / lrs, apply u / (sqrt(v) + eps), u = lrs = 0
  - every local_step_scaler steps local_step_interval doubles, up to local_step_clipper (H)
* every step:  update = m / (sqrt(v) + eps) + weight_decay * p;  p -= lr * update

Between syncs the replicas differ (that is the method); the compression strategy therefore
saves every rank's parameters with its checkpoint. DeepSpeed's dummy first step is not
reproduced (see `trident.optim.onebit_adam`); the variance is last updated at step
var_freeze_step, as its documentation describes.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from trident.optim.compressed import CompressedOptimizer, check_common
from trident.optim.lamb import run_closure
from trident.optim.onebit_adam import adam_update


class ZeroOneAdam(CompressedOptimizer):
    """DeepSpeed's ZeroOneAdam arguments and defaults."""

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, var_freeze_step: int = 100000, var_update_scaler: int = 16,
                 local_step_scaler: int = 32678, local_step_clipper: int = 16, amsgrad: bool = False,
                 cuda_aware: bool = False, comm_backend_name: str = "nccl") -> None:
        check_common("var_freeze_step", var_freeze_step, comm_backend_name, amsgrad, "ZeroOneAdam")
        for name, value in (("var_update_scaler", var_update_scaler), ("local_step_scaler", local_step_scaler),
                            ("local_step_clipper", local_step_clipper)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ZeroOneAdam: {name} must be an integer >= 1, got {value!r}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, dict(var_interval=1, var_counter=0, local_step_interval=1,
                                                local_step_counter=0))
        self.var_freeze_step, self.var_update_scaler = var_freeze_step, var_update_scaler
        self.local_step_scaler, self.local_step_clipper = local_step_scaler, local_step_clipper
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name

    def _frozen(self, t: int) -> bool:
        return t > self.var_freeze_step

    def wants_averaged_gradients(self) -> bool:
        t = self.policy["step"] + 1
        return not self._frozen(t) and t % self.policy["var_interval"] == 0

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = run_closure(closure)
        full = self.wants_averaged_gradients()
        self.policy["step"] += 1
        t = self.policy["step"]
        for p in self.params():
            if not self.state[p]:
                self.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                     momentum_accumulator=torch.zeros_like(p), lrs=0.0)
        if self._frozen(t):
            if not self._frozen(t - 1):
                self.reset_errors()  # from gradients to accumulated updates: old errors mean nothing
            self._local_step(t)
        else:
            self._variance_phase_step(full)
        return loss

    def _variance_phase_step(self, full: bool) -> None:
        grads = [self.grad_of(p).clone() for p in self.params()]
        if not full:
            self.compressed_average(grads)
        it = iter(grads)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state, g = self.state[p], next(it)
                if full:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                adam_update(p, state, group)
        if full:
            self.policy["var_counter"] += 1
            if self.policy["var_counter"] == self.var_update_scaler:
                self.policy["var_counter"] = 0
                self.policy["var_interval"] *= 2

    def _local_step(self, t: int) -> None:
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                state = self.state[p]
                state["exp_avg"].mul_(beta1).add_(self.grad_of(p), alpha=1 - beta1)
                before = p.detach().clone()
                adam_update(p, state, group)
                state["momentum_accumulator"].add_(p - before)
                state["lrs"] += group["lr"]
        if t % self.policy["local_step_interval"] == 0:
            self._sync()
        self.policy["local_step_counter"] += 1
        if self.policy["local_step_counter"] == self.local_step_scaler:
            self.policy["local_step_counter"] = 0
            self.policy["local_step_interval"] = min(self.local_step_clipper, self.policy["local_step_interval"] * 2)

    def _sync(self) -> None:
        """Replace the local updates since the last sync by their 1-bit average."""
        pairs = [(p, group["eps"]) for group in self.param_groups for p in group["params"]]
        buffers = [self.state[p]["momentum_accumulator"] for p, _ in pairs]
        denoms = []
        for (p, eps), u in zip(pairs, buffers):
            p.sub_(u)
            denoms.append(self.state[p]["exp_avg_sq"].sqrt().add_(eps))
            u.mul_(denoms[-1])
        self.compressed_average(buffers)
        for (p, _), u, denom in zip(pairs, buffers, denoms):
            state = self.state[p]
            state["exp_avg"].copy_(u).div_(-state["lrs"])
            p.add_(u / denom)
            u.zero_()
            state["lrs"] = 0.0
