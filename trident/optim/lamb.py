"""LAMB (You et al., 2020, "Large Batch Optimization for Deep Learning: Training BERT in 76
minutes"), with DeepSpeed's `Lamb` (FusedLamb) arguments, defaults and arithmetic.

Per parameter tensor, each step t:

    m = b1 m + (1 - b1) g,   v = b2 v + (1 - b2) g^2
    u = m / (sqrt(v) + eps) + weight_decay * p        (eps_inside_sqrt: m / sqrt(v + eps) + ...)
    trust = clamp(||p|| / ||u||, min_coeff, max_coeff), or 1 when either norm is 0
    p -= step_size * trust * u,   step_size = lr * sqrt(1 - b2^t) / (1 - b1^t)   (lr without
                                                                                bias_correction)

As in DeepSpeed's kernel, the bias correction is folded into the step size, so the trust ratio
is taken on the uncorrected moments (the paper writes it on the corrected ones; the two agree
without bias correction). The last step's ratios are kept for `get_lamb_coeffs()`.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch


class Lamb(torch.optim.Optimizer):
    """DeepSpeed's FusedLamb, in plain torch (any device)."""

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False) -> None:
        if amsgrad:
            raise ValueError("Lamb does not support the AMSGrad variant (DeepSpeed's FusedLamb neither); set "
                             "amsgrad to false")
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"Lamb needs 0 <= min_coeff <= max_coeff, got min_coeff={min_coeff}, "
                             f"max_coeff={max_coeff}")
        defaults = dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                        weight_decay=weight_decay, max_coeff=max_coeff, min_coeff=min_coeff)
        super().__init__(params, defaults)
        self.eps_inside_sqrt = eps_inside_sqrt
        self.lamb_coeffs: list[float] = []

    def get_lamb_coeffs(self) -> list[float]:
        """The trust ratio each parameter was stepped with at the last step."""
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = run_closure(closure)
        self.lamb_coeffs = []
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                self.lamb_coeffs.append(self._step_param(p, p.grad, group))
        return loss

    def _step_param(self, p: torch.Tensor, g: torch.Tensor, group: dict) -> float:
        state = self.state[p]
        if not state:
            state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
        beta1, beta2 = group["betas"]
        state["step"] += 1
        m, v = state["exp_avg"], state["exp_avg_sq"]
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = (v + group["eps"]).sqrt() if self.eps_inside_sqrt else v.sqrt().add_(group["eps"])
        update = m / denom
        if group["weight_decay"] != 0:
            update.add_(p, alpha=group["weight_decay"])
        coeff = trust_ratio(p, update, group["min_coeff"], group["max_coeff"])
        step_size = group["lr"]
        if group["bias_correction"]:
            t = state["step"]
            step_size *= math.sqrt(1 - beta2 ** t) / (1 - beta1 ** t)
        p.add_(update, alpha=-step_size * coeff)
        return coeff


def run_closure(closure: Callable | None):
    """torch's optimizer contract: re-evaluate the loss with gradients on, when asked to."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


def trust_ratio(p: torch.Tensor, update: torch.Tensor, min_coeff: float, max_coeff: float) -> float:
    """||p|| / ||update|| clamped to [min_coeff, max_coeff]; 1 when either norm is zero."""
    w = float(torch.linalg.vector_norm(p))
    u = float(torch.linalg.vector_norm(update))
    if w == 0 or u == 0:
        return 1.0
    return min(max(w / u, min_coeff), max_coeff)
