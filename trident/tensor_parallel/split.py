"""How a full tensor maps to tp shards, and state dicts split into shards and merged back.

A `ShardSpec` says which dim a parameter is split along, its unpadded full size there, the tp
size, and the stride (fused blocks). It is pure arithmetic on tensors (no process group), so
full checkpoints can be split for any tp size and shards merged back in a test or a tool.

    stride 1:  full [A | B | C | D] over tp=2  -> rank 0 [A B], rank 1 [C D]
    stride 3:  full [q0 q1 | k0 k1 | v0 v1]     -> rank 0 [q0 k0 v0], rank 1 [q1 k1 v1]

A stride keeps fused projections whole per rank: a fused q|k|v weight split with stride 3
gives each rank the q, k and v of the same heads.

Vocabulary padding follows Megatron-LM: a vocabulary-split dim (`pad=True`) is padded with
zero rows up to a multiple of tp, the pad entries never win a lookup and their logits are
excluded from the loss; `merge` strips them again.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import torch
from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """Split `full_size` entries of dim `dim` over `tp_size` ranks (see the module docstring)."""

    dim: int
    full_size: int
    tp_size: int
    stride: int = 1
    pad: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.stride < 1 or self.full_size < 1:
            raise ValueError(f"ShardSpec needs full_size, tp_size and stride >= 1, got {self}")
        if self.pad and self.stride != 1:
            raise ValueError(f"ShardSpec: vocabulary padding (pad=True) needs stride 1, got stride {self.stride}")
        if not self.pad and self.full_size % (self.tp_size * self.stride):
            parts = f"tp={self.tp_size}" + (f" x {self.stride} fused blocks = {self.tp_size * self.stride}"
                                             if self.stride > 1 else "")
            raise ValueError(f"size {self.full_size} of dim {self.dim} is not divisible by {parts}; choose a "
                             f"size that is a multiple of {self.tp_size * self.stride}")

    @property
    def padded_size(self) -> int:
        """The full size rounded up to a multiple of tp (equal to full_size without `pad`)."""
        return -(-self.full_size // self.tp_size) * self.tp_size

    @property
    def local_size(self) -> int:
        """Entries of dim `dim` on each rank."""
        return self.padded_size // self.tp_size

    def shard(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank `rank`'s shard of `full` (a new contiguous tensor; pad entries are zero)."""
        if full.shape[self.dim] != self.full_size:
            raise ValueError(f"ShardSpec.shard: dim {self.dim} of the tensor is {full.shape[self.dim]}, "
                             f"expected {self.full_size}")
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"ShardSpec.shard: rank {rank} is not in [0, {self.tp_size})")
        if self.padded_size != self.full_size:
            pad_shape = list(full.shape)
            pad_shape[self.dim] = self.padded_size - self.full_size
            full = torch.cat([full, full.new_zeros(pad_shape)], dim=self.dim)
        blocks = full.chunk(self.stride, dim=self.dim)
        return torch.cat([b.chunk(self.tp_size, dim=self.dim)[rank] for b in blocks], dim=self.dim).contiguous()

    def merge(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The full tensor from every rank's shard, in tp-rank order (padding removed)."""
        if len(shards) != self.tp_size:
            raise ValueError(f"ShardSpec.merge: got {len(shards)} shards for tp={self.tp_size}")
        per_rank = [s.chunk(self.stride, dim=self.dim) for s in shards]
        blocks = [torch.cat([p[j] for p in per_rank], dim=self.dim) for j in range(self.stride)]
        return torch.cat(blocks, dim=self.dim).narrow(self.dim, 0, self.full_size).contiguous()


def shard_specs(model: nn.Module) -> dict[str, ShardSpec]:
    """The ShardSpec of every tp-split tensor of `model`, by state-dict name (tied names too, and
    buffers that hold a split weight, such as a pipeline stage's copy of a tied embedding)."""
    return {name: t.tp_spec for name, t in model.state_dict(keep_vars=True).items()
            if getattr(t, "tensor_model_parallel", False)}


def split_state_dict(full: Mapping[str, torch.Tensor], specs: Mapping[str, ShardSpec],
                     tp_rank: int) -> dict[str, torch.Tensor]:
    """Rank `tp_rank`'s state dict: split tensors sharded by their spec, the rest copied."""
    unknown = set(specs) - set(full)
    if unknown:
        raise KeyError(f"split_state_dict: specs name tensors missing from the state dict: {sorted(unknown)}")
    return {name: specs[name].shard(t, tp_rank) if name in specs else t.clone() for name, t in full.items()}


def merge_state_dicts(shards: Sequence[Mapping[str, torch.Tensor]],
                      specs: Mapping[str, ShardSpec]) -> dict[str, torch.Tensor]:
    """The full state dict from every tp rank's state dict (in tp-rank order).

    Replicated tensors are taken from rank 0 after checking that every rank holds the same
    values: a difference means the ranks drifted apart, which merging would hide.
    """
    names = list(shards[0])
    for rank, sd in enumerate(shards[1:], start=1):
        if list(sd) != names:
            raise KeyError(f"merge_state_dicts: rank {rank}'s names differ from rank 0's: "
                           f"{sorted(set(sd) ^ set(names))}")
    merged = {}
    for name in names:
        if name in specs:
            merged[name] = specs[name].merge([sd[name] for sd in shards])
            continue
        for rank, sd in enumerate(shards[1:], start=1):
            if not torch.equal(sd[name], shards[0][name]):
                raise ValueError(f"merge_state_dicts: replicated tensor {name!r} differs between tp rank 0 "
                                 f"and tp rank {rank}; the ranks were not kept in sync")
        merged[name] = shards[0][name].clone()
    return merged
