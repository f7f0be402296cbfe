"""`deepspeed.ops.adam`: `DeepSpeedCPUAdam` and `FusedAdam`, as torch optimizers.

`DeepSpeedCPUAdam` is trident's `CPUAdam` (torch's fused CPU Adam/AdamW); `FusedAdam` is
`torch.optim.Adam` / `AdamW` with DeepSpeed's argument names (`adam_w_mode`, default True,
decouples the weight decay). Both take `bias_correction=True` only: torch's Adam always
corrects the bias.
"""

from __future__ import annotations

from typing import Iterable

import torch

from trident.optim.cpu_adam import CPUAdam

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


def _bias_correction(value: bool, name: str) -> None:
    if not value:
        raise ValueError(f"{name}(bias_correction=False) is not supported: torch's Adam always corrects the bias")


class DeepSpeedCPUAdam(CPUAdam):
    """DeepSpeed's CPU Adam: `DeepSpeedCPUAdam(model_params, lr=1e-3, bias_correction=True,
    betas=(0.9, 0.999), eps=1e-8, weight_decay=0, amsgrad=False, adamw_mode=True,
    fp32_optimizer_states=True)`."""

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, amsgrad=amsgrad, adamw_mode=adamw_mode,
                         fp32_optimizer_states=fp32_optimizer_states)


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam: `FusedAdam(params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999),
    eps=1e-8, adam_w_mode=True, weight_decay=0.0, amsgrad=False, set_grad_none=True)`."""

    def __init__(self, params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        del set_grad_none  # torch sets gradients to None on zero_grad by default
        _bias_correction(bias_correction, "FusedAdam")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode
