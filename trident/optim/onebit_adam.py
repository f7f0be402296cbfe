"""1-bit Adam (Tang et al., 2021, https://arxiv.org/abs/2102.02888), DeepSpeed's `OneBitAdam`.

Adam's variance stabilises early; once it is frozen, Adam is a momentum method whose momentum
can be averaged in 1-bit form with error feedback. So:

* steps 1 .. freeze_step (warm-up): dp-averaged gradient g;
      m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
* later steps (compression): this rank's own gradient g_r; v is frozen;
      m = compressed_average(b1 m + (1 - b1) g_r)
* every step:  p -= lr * (m / (sqrt(v) + eps) + weight_decay * p)

As in DeepSpeed there is no bias correction (`bias_correction` and `eps_inside_sqrt` are
accepted and have no effect) and weight decay is added to the update. DeepSpeed's first call
only sets up its buffers (its first batch updates nothing); trident updates from step 1,
and compression starts after the same number of steps, `freeze_step`.
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch

from trident.optim.compressed import CompressedOptimizer, check_common
from trident.optim.lamb import run_closure


class OneBitAdam(CompressedOptimizer):
    """DeepSpeed's OneBitAdam arguments and defaults (`cuda_aware` and `comm_backend_name` select
    MPI / NCCL transports there; trident compresses over the dp group's own backend)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, amsgrad: bool = False, cuda_aware: bool = False,
                 comm_backend_name: str = "nccl") -> None:
        check_common("freeze_step", freeze_step, comm_backend_name, amsgrad, "OneBitAdam")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction)
        super().__init__(params, defaults, {})
        self.freeze_step = freeze_step
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name

    def wants_averaged_gradients(self) -> bool:
        return self.policy["step"] < self.freeze_step

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = run_closure(closure)
        compressing = not self.wants_averaged_gradients()
        self.policy["step"] += 1
        momenta = []
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                    state["exp_avg_sq"] = torch.zeros_like(p)
                g = self.grad_of(p)
                state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
                if not compressing:
                    state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
                momenta.append(state["exp_avg"])
        if compressing:
            self.compressed_average(momenta)
        for group in self.param_groups:
            for p in group["params"]:
                adam_update(p, self.state[p], group)
        return loss


def adam_update(p: torch.Tensor, state: dict, group: dict) -> None:
    """p -= lr * (m / (sqrt(v) + eps) + weight_decay * p): the 1-bit optimizers' Adam step."""
    update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
    if group["weight_decay"] > 0:
        update.add_(p, alpha=group["weight_decay"])
    p.add_(update, alpha=-group["lr"])
