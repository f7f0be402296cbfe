"""ZeRO stage 2 (and 3) gradients: reduce-scattered during every backward, kept as shards only.

No rank ever holds a whole gradient for long. As backward produces a parameter's gradient, a
hook copies it into its bucket's staging buffer and drops it; when every parameter of a bucket
has arrived the bucket is reduce-scattered asynchronously (`overlap_comm`), and rank r adds the
result, shard r of the summed gradient, into its partition's gradient buffer. Buckets are
launched strictly in order, so all ranks issue the same collectives whatever order their hooks
fire in. This happens on every micro-step (the full gradient cannot wait for the window's end,
there is nowhere to keep it), so accumulation happens in the partitions.

A bucket is one or more consecutive units (stage 2: one unit of about `reduce_bucket_size`
elements; stage 3: the modules' units, grouped up to `reduce_bucket_size`). Its staging
buffer is [N, sum of the units' shards]: column block u holds unit u, row r its shard r, so one
reduce-scatter delivers to rank r exactly its shards of all the units, which sit side by side in
its partition. At most `MAX_IN_FLIGHT` reductions are outstanding: launching another first
finishes the oldest, so the staging buffers alive during backward are bounded by a few buckets.

`contiguous_gradients` (on by default) accumulates into one preallocated partition buffer; off,
each bucket's shard is kept as its own tensor, allocated as it arrives and joined at the step.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger
from trident.zero.partition import ShardedLayout, Unit
from trident.comm.buckets import GradScaling


MAX_IN_FLIGHT = 2
"""Bucket reductions outstanding at once: the third launch waits for the first, so only a few
staging buffers (each a whole bucket) are alive during backward, not every bucket's."""


