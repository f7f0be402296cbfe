"""Data-parallel gradient averaging: bucketed all-reduce launched from gradient hooks.

Every data-parallel rank computes gradients on its own micro-batches; before the optimizer
step they are averaged over the dp group so every replica takes the same step.

What crosses the wire: at the last micro-step of an accumulation window, each bucket of the
flat fp32 gradient buffer is all-reduced (SUM) over the dp group, then scaled to a mean. With `communication_data_type`
other than fp32 the bucket is cast to it for the all-reduce and copied back (bf16: half the bytes). Nothing
is sent on the other micro-steps: gradients accumulate locally.

Overlap: a hook fires as each parameter's gradient is accumulated. When every parameter of a
bucket is ready, that bucket's all-reduce starts asynchronously while backward carries on.
Buckets are always launched in index order (a ready bucket waits for its predecessors) so every
rank issues the same collectives in the same order, whatever order its hooks fire in. Whatever
has not been launched when backward returns (parameters that got no gradient, or
`overlap_comm` off) is launched by `finish_backward`, which then waits for all of them.

Scaling follows DeepSpeed: with `prescale_gradients` the buffer is divided by the dp size
before the sum; otherwise it is divided by `gradient_predivide_factor` before and multiplied
by predivide / dp after, which keeps fp16 sums in range on large groups.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.buckets import Bucket, FlatBuffer, GradScaling, plan_buckets
from trident.comm.logger import CommsLogger


_COMM_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def communication_dtype(name: str | None, compute: torch.dtype) -> torch.dtype:
    """`communication_data_type` as a dtype; null follows DeepSpeed: the run's 16-bit dtype
    under fp16/bf16, else fp32."""
    if name is None:
        return compute if compute in (torch.float16, torch.bfloat16) else torch.float32
    return _COMM_DTYPES[name]


class GradientReducer:
    """Owns the flat fp32 gradient buffer of `params` and averages it over `group`.

    `params` are the model's trainable parameters (any dtype). `grads[i]` is the fp32 view that
    holds parameter i's accumulated gradient; the optimizer's (master) parameters point their
    `.grad` at these views. For fp32 parameters the view is also `param.grad` itself, so no
    second copy of the gradients exists.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        group: dist.ProcessGroup,
        bucket_size: int,
        overlap_comm: bool = True,
        predivide_factor: float = 1.0,
        prescale_gradients: bool = False,
        logger: CommsLogger | None = None,
        average_over: int | None = None,
        comm_dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params = params
        self.group = group
        self.dp_size = dist.get_world_size(group)
        # Expert weights are summed over their smaller group (dp x cp) but averaged over every
        # data-parallel rank (dp x cp x ep), like the dense weights: each rank's loss is a mean
        # over its own tokens, and an expert's gradient already sums its ep group's losses.
        self.average_over = average_over or self.dp_size
        self.overlap_comm = overlap_comm
        self.comm_dtype = comm_dtype  # `communication_data_type`: cast for the all-reduce, and back
        self.scaling = GradScaling(self.average_over, predivide_factor, prescale_gradients)
        self.logger = logger
        offsets, self.buckets = plan_buckets([p.numel() for p in params], bucket_size)
        device = params[0].device if params else torch.device("cpu")
        self.buffer = FlatBuffer([p.shape for p in params], offsets, torch.float32, device)
        self.grads = self.buffer.views
        self._bucket_of = {i: b for b in self.buckets for i in b.param_ids}
        self._shares_storage = [p.dtype == torch.float32 for p in params]
        self._sync = False
        self._boundary = False
        self._fresh = [True] * len(params)  # no gradient yet in this accumulation window
        self._ready: list[set[int]] = [set() for _ in self.buckets]
        self._next_launch = 0
        self._handles: list[tuple[Bucket, object, torch.Tensor]] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i))
                       for i, p in enumerate(params)]

    # -- hooks -----------------------------------------------------------------------------

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            self._accumulate(i, param)
            if self._sync:
                self._mark_ready(i)
        return hook

    def _accumulate(self, i: int, param: torch.Tensor) -> None:
        """Move this backward's gradient into the flat buffer.

        The first gradient of an accumulation window is copied over whatever the view held
        (no zeroing pass needed); later ones are added. fp32 parameters then keep the view as
        `param.grad`, so autograd accumulates the rest of the window straight into the buffer;
        lower-precision parameters drop their 16-bit grad once it is added in fp32.
        """
        grad, view = param.grad, self.grads[i]
        if self._fresh[i]:
            view.copy_(grad)
            self._fresh[i] = False
        elif grad is not view:
            view.add_(grad)
        param.grad = view if self._shares_storage[i] else None

    def _mark_ready(self, i: int) -> None:
        bucket = self._bucket_of[i]
        self._ready[bucket.index].add(i)
        if self.overlap_comm:
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        while (self._next_launch < len(self.buckets)
               and len(self._ready[self._next_launch]) == len(self.buckets[self._next_launch].param_ids)):
            self._launch(self.buckets[self._next_launch])

    def _launch(self, bucket: Bucket) -> None:
        data = self.buffer.slice(bucket.start, bucket.end)
        self.scaling.before(data)
        wire = data if data.dtype == self.comm_dtype else data.to(self.comm_dtype)
        handle = (collectives.all_reduce(wire, group=self.group, async_op=True, logger=self.logger)
                  if self.dp_size > 1 else None)
        self._handles.append((bucket, handle, wire))
        self._next_launch += 1

    # -- engine-facing ---------------------------------------------------------------------

    def start_backward(self, boundary: bool) -> None:
        """Called before each backward; `boundary` marks the window's last micro-step."""
        self._boundary = boundary
        self._sync = boundary and self.average_over > 1
        self._ready = [set() for _ in self.buckets]
        self._next_launch = 0
        self._handles = []

    def finish_backward(self) -> None:
        """Launch what is left, in bucket order, and wait until every bucket is averaged."""
        if self._boundary:
            for i in (i for i, fresh in enumerate(self._fresh) if fresh):
                self.grads[i].zero_()  # no gradient in the whole window: zero, not stale
                self._fresh[i] = False
        if not self._sync:
            return
        while self._next_launch < len(self.buckets):
            self._launch(self.buckets[self._next_launch])
        for bucket, handle, wire in self._handles:
            if handle is not None:
                handle.wait()
            data = self.buffer.slice(bucket.start, bucket.end)
            if wire is not data:
                data.copy_(wire)
            self.scaling.after(data)
        self._handles = []
        self._sync = False

    def zero_grad(self) -> None:
        """Start a new accumulation window; the buffer is overwritten, not zeroed."""
        self._fresh = [True] * len(self.params)
        for p, shares in zip(self.params, self._shares_storage):
            if shares:
                p.grad = None  # autograd hands over a fresh gradient instead of adding to a stale one
