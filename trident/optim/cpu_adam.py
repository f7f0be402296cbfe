"""The CPU optimizer step of ZeRO-Offload: Adam / AdamW over host-memory fp32 buffers.

DeepSpeed ships a C++ `DeepSpeedCPUAdam` (AVX, OpenMP). PyTorch's own fused CPU kernels
(`torch.optim.Adam(..., fused=True)`, one vectorised pass over each tensor, parallel over the
intra-op threads) are as fast on this class of machine: `python bench/cpu_optimizer.py` measured
them about 5-7x faster than torch's default and foreach paths on 100M and 400M parameters, so
trident's CPU optimizer *is* that kernel, behind DeepSpeed's constructor. Its state per parameter
is torch's (`step`, `exp_avg`, `exp_avg_sq`), so checkpoints interoperate with torch.optim.Adam /
AdamW.
"""

from __future__ import annotations

from typing import Iterable

import torch


class CPUAdam(torch.optim.Adam):
    """DeepSpeedCPUAdam's signature on torch's fused CPU Adam kernel.

    `adamw_mode=True` (DeepSpeed's default) decouples the weight decay (AdamW); False adds it to
    the gradient (L2). `bias_correction=False` is not offered by torch's kernel and is refused.
    `fp32_optimizer_states` is accepted for compatibility: the states are kept in the parameters'
    dtype, fp32 for ZeRO's master weights.
    """

    def __init__(self, model_params: Iterable, lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        if not bias_correction:
            raise ValueError("CPUAdam: bias_correction=False is not supported (torch's fused kernel always "
                             "corrects the moments' bias); leave it true")
        self.adamw_mode = adamw_mode
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         fused=True, decoupled_weight_decay=adamw_mode)
