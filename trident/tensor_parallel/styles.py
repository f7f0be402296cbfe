"""The styles a tensor-parallel plan gives a module: how each layer is split over the tp ranks.

A plan (trident.tensor_parallel.plan) maps module-name patterns to these; `STYLES` are the names
a JSON config may use for the common ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union


@dataclass(frozen=True)
class Column:
    """Split an nn.Linear by output features. `stride`: fused blocks (3 for a q|k|v projection);
    `pad_vocab`: a vocabulary head whose size may be padded to a multiple of tp."""

    gather_output: bool = False
    stride: int = 1
    pad_vocab: bool = False


@dataclass(frozen=True)
class Row:
    """Split an nn.Linear by input features; `input_is_parallel=False` splits a replicated input."""

    input_is_parallel: bool = True


@dataclass(frozen=True)
class Vocab:
    """Split an nn.Embedding by vocabulary rows."""


@dataclass(frozen=True)
class KVHeads:
    """A key or value projection whose heads are fewer than tp ranks (grouped-query attention):
    kept whole on every rank, each using the head its query heads share
    (`ReplicatedHeadsLinear`). `head_dim`: features per head."""

    head_dim: int


@dataclass(frozen=True)
class SumGrad:
    """A module kept whole on every rank but fed only this rank's heads (a per-head norm such as
    Qwen3's q_norm): its parameters' gradients are summed over tp. transformers calls it
    "replicated_with_grad_allreduce"."""


Style = Union[Column, Row, Vocab, KVHeads, SumGrad]
STYLES: dict[str, Style] = {
    "column": Column(),
    "column_gather": Column(gather_output=True, pad_vocab=True),
    "row": Row(),
    "vocab": Vocab(),
}