class ShardedGradients:
    """The gradient partition of one partition group (stages 2 and 3)."""

    def __init__(self, params: list[torch.nn.Parameter], layout: ShardedLayout, buckets: list[list[int]],
                 group: dist.ProcessGroup, dtype: torch.dtype, overlap_comm: bool, contiguous: bool,
                 scaling: GradScaling, logger: CommsLogger | None,
                 on_unit_ready: Callable[[int], None] | None = None, reduce_scatter: bool = True,
                 rank: int = 0, comm_dtype: torch.dtype | None = None, reducer=None) -> None:
        self.params, self.layout, self.buckets = params, layout, buckets
        self.group, self.dtype = group, dtype
        self.world = layout.world
        self.overlap_comm, self.contiguous = overlap_comm, contiguous
        self.use_reduce_scatter, self.rank = reduce_scatter, rank
        self.scaling, self.logger, self.on_unit_ready = scaling, logger, on_unit_ready
        self.comm_dtype = comm_dtype or dtype  # `communication_data_type`: the dtype on the wire
        self.reducer = reducer  # ZeRO++ qgZ (trident.compression.hierarchical), else reduce_scatter
        self.device = params[0].device if params else torch.device("cpu")
        n = layout.partition_numel
        self.partition = torch.zeros(n, dtype=dtype, device=self.device) if contiguous else None
        self._pieces: dict[int, torch.Tensor] = {}  # bucket -> its shard, when not contiguous
        self._slot = {s.index: (u, s) for u in layout.units for s in u.slots}
        self._bucket_of_unit = {u: b for b, units in enumerate(buckets) for u in units}
        # A bucket's staging buffer holds its units one after the other, each as its whole padded
        # flat buffer ([world x shard], rank-major): a parameter's gradient lands in one copy, and
        # the units are reduce-scattered together (one coalesced collective).
        self._base: list[dict[int, int]] = []  # per bucket: {unit: where its block starts}
        self._sizes: list[int] = []            # per bucket: elements of the staging buffer
        self._widths: list[int] = []           # per bucket: elements of this rank's result
        for units in buckets:
            base, at = {}, 0
            for u in units:
                base[u] = at
                at += layout.units[u].padded
            self._base.append(base)
            self._sizes.append(at)
            self._widths.append(at // self.world)
        self._at = {s.index: self._base[self._bucket_of_unit[u.index]][u.index] + s.offset
                    for u in layout.units for s in u.slots}  # a parameter's place in its staging buffer
        self._fresh = True
        self._boundary = False
        self.on_reduced: Callable[[torch.Tensor, int, int], None] | None = None
        """Called with (partition, lo, hi) once partition[lo:hi] is final for the window (its
        bucket reduced on the window's last backward): ZeRO-Offload copies it to the host then."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]
        self._reset()

    def _reset(self) -> None:
        self._staging: dict[int, torch.Tensor] = {}
        self._arrived: list[set[int]] = [set() for _ in self.layout.units]
        self._units_done = [0] * len(self.buckets)
        self._next = 0
        self._handles: list[tuple[int, object, torch.Tensor]] = []
        self._active = False

    # -- hooks -----------------------------------------------------------------------------

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self._active:
                raise RuntimeError("a gradient arrived outside engine.backward(): under ZeRO stage 2 or 3 "
                                   "call engine.backward(loss), not loss.backward()")
            unit, slot = self._slot[i]
            self._write(unit, slot, param.grad)
            param.grad = None
            self._arrive(unit.index, i)
        return hook

    def _write(self, unit: Unit, slot, grad: torch.Tensor) -> None:
        """Copy a parameter's gradient into its place in the bucket's staging buffer."""
        b = self._bucket_of_unit[unit.index]
        staging = self._staging.get(b)
        if staging is None:
            staging = self._new_staging(b)
        at = self._at[slot.index]
        if grad.is_contiguous():
            staging.as_strided(grad.shape, grad.stride(), at).copy_(grad)
        else:
            staging[at:at + slot.numel].view(slot.shape).copy_(grad)

    def _new_staging(self, b: int) -> torch.Tensor:
        staging = torch.empty(self._sizes[b], dtype=self.dtype, device=self.device)
        for u in self.buckets[b]:  # zero only the padding; every real element is written
            unit = self.layout.units[u]
            if unit.padded > unit.numel:
                self._zero_range(staging, b, unit, unit.numel, unit.padded)
        self._staging[b] = staging
        return staging

    def _zero_range(self, staging: torch.Tensor, b: int, unit: Unit, start: int, end: int) -> None:
        at = self._base[b][unit.index]
        staging[at + start:at + end].zero_()

    def _arrive(self, u: int, i: int) -> None:
        arrived = self._arrived[u]
        if i in arrived:
            raise RuntimeError(f"parameter {i} produced two gradients in one backward; ZeRO stage 2/3 "
                               "needs one backward per engine.backward() call")
        arrived.add(i)
        if len(arrived) == len(self.layout.units[u].slots):
            if self.on_unit_ready is not None:
                self.on_unit_ready(u)
            b = self._bucket_of_unit[u]
            self._units_done[b] += 1
            if self.overlap_comm:
                self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.buckets) and self._units_done[self._next] == len(self.buckets[self._next]):
            self._launch(self._next)

    def _launch(self, b: int) -> None:
        staging = self._staging.pop(b, None)
        if staging is None:
            staging = self._new_staging(b)
            self._staging.pop(b)
        for u in self.buckets[b]:  # parameters that got no gradient contribute zeros
            unit = self.layout.units[u]
            if len(self._arrived[u]) < len(unit.slots):
                for s in unit.slots:
                    if s.index not in self._arrived[u]:
                        self._zero_range(staging, b, unit, s.offset, s.offset + s.numel)
        self.scaling.before(staging)
        if staging.dtype != self.comm_dtype:
            staging = staging.to(self.comm_dtype)
        units = [self.layout.units[u] for u in self.buckets[b]]
        blocks = [staging] if len(units) == 1 else list(staging.split([u.padded for u in units]))
        if self.reducer is not None:  # qgZ takes [world, W] rows: rank r's shards of every unit side by side
            rows = torch.cat([blk.view(self.world, -1) for blk in blocks], dim=1) if len(units) > 1 \
                else staging.view(self.world, -1)
            out = torch.empty(rows.shape[1], dtype=staging.dtype, device=self.device)
            handle = self.reducer.launch(out, rows)
        elif self.use_reduce_scatter:
            out = torch.empty(self._widths[b], dtype=staging.dtype, device=self.device)
            outs = [out] if len(units) == 1 else list(out.split([u.shard for u in units]))
            handle = collectives.reduce_scatter_coalesced(outs, blocks, group=self.group, async_op=True,
                                                          logger=self.logger)
        else:  # all-reduce the whole bucket and keep this rank's rows: twice the traffic
            handle = collectives.all_reduce(staging, group=self.group, async_op=True, logger=self.logger)
            out = [blk.view(self.world, -1)[self.rank] for blk in blocks]  # joined once reduced
        self._handles.append((b, handle, out))
        self._next += 1
        while len(self._handles) > MAX_IN_FLIGHT:  # bound the staging buffers alive during backward
            self._complete(*self._handles.pop(0))

    def _complete(self, b: int, handle, out: torch.Tensor) -> None:
        """Wait for bucket b's reduction and add this rank's shard into the partition."""
        handle.wait()
        if isinstance(out, list):  # the all-reduce fallback: this rank's row of each unit
            out = out[0] if len(out) == 1 else torch.cat(out)
        self.scaling.after(out)
        if out.dtype != self.dtype:
            out = out.to(self.dtype)  # reduced in `communication_data_type`, kept in the partition's dtype
        lo, hi = self.bucket_range(b)
        if self.contiguous:
            target = self.partition[lo:hi]
            target.copy_(out) if self._fresh else target.add_(out)
            if self._boundary and self.on_reduced is not None:
                self.on_reduced(self.partition, lo, hi)
        elif self._fresh or b not in self._pieces:
            self._pieces[b] = out if self.use_reduce_scatter else out.clone()  # not a view of staging
        else:
            self._pieces[b].add_(out)

    # -- engine-facing ---------------------------------------------------------------------

    def bucket_range(self, b: int) -> tuple[int, int]:
        first = self.layout.units[self.buckets[b][0]]
        width = sum(self.layout.units[u].shard for u in self.buckets[b])
        return first.partition_offset, first.partition_offset + width

    def start_backward(self, boundary: bool) -> None:
        self._reset()
        self._active = True
        self._boundary = boundary

    def finish_backward(self) -> None:
        """Reduce what is left, in bucket order, and add every result into the partition."""
        for u, unit in enumerate(self.layout.units):
            if len(self._arrived[u]) < len(unit.slots) and self.on_unit_ready is not None:
                self.on_unit_ready(u)
        while self._next < len(self.buckets):
            self._launch(self._next)
        for b, handle, out in self._handles:
            self._complete(b, handle, out)
        self._fresh = False
        self._reset()

    def flat(self) -> torch.Tensor:
        """This rank's gradient partition as one flat tensor (joined first when not contiguous)."""
        if self.contiguous or not self._pieces:
            if self.partition is None:
                self.partition = torch.zeros(self.layout.partition_numel, dtype=self.dtype, device=self.device)
            return self.partition
        order = sorted(range(len(self.buckets)), key=lambda b: self.bucket_range(b)[0])  # partition order
        self.partition = torch.cat([self._pieces[b] for b in order])
        self._pieces = {}
        return self.partition

    def zero_grad(self) -> None:
        self._fresh = True
        if not self.contiguous:
            self.partition = None
            self._pieces = {}

    def nbytes(self) -> int:
        held = self.partition.numel() if self.partition is not None else 0
        held += sum(t.numel() for t in self._pieces.values())
        return held * torch.empty((), dtype=self.dtype).element_size()
