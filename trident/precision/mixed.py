"""fp32 master weights for bf16 / fp16 training.

The model computes in 16 bits, but small updates vanish when added to 16-bit weights (bf16
keeps 8 significant bits). So the optimizer updates an fp32 copy of every parameter (the
master weights) from fp32 gradients, and the 16-bit model weights are refreshed from the
masters after each step. In fp32 training the masters are the model's parameters themselves.
"""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(cfg) -> torch.dtype:
    """The model's dtype under a config: fp16, bf16 or fp32."""
    if cfg.fp16.enabled:
        return torch.float16
    if cfg.bf16.enabled:
        return torch.bfloat16
    return torch.float32


class MasterWeights:
    """Pairs each model parameter with the fp32 tensor the optimizer updates."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.model_params = params
        self.is_copy = [p.dtype != torch.float32 for p in params]
        self.master_params = [
            torch.nn.Parameter(p.detach().clone().float(), requires_grad=p.requires_grad)
            if copy else p
            for p, copy in zip(params, self.is_copy)
        ]
        # the pairs a refresh copies, as two lists: one multi-tensor copy, not a copy per parameter
        self._copies = ([p for p, c in zip(params, self.is_copy) if c],
                        [m for m, c in zip(self.master_params, self.is_copy) if c])

    def mapping(self) -> dict[int, torch.nn.Parameter]:
        """id(model param) -> master param, to retarget a user's optimizer."""
        return {id(p): m for p, m in zip(self.model_params, self.master_params)}

    def attach_grads(self, grads: list[torch.Tensor]) -> None:
        """Point every master's .grad at its fp32 accumulation buffer view."""
        for m, g in zip(self.master_params, grads):
            m.grad = g

    @torch.no_grad()
    def copy_to_model(self) -> None:
        """Refresh the 16-bit model weights from the masters after a step (one multi-tensor copy)."""
        if self._copies[0]:
            torch._foreach_copy_(*self._copies)

    @torch.no_grad()
    def copy_from_model(self) -> None:
        """Reset the masters from the model (after loading model weights only)."""
        if self._copies[0]:
            torch._foreach_copy_(self._copies[1], self._copies[0])


def retarget_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.nn.Parameter]) -> None:
    """Make a user-built optimizer update master weights instead of the 16-bit parameters."""
    if any(len(s) for s in optimizer.state.values()):
        raise ValueError(
            "the optimizer passed to trident.initialize already has state; pass a fresh "
            "optimizer (or its config) so its state can be kept in fp32 for the master weights"
        )
    for group in optimizer.param_groups:
        group["params"] = [mapping.get(id(p), p) for p in group["params"]]
