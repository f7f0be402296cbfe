"""ZeRO stage 1 gradients: kept whole on every rank, reduce-scattered once per optimizer step.

Stage 1 partitions only the optimizer states. Each rank still accumulates the full gradient of
every parameter locally (in one flat buffer, laid out like the flat parameter buffer, so each
parameter's `.grad` is a view of it), and nothing is sent until the last micro-step of the
accumulation window. Then each unit (bucket) is reduce-scattered: rank r receives the sum of
shard r over the dp group, the only part its optimizer partition needs. With `overlap_comm`
each unit goes out as soon as backward has produced all its gradients.

With `reduce_scatter: false` the unit is all-reduced instead and the rank keeps its shard:
the same result for twice the traffic (DeepSpeed's switch, kept for comparison).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.buckets import GradScaling
from trident.comm.logger import CommsLogger
from trident.zero.partition import ShardedLayout


class FullGradients:
    """Flat local gradient buffer of a stage 1 partition group, reduced to shards on the boundary."""

    def __init__(self, params: list[torch.nn.Parameter], layout: ShardedLayout, unit_starts: list[int],
                 group: dist.ProcessGroup, rank: int, dtype: torch.dtype, overlap_comm: bool,
                 reduce_scatter: bool, scaling: GradScaling, logger: CommsLogger | None,
                 comm_dtype: torch.dtype | None = None) -> None:
        self.params, self.layout, self.unit_starts = params, layout, unit_starts
        self.group, self.rank = group, rank
        self.overlap_comm, self.use_reduce_scatter = overlap_comm, reduce_scatter
        self.scaling, self.logger = scaling, logger
        self.comm_dtype = comm_dtype or dtype  # `communication_data_type`: the dtype on the wire
        total = unit_starts[-1] + layout.units[-1].padded if layout.units else 0
        self.buffer = torch.zeros(total, dtype=dtype, device=params[0].device if params else "cpu")
        unit_of = layout.unit_of()
        self.views = []
        for i, p in enumerate(params):
            u = unit_of[i]
            slot = next(s for s in u.slots if s.index == i)
            start = unit_starts[u.index] + slot.offset
            self.views.append(self.buffer[start:start + slot.numel].view(p.shape))
        self._unit_of_param = [unit_of[i].index for i in range(len(params))]
        self._fresh = [True] * len(params)
        self._missing: list[int] = []
        self._sync = False
        self._next = 0
        self._handles: list[tuple[int, object, torch.Tensor | None]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    def shard(self, unit: int) -> torch.Tensor:
        """This rank's shard of a unit's gradient (valid after the boundary's reduction)."""
        lo, hi = self.layout.units[unit].shard_range(self.rank)
        start = self.unit_starts[unit]
        return self.buffer[start + lo:start + hi]

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            grad, view = param.grad, self.views[i]
            if self._fresh[i]:
                view.copy_(grad)
                self._fresh[i] = False
            elif grad is not view:
                view.add_(grad)
            param.grad = view  # autograd adds the rest of the window in place
            if self._sync:
                u = self._unit_of_param[i]
                self._missing[u] -= 1
                if self.overlap_comm:
                    self._launch_ready()
        return hook

    def _launch_ready(self) -> None:
        while self._next < len(self.layout.units) and self._missing[self._next] == 0:
            self._launch(self._next)

    def _launch(self, u: int) -> None:
        unit = self.layout.units[u]
        start = self.unit_starts[u]
        full = self.buffer[start:start + unit.padded]
        self.scaling.before(full)
        wire = full if full.dtype == self.comm_dtype else full.to(self.comm_dtype)
        if self.use_reduce_scatter:
            out = torch.empty(unit.shard, dtype=wire.dtype, device=full.device)
            handle = collectives.reduce_scatter(out, wire, group=self.group, async_op=True, logger=self.logger)
        else:
            out = None if wire is full else wire[self.rank * unit.shard:(self.rank + 1) * unit.shard]
            handle = collectives.all_reduce(wire, group=self.group, async_op=True, logger=self.logger)
        self._handles.append((u, handle, out))
        self._next += 1

    def start_backward(self, boundary: bool) -> None:
        self._boundary = boundary
        self._sync = boundary
        self._missing = [len(u.slots) for u in self.layout.units]
        self._next = 0
        self._handles = []

    def finish_backward(self) -> None:
        if not self._boundary:
            return
        for i in (i for i, fresh in enumerate(self._fresh) if fresh):
            self.views[i].zero_()  # no gradient in the whole window: zero, not stale
            self._fresh[i] = False
        while self._next < len(self.layout.units):
            self._launch(self._next)
        for u, handle, out in self._handles:
            handle.wait()
            shard = self.shard(u)
            if out is not None:
                shard.copy_(out)
            self.scaling.after(shard)
        self._handles = []
        self._sync = False

    def zero_grad(self) -> None:
        self._fresh = [True] * len(self.params)
        for p in self.params:
            p.grad = None  # autograd hands over a fresh gradient instead of adding to a stale one

