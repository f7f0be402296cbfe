"""Dropout on split tensors that draws the same masks as one process would.

Two cases, matching the two RNG regions (see trident.parallel.rng):

- `SequenceParallelDropout` (default region, sequence shards): every tp rank draws the mask
  of the *whole* sequence from the default generator, exactly as nn.Dropout would on the
  unsplit tensor, and keeps its own shard. The default generator therefore advances in step
  on every tp rank and with a run without sequence parallelism, and the masks are those of
  one process. The price is one full-size random draw per rank (no extra memory beyond a
  transient mask, no communication).
- `unit_dropout` (model-parallel region, split by units such as heads): unit u's mask comes
  from unit u's own stream, so a rank draws only the masks of the units it holds and the
  result does not depend on how the units are spread over ranks.
"""

from __future__ import annotations

from typing import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from trident.tensor_parallel.mappings import SEQUENCE_DIM


class SequenceParallelDropout(nn.Module):
    """nn.Dropout(p) on this rank's sequence shard of a tensor split along `dim` over tp.

    Draws the multiplier nn.Dropout(p) draws for the whole tensor and keeps this rank's slice;
    on CPU the result is bit for bit nn.Dropout's on the unsplit tensor, sliced.
    """

    def __init__(self, p: float, mesh, dim: int = SEQUENCE_DIM) -> None:
        super().__init__()
        if not 0.0 <= p < 1.0:
            raise ValueError(f"SequenceParallelDropout p must be in [0, 1), got {p}")
        self.p, self.dim = p, dim
        self.tp_size, self.tp_rank = mesh.tp_size, mesh.tp_rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        full_shape = list(x.shape)
        full_shape[self.dim] *= self.tp_size
        # dropout of ones is the multiplier nn.Dropout draws for a tensor of this shape (0 or 1/(1-p))
        noise = F.dropout(torch.ones(full_shape, dtype=x.dtype, device=x.device), self.p, training=True)
        return x * noise.chunk(self.tp_size, dim=self.dim)[self.tp_rank]

    def extra_repr(self) -> str:
        return f"p={self.p}, sequence dim {self.dim} split over tp={self.tp_size}"


def unit_dropout_mask(shape: Sequence[int], unit_dim: int, generators: Sequence[torch.Generator], p: float,
                      dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> torch.Tensor:
    """A dropout multiplier (0 or 1 / (1 - p)) of `shape`, slice i along `unit_dim` from generators[i].

    `shape[unit_dim]` must equal the number of generators: one stream per unit held here.
    """
    if shape[unit_dim] != len(generators):
        raise ValueError(f"unit_dropout_mask: dim {unit_dim} of shape {tuple(shape)} has {shape[unit_dim]} units "
                         f"but {len(generators)} generators were given; pass one generator per unit")
    unit_shape = list(shape)
    unit_shape[unit_dim] = 1
    masks = [torch.empty(unit_shape, dtype=dtype, device=device).bernoulli_(1.0 - p, generator=g)
             for g in generators]
    return torch.cat(masks, dim=unit_dim).div_(1.0 - p)
