"""`fp8` for the tp-split layers: which column- and row-parallel layers get float8 GEMMs with
tp-wide scales (trident.tensor_parallel.fp8), by the section's filter and recipe."""

from __future__ import annotations

import torch

from trident.precision.fp8 import float8_config, keep_reason
from trident.tensor_parallel.fp8 import tp_float8
from trident.tensor_parallel.layers import ColumnParallelLinear, ReplicatedHeadsLinear, RowParallelLinear


def convert_tp_layers(model: torch.nn.Module, cfg) -> tuple[list[str], dict[str, str]]:
    """Give the model's column- and row-parallel layers FP8 GEMMs (`cfg`: the `fp8` section,
    its filter applied to their names). Returns (converted names, {kept name: why})."""
    converted, kept = [], {}
    for name, m in model.named_modules():
        if isinstance(m, ReplicatedHeadsLinear):
            kept[name] = "tensor-parallel replicated key/value heads: FP8 not implemented for them yet"
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            reason = keep_reason(cfg, name, m.weight.shape)
            if reason is not None:
                kept[name] = reason
                continue
            row = isinstance(m, RowParallelLinear)
            m.fp8 = tp_float8(float8_config(cfg), m.tp_group, input_split=row, grad_output_split=not row)
            converted.append(name)
    return converted, kept
