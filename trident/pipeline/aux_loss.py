"""Auxiliary losses (MoE load balancing, router z-loss) of layers on any pipeline stage.

A pipeline computes the training loss on its last stage only, but a mixture-of-experts layer on
stage 0 has a loss of its own that must add to it. Sending it forward through every later stage
would change what crosses the wire; instead the layer hands it to `add_aux_loss`, which

- attaches it to the layer's output in autograd (`_AttachAuxLoss`: identity forward, and in
  backward the aux loss gets the gradient the last stage gives its own loss, `loss_scale / M`),
  so the stage's backward of that micro-batch adds d(aux)/d(parameters) exactly as a single
  process's backward of (loss + aux) / M does; recomputed forwards (activation checkpointing)
  attach it again, so the gradient arrives whichever forward the backward runs through;
- records its value for the loss the engine reports (`collecting`): each stage sums the aux
  losses of its micro-batches and the engine adds their mean to the mean last-stage loss.

Outside a pipeline executor's training run (eval_batch, a single-stage module's `forward`) the
output is returned as is and only the value is recorded, when something collects it.

The scale is process-wide state (one executor runs at a time in a process), not a context
variable: autograd may run a backward on a thread of its own (CUDA), where a context variable
set by the executor would not be seen.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

_GRAD_SCALE: list[float | None] = [None]
"""The gradient of every aux loss in the current training run: the executor's loss_scale / M."""
_COLLECTED: list[list[torch.Tensor] | None] = [None]
"""Aux loss values of the forward being run, or None when nothing collects them."""


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on `x`; backward also returns `scale` as the gradient of the scalar `aux`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale, ctx.aux_dtype, ctx.aux_device = scale, aux.dtype, aux.device
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=ctx.aux_device), None


def add_aux_loss(x: torch.Tensor, aux: torch.Tensor) -> torch.Tensor:
    """`x`, carrying the scalar loss `aux` into this stage's backward (see the module docstring)."""
    if _COLLECTED[0] is not None:
        _COLLECTED[0].append(aux.detach().float())
    scale = _GRAD_SCALE[0]
    if scale is None or not torch.is_grad_enabled() or not aux.requires_grad:
        return x
    return _AttachAuxLoss.apply(x, aux, scale)


@contextlib.contextmanager
def training_run(loss_scale: float) -> Iterator[None]:
    """Aux losses attached within get `loss_scale` (the last stage's loss scale / M) as gradient."""
    _GRAD_SCALE[0] = loss_scale
    try:
        yield
    finally:
        _GRAD_SCALE[0] = None


@contextlib.contextmanager
def collecting() -> Iterator[list[torch.Tensor]]:
    """The aux loss values recorded by the forward run inside (recomputations left out)."""
    outer, values = _COLLECTED[0], []
    _COLLECTED[0] = values
    try:
        yield values
    finally:
        _COLLECTED[0] = outer


__all__ = ["add_aux_loss", "collecting", "training_run"]
