"""`fp8` for the tp-split layers: which column- and row-parallel layers get float8 GEMMs with
tp-wide scales (trident.tensor_parallel.fp8), by the section's filter and recipe."""

from __future__ import annotations

import torch

from trident.precision.fp8 import float8_config, keep_reason
from trident.tensor_parallel.fp8 import tp_float8
from trident.tensor_parallel.layers import ColumnParallelLinear, ReplicatedHeadsLinear, RowParallelLinear


REPLICATED_HEADS = "tensor-parallel replicated key/value heads: each rank holds only part of their output gradient"
"""Why a ReplicatedHeadsLinear stays in the compute dtype: a kv head shared by several tp ranks gets
from each only its query heads' share of the output gradient, while one process casts the summed
gradient; matching its scales (and casts) would need that gradient all-reduced before the GEMMs."""


def convert_tp_layers(model: torch.nn.Module, cfg) -> tuple[list[str], dict[str, str]]:
    """Give the model's column- and row-parallel layers FP8 GEMMs (`cfg`: the `fp8` section,
    its filter applied to their names). Returns (converted names, {kept name: why})."""
    converted, kept = [], {}
    for name, m in model.named_modules():
        if isinstance(m, ReplicatedHeadsLinear):
            kept[name] = REPLICATED_HEADS
        elif isinstance(m, (ColumnParallelLinear, RowParallelLinear)):
            reason = keep_reason(cfg, name, m.weight.shape)
            if reason is not None:
                kept[name] = reason
                continue
            row = isinstance(m, RowParallelLinear)
            m.fp8 = tp_float8(float8_config(cfg), m.tp, input_split=row, grad_output_split=not row)
            converted.append(name)
    return converted, kept
