"""A worker's flat buffers per server shard, and the gradient hooks that push them.

For each server the worker keeps the shard's parameters as views of one flat buffer in the
compute dtype (the model's parameters *are* those views, so a pulled shard lands with one
copy), its gradients as views of one flat fp32 buffer, and an fp32 staging buffer that a pull
is received into while the model may still be computing with the old parameters.

Overlap: gradients accumulate locally over a window; on the window's last backward a hook fires
as each parameter's gradient is ready, and once every parameter of a bucket is ready the bucket
is sent (buckets of a shard in index order, the order the server's receives are posted in).
The server has those receives posted already, so the buckets stream out while backward goes on.
"""

from __future__ import annotations

from typing import Callable

import torch

from trident.optim.clipping import sum_of_squares
from trident.parameter_server.layout import PSLayout
from trident.parameter_server.sharding import ShardLayout
from trident.parameter_server.transport import Endpoint, Pending


class ShardBuffers:
    """One server's shard on a worker: parameters (views), gradients (views), staging.

    Parameters and gradients live on the model's device; what crosses the wire is in host
    memory (the servers hold the shards on the host), so on a GPU a bucket is copied to a host
    buffer before it is sent, and a pull lands in host staging before it is copied up.
    """

    def __init__(self, layout: ShardLayout, params: list[torch.nn.Parameter], dtype: torch.dtype) -> None:
        self.layout = layout
        self.params = params
        device = params[0].device
        self.flat = torch.zeros(layout.numel, dtype=dtype, device=device)
        with torch.no_grad():
            for p, view in zip(params, layout.views(self.flat)):
                view.copy_(p.detach())
                p.data = view
        self.grad = torch.zeros(layout.numel, dtype=torch.float32, device=device)
        self.grads = layout.views(self.grad)
        self.grad_host = self.grad if device.type == "cpu" else torch.zeros(layout.numel, dtype=torch.float32)
        self.staging = torch.zeros(layout.numel, dtype=torch.float32)
        self.shares_storage = [p.dtype == torch.float32 for p in params]

    def host_slice(self, start: int, end: int) -> torch.Tensor:
        """grad[start:end] in host memory, ready to send."""
        if self.grad_host is not self.grad:
            self.grad_host[start:end].copy_(self.grad[start:end])
        return self.grad_host[start:end]

    @torch.no_grad()
    def adopt_staging(self) -> None:
        """The pulled shard becomes the model's parameters."""
        self.flat.copy_(self.staging)


class GradientPusher:
    """Accumulates every parameter's gradient into its shard's buffer; sends buckets on the boundary."""

    def __init__(self, layout: PSLayout, params: list[torch.nn.Parameter], endpoint: Endpoint,
                 dtype: torch.dtype) -> None:
        self.layout, self.endpoint = layout, endpoint
        self.shards = [ShardBuffers(sl, [params[i] for i in sl.tensors], dtype) for sl in layout.shards]
        self._where = {i: (s, j) for s, sl in enumerate(layout.shards) for j, i in enumerate(sl.tensors)}
        self._bucket_of = [sl.bucket_of() for sl in layout.shards]
        self._fresh = [[True] * len(sl.tensors) for sl in layout.shards]
        self._boundary = False
        self._ready: list[list[set[int]]] = []
        self._next: list[int] = []
        self.sends: list[Pending] = []
        self._hooks = [p.register_post_accumulate_grad_hook(self._make_hook(i)) for i, p in enumerate(params)]

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        s, j = self._where[i]

        def hook(param: torch.Tensor) -> None:
            self._accumulate(s, j, param)
            if self._boundary:
                self._ready[s][self._bucket_of[s][j]].add(j)
                self._launch_ready(s)
        return hook

    def _accumulate(self, s: int, j: int, param: torch.Tensor) -> None:
        """The window's first gradient overwrites the view, later ones add; fp32 parameters keep
        the view as .grad so autograd accumulates straight into the buffer."""
        shard = self.shards[s]
        grad, view = param.grad, shard.grads[j]
        if self._fresh[s][j]:
            view.copy_(grad)
            self._fresh[s][j] = False
        elif grad is not view:
            view.add_(grad)
        param.grad = view if shard.shares_storage[j] else None

    def _launch_ready(self, s: int) -> None:
        buckets = self.layout.shards[s].buckets
        while self._next[s] < len(buckets) and len(self._ready[s][self._next[s]]) == len(
                buckets[self._next[s]].param_ids):
            self._send_bucket(s, self._next[s])
            self._next[s] += 1

    def _send_bucket(self, s: int, index: int) -> None:
        b = self.layout.shards[s].buckets[index]
        self.sends.append(self.endpoint.isend(self.shards[s].host_slice(b.start, b.end), self.layout.server_ranks[s],
                                              self.layout.tags.GRAD, "pushing gradients"))

    def start_backward(self, boundary: bool) -> None:
        self._boundary = boundary
        self._ready = [[set() for _ in sl.buckets] for sl in self.layout.shards]
        self._next = [0] * len(self.shards)

    def finish_backward(self) -> None:
        """On the boundary: zero what got no gradient this window, send what is left, in order."""
        if not self._boundary:
            return
        for s, shard in enumerate(self.shards):
            for j, fresh in enumerate(self._fresh[s]):
                if fresh:
                    shard.grads[j].zero_()
                    self._fresh[s][j] = False
            while self._next[s] < len(self.layout.shards[s].buckets):
                self._send_bucket(s, self._next[s])
                self._next[s] += 1
        self._boundary = False

    def flush(self, s: int) -> None:
        """Send a shard's buckets without a push: answers the receives a server posted for a push
        that will not come (a worker leaving)."""
        for index in range(len(self.layout.shards[s].buckets)):
            self._send_bucket(s, index)

    def wait_sends(self, timeout) -> None:
        for pending in self.sends:
            pending.wait(timeout)
        self.sends = []

    def grad_norm(self) -> float:
        """L2 norm of this worker's whole window gradient (all shards)."""
        return float(sum_of_squares(s.grad for s in self.shards)) ** 0.5

    def zero_grad(self) -> None:
        """Start a new window: buffers are overwritten by the next gradients, not zeroed."""
        self._fresh = [[True] * len(sl.tensors) for sl in self.layout.shards]
        for shard in self.shards:
            for p, shares in zip(shard.params, shard.shares_storage):
                if shares:
                    p.grad = None

    def memory_breakdown(self) -> dict[str, int]:
        params = sum(s.flat.numel() * s.flat.element_size() + s.staging.numel() * 4 for s in self.shards)
        grads = sum(s.grad.numel() * 4 for s in self.shards)
        return {"parameters": params, "gradients": grads, "optimizer_states": 0}
