"""Split backward for zero-bubble schedules: input gradients now, weight gradients later.

A linear layer's backward computes gx = gy W (needed at once by the previous stage) and
gW = gy^T x (needed only by the optimizer step). Forwards run under `defer_weight_grads(store)`
route every `F.linear` whose weight is a leaf parameter through `_DeferredLinear`, whose
backward returns gx and leaves gW (and the bias gradient) as a closure in `store`;
`store.flush()` computes them and accumulates them into the parameters through autograd, so
gradient hooks (the data-parallel reducer's) fire as for any gradient. Other parameters
(norms, embeddings) get their gradients in the input pass as usual.

Linear layers carry nearly all the weight-gradient work of a transformer, which is what the
schedule moves. Recomputed (activation-checkpointed) layers are not deferred.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode


class WeightGradStore:
    """The deferred weight-gradient work of one (micro-batch, chunk)."""

    def __init__(self) -> None:
        # Keeps a deferred linear's output in the graph when neither its input nor (detached)
        # weight requires grad, e.g. the first layer of a model: its backward must still run.
        self.anchor = torch.zeros((), requires_grad=True)
        self._pending: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, weight: torch.Tensor, x: torch.Tensor, gy: torch.Tensor, bias: torch.Tensor | None) -> None:
        self._pending.append((weight, x, gy, bias))

    def flush(self) -> None:
        """Compute every deferred gradient and accumulate it into its parameter."""
        sums: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for weight, x, gy, bias in self._pending:
            gy2 = gy.reshape(-1, gy.shape[-1])
            _add(sums, weight, gy2.t().mm(x.reshape(-1, x.shape[-1])))
            if bias is not None:
                _add(sums, bias, gy2.sum(0))
        self._pending.clear()
        if sums:
            params, grads = zip(*sums.values())
            torch.autograd.backward(list(params), list(grads))


def _add(sums: dict, param: torch.Tensor, grad: torch.Tensor) -> None:
    grad = grad.to(param.dtype)
    if id(param) in sums:
        sums[id(param)] = (param, sums[id(param)][1] + grad)
    else:
        sums[id(param)] = (param, grad)


class _DeferredLinear(torch.autograd.Function):
    """y = x W^T + b whose backward returns only dL/dx and defers dL/dW, dL/db to `store`.

    The parameters come in detached, with the originals in a tuple (which autograd does not
    track): the graph then has no edge to them, so the input pass does not touch them at all.
    The store's anchor takes their place as the input that requires grad.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, anchor: torch.Tensor,
                store: WeightGradStore, params: tuple) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.store, ctx.params = store, params
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        x, weight = ctx.saved_tensors
        gx = gy.matmul(weight) if ctx.needs_input_grad[0] else None
        ctx.store.add(ctx.params[0], x, gy, ctx.params[1])
        return gx, None, None, None, None, None


class defer_weight_grads(TorchFunctionMode):
    """Within this context, linear layers with leaf weights defer their weight gradients to `store`."""

    def __init__(self, store: WeightGradStore) -> None:
        super().__init__()
        self.store = store

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and torch.is_grad_enabled():
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if _deferrable(weight) and (bias is None or _deferrable(bias)):
                detached = bias.detach() if bias is not None else None
                return _DeferredLinear.apply(x, weight.detach(), detached, self.store.anchor, self.store,
                                             (weight, bias))
        return func(*args, **kwargs)


def _deferrable(t: Any) -> bool:
    # Only leaf parameters: a computed weight's graph would be freed by the input pass.
    return isinstance(t, torch.Tensor) and t.requires_grad and t.is_leaf
