"""`PushPullStrategy`: a parameter-server worker's gradient strategy, behind the one `Engine`.

What crosses the wire per optimizer step, to each server: the shard's fp32 gradient buckets
(sent during the window's last backward, `push`) and a PUSH header; back: a PARAMS header and
the flat fp32 shard. Nothing is sent on the other micro-steps of an accumulation window.

- sync: `step` pushes and waits for every server's reply. The servers average the workers'
  gradients, clip by the norm of the average (they sum their shards' squares between them and
  return the norm in the reply), step the optimizer and the schedule; so after
  `engine.step()` the model holds the new parameters, as under data parallelism.
- async: `step` first takes in the reply to the previous push, clips by this worker's own
  norm (the coefficient travels in the PUSH header, the server multiplies by it), pushes, and
  returns without waiting: the pull overlaps the next window's compute. `start_window` begins
  the next window on the parameters at hand if their clock is within the staleness bound
  (>= step - k), and otherwise waits for the reply (see `protocol` for versions and clocks).

Where the `GradientStrategy` protocol (`trident.engine.strategy`) meets a remote update:

- `step` owns the whole update. The optimizer and the schedule run on the servers, so the
  engine's `lr_scheduler` (a `RemoteSchedule` view) is not stepped, and `optimizer_step` is
  refused. Under fp16 (sync mode only) each push carries the loss scale; the servers unscale,
  clip, and skip a round whose norm is not finite, and that non-finite norm is returned: the
  engine's overflow signal. Otherwise the norm is None without clipping (nobody computes it),
  and also when it is not finite: the servers applied that update, so a NaN must not read as a
  skipped step.
- `start_window` is the staleness wait above (the engine calls it on a window's first forward
  or backward).
- The optimizer state and the fp32 parameters live on the servers: checkpoints go there
  through this strategy's `save_checkpoint` / `load_checkpoint` (`RemoteStrategy`), and the
  per-rank state methods (`state_dict`, resharding) refuse.
- At interpreter exit the servers are told DONE after a normal end, FAILED when the script died
  of an exception, so they can finish or stop the others with the reason.
"""

from __future__ import annotations

import atexit
import math
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from trident.config import TridentConfig
from trident.optim.clipping import clip_coefficient
import trident.parameter_server.checkpoint as ckpt
from trident.parameter_server.client import ServerClient
from trident.parameter_server.layout import PSLayout
from trident.parameter_server.protocol import Header, Kind
from trident.parameter_server.push import GradientPusher
from trident.parameter_server.transport import Endpoint, LinkError

_ON_SERVERS = ("the optimizer state and fp32 parameters of a parameter-server run live on the servers; "
               "engine.save_checkpoint / load_checkpoint reach them there")


