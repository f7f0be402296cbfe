"""1-bit LAMB (Li et al., 2021, https://arxiv.org/abs/2104.06069), DeepSpeed's `OneBitLamb`.

* warm-up (steps 1 .. freeze_step): LAMB on dp-averaged gradients, without bias correction:
      m, v as Adam;  u = m / (sqrt(v) + eps) + weight_decay * p;  r = clamp(||p|| / ||u||,
      min_coeff, max_coeff);  p -= lr * r * u.  A running average of r (coeff_beta) is kept
      per tensor (steps where r is exactly 1 are left out, as in DeepSpeed), and a copy of v
      is taken at freeze_step ("fresh" variance).
* compression (later steps): v and the average ratio are frozen. Each tensor's momentum is
  multiplied by a scaling coefficient (fixed at the first compressed step so every tensor has
  the mean RMS), all momenta are averaged in 1-bit form as one vector, and divided back. The
  gradient is reconstructed from the momentum change, g = (m - b1 m_prev) / (1 - b1), and
  updates the fresh variance. The ratio becomes frozen_ratio * factor, with factor =
  max(denominator / fresh denominator) (mixed with 1 by the weight-decay share of the update),
  clamped to [factor_min, factor_max] and to within factor_threshold of the last factor.
"""

from __future__ import annotations

import math
from typing import Callable, Iterable

import torch

from trident.optim.compressed import CompressedOptimizer, check_common
from trident.optim.lamb import run_closure, trust_ratio


class OneBitLamb(CompressedOptimizer):
    """DeepSpeed's OnebitLamb arguments and defaults."""

    def __init__(self, params: Iterable, lr: float = 1e-3, freeze_step: int = 100000, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, eps_inside_sqrt: bool = False,
                 weight_decay: float = 0.0, max_coeff: float = 10.0, min_coeff: float = 0.01,
                 amsgrad: bool = False, cuda_aware: bool = False, comm_backend_name: str = "nccl",
                 coeff_beta: float = 0.9, factor_max: float = 4.0, factor_min: float = 0.5,
                 factor_threshold: float = 0.1) -> None:
        check_common("freeze_step", freeze_step, comm_backend_name, amsgrad, "OneBitLamb")
        if not 0 <= min_coeff <= max_coeff or not 0 < factor_min <= factor_max:
            raise ValueError(f"OneBitLamb needs 0 <= min_coeff <= max_coeff and 0 < factor_min <= factor_max, got "
                             f"{min_coeff}, {max_coeff}, {factor_min}, {factor_max}")
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, max_coeff=max_coeff,
                        min_coeff=min_coeff, bias_correction=bias_correction)
        super().__init__(params, defaults, {})
        self.freeze_step, self.coeff_beta = freeze_step, coeff_beta
        self.factor_max, self.factor_min, self.factor_threshold = factor_max, factor_min, factor_threshold
        self.cuda_aware, self.comm_backend_name = cuda_aware, comm_backend_name
        self.lamb_coeffs: list[float] = []

    def segments(self) -> list[int]:
        return [sum(p.numel() for p in self.params())]  # one scale for all momenta (after rescaling)

    def wants_averaged_gradients(self) -> bool:
        return self.policy["step"] < self.freeze_step

    def get_lamb_coeffs(self) -> list[float]:
        return list(self.lamb_coeffs)

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = run_closure(closure)
        compressing = not self.wants_averaged_gradients()
        self.policy["step"] += 1
        self.lamb_coeffs = []
        for p in self.params():
            if not self.state[p]:
                self.state[p].update(exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p),
                                     exp_avg_sq_fresh=torch.zeros_like(p), lamb_coeff_freeze=0.0, last_factor=1.0)
        if compressing:
            self._compressed_step()
        else:
            for group in self.param_groups:
                for p in group["params"]:
                    self.lamb_coeffs.append(self._warmup_param(p, group))
        return loss

    def _warmup_param(self, p: torch.Tensor, group: dict) -> float:
        state, g = self.state[p], self.grad_of(p)
        beta1, beta2 = group["betas"]
        state["exp_avg"].mul_(beta1).add_(g, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        if self.policy["step"] == self.freeze_step:
            state["exp_avg_sq_fresh"].copy_(state["exp_avg_sq"])
        update = state["exp_avg"] / (state["exp_avg_sq"].sqrt() + group["eps"])
        if group["weight_decay"] > 0:
            update.add_(p, alpha=group["weight_decay"])
        coeff = trust_ratio(p, update, group["min_coeff"], group["max_coeff"])
        if coeff != 1.0:
            state["lamb_coeff_freeze"] = self.coeff_beta * state["lamb_coeff_freeze"] + (1 - self.coeff_beta) * coeff
        p.add_(update, alpha=-group["lr"] * coeff)
        return coeff

    def _compressed_step(self) -> None:
        params = self.params()
        if "scaling_coeff" not in self.state[params[0]]:
            self._set_scaling_coeffs(params)
        previous = [self.state[p]["exp_avg"].clone() for p in params]
        for group in self.param_groups:
            beta1 = group["betas"][0]
            for p in group["params"]:
                state = self.state[p]
                state["exp_avg"].mul_(beta1).add_(self.grad_of(p), alpha=1 - beta1).mul_(state["scaling_coeff"])
        flat = torch.cat([self.state[p]["exp_avg"].reshape(-1) for p in params])
        self.compressed_average([flat])
        for p, piece in zip(params, torch.split(flat, [p.numel() for p in params])):
            self.state[p]["exp_avg"].copy_(piece.view_as(p)).div_(self.state[p]["scaling_coeff"])
        it = iter(previous)
        for group in self.param_groups:
            for p in group["params"]:
                self.lamb_coeffs.append(self._compressed_param(p, next(it), group))

    def _set_scaling_coeffs(self, params: list[torch.Tensor]) -> None:
        """Scale each momentum to the mean RMS of all of them, so one sign scale fits every tensor."""
        rms = [float(torch.linalg.vector_norm(self.state[p]["exp_avg"])) / math.sqrt(p.numel()) for p in params]
        united = sum(rms) / len(rms)
        for p, r in zip(params, rms):
            self.state[p]["scaling_coeff"] = united / r if r > 0 and united > 0 else 1.0

    def _compressed_param(self, p: torch.Tensor, m_prev: torch.Tensor, group: dict) -> float:
        state = self.state[p]
        beta1, beta2 = group["betas"]
        m = state["exp_avg"]
        g = (m - beta1 * m_prev) / (1 - beta1)
        state["exp_avg_sq_fresh"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
        denom = state["exp_avg_sq"].sqrt().add_(group["eps"])
        prelim = m / denom
        update = prelim + group["weight_decay"] * p if group["weight_decay"] > 0 else prelim
        factor = float((denom / (state["exp_avg_sq_fresh"].sqrt() + group["eps"])).max())
        if group["weight_decay"] > 0:
            norm = float(torch.linalg.vector_norm(update))
            share = min(1.0, float(torch.linalg.vector_norm(prelim)) / norm) if norm > 0 else 1.0
            factor = factor * share + (1.0 - share)
        factor = min(max(factor, self.factor_min), self.factor_max)
        last = state["last_factor"]
        factor = min(max(factor, last * (1.0 - self.factor_threshold)), last * (1.0 + self.factor_threshold))
        state["last_factor"] = factor
        coeff = state["lamb_coeff_freeze"] * factor
        p.add_(update, alpha=-group["lr"] * coeff)
        return coeff
