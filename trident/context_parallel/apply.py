"""What `trident.initialize` does for `context_parallel: {size, method, ulysses_size}`.

A model takes part in one of three ways:
  - it has `parallelize_context(cp)` (trident's GPT and its pipeline layers): it shards its
    inputs, uses global positions, calls `attention` with its handle and averages its loss over
    all tokens;
  - it sets `context_parallel_aware = True` and does those things itself with
    `shard_batch`, `ContextParallel.positions`, `attention` and `ContextParallel.global_mean`
    (the handle is `model.context_parallel`, and `current()` while the model runs).
  - its model family knows how (`ModelAdapter.parallelize_context`, trident.parallel.adapter):
    GPT inside a wrapper; an unmodified `transformers` causal LM gets its attention
    implementation, inputs and loss adapted from outside (`trident.models.transformers`).
Any other model is refused: its attention would see only its own shard and train wrongly.
"""

from __future__ import annotations

import torch
from torch import nn

from trident.comm.logger import CommsLogger
from trident.context_parallel.attention import bind, current
from trident.context_parallel.layout import ContextParallel
from trident.parallel.adapter import adapter_for


def apply_context_parallel(model: nn.Module, section, mesh, logger: CommsLogger | None = None) -> ContextParallel:
    """Give `model` (or each layer of a PipelineModule) the cp handle of `mesh`; returns it."""
    cp = ContextParallel.from_mesh(mesh, section.method, section.ulysses_size, logger)
    if not _is_aware(model):
        adapter = adapter_for(model)  # the model's family: GPT inside a wrapper, a transformers model
        if adapter is not None and adapter.parallelize_context(cp):
            bind(model, cp)
            return cp
    targets = _aware_modules(model)
    if not targets:
        raise ValueError(
            f"context_parallel.size={cp.size}: {type(model).__name__} has no context-parallel attention. "
            f"A model runs under cp when it (or a layer of a PipelineModule) has parallelize_context(cp) "
            f"(trident's GPT does), or sets context_parallel_aware = True and calls "
            f"trident.context_parallel.attention(q, k, v, causal=..., doc_ids=...) on sequence shards; "
            f"otherwise set context_parallel.size to 1")
    for module in targets:
        if hasattr(module, "parallelize_context"):
            module.parallelize_context(cp)
    bind(model, cp)
    return cp


def _is_aware(model: nn.Module) -> bool:
    return hasattr(model, "parallelize_context") or getattr(model, "context_parallel_aware", False)


def _aware_modules(model: nn.Module) -> list:
    """What takes the handle: the model if it is aware; else (a PipelineModule's stage, a wrapper)
    every submodule with `parallelize_context`, and the loss function if it has one."""
    if _is_aware(model):
        return [model]
    aware = [m for m in model.modules() if hasattr(m, "parallelize_context")]
    loss_fn = getattr(model, "loss_fn", None)
    if loss_fn is not None and hasattr(loss_fn, "parallelize_context"):
        aware.append(loss_fn)
    return aware


def shard_batch(*tensors: torch.Tensor | None, dim: int = 1, cp: ContextParallel | None = None):
    """This cp rank's shard of each full-sequence tensor (None passes through); one tensor in,
    one out. For models that are `context_parallel_aware`."""
    cp = cp if cp is not None else current()
    out = [t if t is None or cp is None else cp.shard(t, dim) for t in tensors]
    return out[0] if len(out) == 1 else tuple(out)