class PushPullStrategy:
    """A worker's gradient path: accumulate locally, push on the boundary, pull the parameters
    (a `trident.engine.strategy.GradientStrategy` and `RemoteStrategy`)."""

    zero_stage = 0
    partitions_parameters = False
    per_rank_state = False
    averaged_gradients = False  # the average is formed on the servers; param.grad is this worker's

    def __init__(self, module: torch.nn.Module, config: TridentConfig, layout: PSLayout,
                 dtype: torch.dtype) -> None:
        ps = config.parameter_server
        self.layout, self.mode, self.staleness = layout, ps.mode, ps.staleness
        self.fp16 = config.fp16.enabled  # sync only (check_supported): the servers skip overflowing rounds
        self.endpoint = Endpoint(layout.group)
        named = dict(module.named_parameters())
        self.pusher = GradientPusher(layout, [named[n] for n in layout.names], self.endpoint, dtype)
        self.client = ServerClient(layout, self.endpoint, self.pusher)
        self.numel = sum(shape.numel() for shape in layout.shapes)
        self.steps = 0  # windows pushed: the engine's global_steps (restored with a checkpoint)
        self._base = list(self.client.held)  # what this window's gradient is computed on
        self._closed = False
        self.client.exchange(Header(Kind.HELLO, count=layout.fingerprint))
        atexit.register(self._at_exit)

    def get_lr(self) -> list[float]:
        """The servers' learning rate per param group, as of the last pull (`RemoteOptimizer`)."""
        return list(self.client.lrs)

    # -- backward --------------------------------------------------------------------------

    def start_backward(self, boundary: bool) -> None:
        self.pusher.start_backward(boundary)

    def finish_backward(self) -> None:
        self.pusher.finish_backward()

    def zero_grad(self) -> None:
        self.pusher.zero_grad()

    def start_window(self) -> None:
        """Async: block for a pull only if the held parameters are more than k steps behind."""
        need = self.steps - self.staleness
        for s in range(self.layout.servers):
            if self.client.replies[s] is not None and self.client.held[s].clock < need:
                self.client.take_reply(s)
        self._base = list(self.client.held)

    # -- the step --------------------------------------------------------------------------

    def step(self, max_norm: float, loss_scale: float, split_groups: Sequence[dist.ProcessGroup],
             lr_scheduler: Any, pending=None, grad_factor=None) -> float | None:
        """Push the window's gradient; sync: wait for the new parameters. The servers run the
        schedule; `split_groups` is empty (pipelines are refused). Under fp16 (sync only) the
        gradient is `loss_scale` times too large: the servers unscale it, and return a
        non-finite norm when they skipped the round, which is the engine's overflow signal."""
        norm, coef = None, 1.0
        fp16 = self.fp16
        if self.mode == "async":
            self.client.take_replies()  # the previous pull; the parameters are not in use between windows
            if max_norm > 0:
                norm = self.pusher.grad_norm()
                coef = clip_coefficient(norm, max_norm)
        t = self.steps
        need = t + 1 - self.staleness if self.mode == "async" else 0
        for s, base in enumerate(self._base):
            self.client.request(s, Header(Kind.PUSH, step=t, version=base.version, clock=base.clock, need=need,
                                          value=loss_scale if fp16 else coef, spare=int(fp16)))
        self.client.wait(self.pusher.wait_sends)
        if self.mode == "sync":
            self.client.take_replies()
            if max_norm > 0 or fp16:
                norm = self.client.norm
        self.steps += 1
        if fp16:
            return norm  # not finite: the servers skipped this round
        return norm if norm is not None and math.isfinite(norm) else None

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple]]:
        """This worker's window gradient, shard by shard (not averaged: that happens on the servers)."""
        return [([shard.grad for shard in self.pusher.shards], ())]

    def nonfinite_names(self) -> list[str]:
        return [self.layout.names[i] for sl, shard in zip(self.layout.shards, self.pusher.shards)
                for i, g in zip(sl.tensors, shard.grads) if not torch.isfinite(g).all()]

    def optimizer_step(self, grad_coef: float) -> None:
        raise RuntimeError("PushPullStrategy.optimizer_step: the servers step the optimizer; step() pushes the "
                           "gradient to them")

    # -- accounting ------------------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        """Parameters include the fp32 staging copy a pull lands in; the optimizer state lives
        on the servers."""
        return self.pusher.memory_breakdown()

    def frozen_bytes(self) -> int:
        """Frozen parameters are neither pushed nor served: memory_breakdown() counts the shards only."""
        return 0

    def placement_bytes(self) -> dict[str, int]:
        """Staging (and, off the CPU, the gradients' send copy) is in host memory."""
        host = 0
        for shard in self.pusher.shards:
            if shard.flat.device.type != "cpu":
                host += shard.staging.numel() * 4 + shard.grad_host.numel() * 4
        return {"device": sum(self.memory_breakdown().values()) - host, "host": host, "nvme": 0}

    @property
    def server_version(self) -> int:
        """The oldest shard version among the parameters this worker holds."""
        return min(h.version for h in self.client.held)

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this worker has sent to and received from the servers."""
        return self.endpoint.traffic()

    def fetch_parameters(self) -> None:
        """Pull every shard's current parameters now (async: for evaluation, or at the end)."""
        self.client.exchange(Header(Kind.PULL, step=self.steps))

    # -- checkpoints -----------------------------------------------------------------------

    def save_checkpoint(self, engine: Any, save_dir: str, tag: str | None, client_state: dict,
                        save_latest: bool) -> str:
        """Servers write their shards, worker 0 the counters; returns the checkpoint folder.

        Only worker 0 talks to the servers; the other workers return at once (in async mode the
        shards are saved as they are when worker 0's request arrives).
        """
        tag = tag or f"global_step{engine.global_steps}"
        folder = Path(save_dir).resolve() / tag
        if self.layout.worker_index == 0:
            path = str(folder).encode("utf-8")
            self.client.exchange(Header(Kind.SAVE, count=len(path)), path)
            ckpt.write_workers(folder, {"global_steps": engine.global_steps, "micro_steps": engine.micro_steps,
                                        "global_samples": engine.global_samples, "client_state": client_state,
                                        "servers": self.layout.servers, "workers": self.layout.workers})
            if save_latest:
                ckpt.write_latest(Path(save_dir), tag)
        return str(folder)

    def load_checkpoint(self, engine: Any, load_dir: str, tag: str | None, load_optimizer_states: bool,
                        load_lr_scheduler_states: bool, load_module_only: bool) -> tuple:
        """Every worker calls it: the servers load their shards (any number of servers may have
        written them), every worker pulls them. Returns (folder, client_state), or (None, None)."""
        self.client.exchange(Header(Kind.LOAD))  # a barrier: worker 0's save before this call is complete
        folder = ckpt.resolve_folder(load_dir, tag)
        if folder is None:
            return None, None
        state = ckpt.read_workers(folder)
        flags = ((ckpt.LOAD_OPTIMIZER if load_optimizer_states else 0)
                 | (ckpt.LOAD_SCHEDULER if load_lr_scheduler_states else 0)
                 | (ckpt.MODULE_ONLY if load_module_only else 0))
        path = str(folder.resolve()).encode("utf-8")
        self.client.exchange(Header(Kind.LOAD, count=len(path), need=flags), path)
        if not load_module_only:
            self.steps = min(h.clock for h in self.client.held)
            engine.global_steps = self.steps
            engine.micro_steps = self.steps * engine.batch.gradient_accumulation_steps
            engine.global_samples = int(state["global_samples"])
        self._base = list(self.client.held)
        return str(folder), state["client_state"]

    def state_dict(self) -> dict:
        raise RuntimeError(f"PushPullStrategy.state_dict: {_ON_SERVERS}")

    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        raise RuntimeError(f"PushPullStrategy.load_state_dict: {_ON_SERVERS}")

    def reload_masters(self) -> None:
        """No fp32 masters on a worker: a pull overwrites the parameters."""

    def same_state_layout(self, saved: dict | None) -> bool:
        raise RuntimeError(f"PushPullStrategy.same_state_layout: {_ON_SERVERS}")

    def fill_resharded_state(self, skeleton: dict, param_state: Callable[[str], Any], where: str) -> None:
        raise RuntimeError(f"PushPullStrategy.fill_resharded_state: {_ON_SERVERS}")

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        return tuple(t.shape)

    def partitions(self, t: torch.Tensor) -> bool:
        return False

    # -- leaving ---------------------------------------------------------------------------

    def close(self) -> None:
        """Tell the servers this worker is done (also run at exit). Collective-free and idempotent."""
        if self._closed or self.client.broken:
            return
        self.client.take_replies()
        for s in range(self.layout.servers):
            self.pusher.flush(s)  # answers the gradient receives a server posted for a push that won't come
        self.client.exchange(Header(Kind.DONE, step=self.steps))
        self._closed = True

    def _at_exit(self) -> None:
        """At interpreter exit: DONE after a normal end, FAILED when the script died of an exception."""
        if self._closed or self.client.broken:
            return
        if getattr(sys, "last_value", None) is None:
            self.close()
            return
        self.client.broken = True
        try:
            for s in range(self.layout.servers):
                self.client.send(s, Header(Kind.FAILED), reply=False)
            self.pusher.wait_sends(timedelta(seconds=min(5.0, self.layout.timeout_s)))
        except LinkError:
            pass  # the server is gone as well; it will see this worker's connection close
