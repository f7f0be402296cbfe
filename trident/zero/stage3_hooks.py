"""The autograd side of ZeRO-3: a linear layer that saves its weight Parameter (not a view that
would keep released storage alive), and the hooks that gather a module's units again when
backward reaches it.
"""

from __future__ import annotations

import torch


class Stage3Linear(torch.autograd.Function):
    """`F.linear` that saves the weight Parameter itself for backward. Autograd's own linear
    saves the transposed weight, a view that would keep every released unit's storage alive
    until backward; the Parameter's data is empty between forward and backward instead, and
    backward reads the re-gathered weight (the module's units are gathered before it runs)."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return torch.nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad.matmul(weight) if ctx.needs_input_grad[0] else None
        flat = grad.reshape(-1, grad.shape[-1])
        grad_w = flat.t().matmul(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        grad_b = flat.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


def linear_forward(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return Stage3Linear.apply(x, module.weight, module.bias)


def gather_in_backward(output, coordinator, module):
    """Gather the module's units again when backward reaches it: a hook on each output that
    needs a gradient fires once that output's gradient is complete, before the module's own
    backward runs (no operator is added to the graph)."""
    tensors = [t for t in _tensors_in(output) if t.requires_grad and t.grad_fn is not None]
    if tensors:
        hook = GatherOnce(coordinator, module)
        for t in tensors:
            t.register_hook(hook)
    return output


class GatherOnce:
    """A tensor hook that fetches a module's units the first time backward reaches any of its outputs."""

    __slots__ = ("coordinator", "module", "done")

    def __init__(self, coordinator, module) -> None:
        self.coordinator, self.module, self.done = coordinator, module, False

    def __call__(self, grad):
        if not self.done:
            self.done = True
            self.coordinator.fetch_module(self.module)


def _tensors_in(output):
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for o in output:
            yield from _tensors_in(o)
    elif isinstance(output, dict):
        for o in output.values():
            yield from _tensors_in(o)
