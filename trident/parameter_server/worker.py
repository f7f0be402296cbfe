"""The worker's engine: Engine's user API, with push and pull to the servers behind backward/step.

What crosses the wire per optimizer step, to each server: the shard's fp32 gradient buckets
(sent during the window's last backward) and a PUSH header; back: a PARAMS header and the flat
fp32 shard. Nothing is sent on the other micro-steps of an accumulation window.

- sync: `step()` pushes and waits for every server's reply (the servers' step over all
  workers), so after `step()` the model holds the new parameters, as under data parallelism.
- async: `step()` first takes in the reply to the previous push, then pushes, and returns
  without waiting: the pull overlaps the next window's compute. The next window starts on the
  parameters at hand if their clock is within the staleness bound (>= step - k), and otherwise
  waits for the reply (see `protocol` for versions and clocks).
"""

from __future__ import annotations

import atexit
import logging
import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch

from trident.config import TridentConfig
from trident.config.batch import BatchGetters, BatchSizes
from trident.monitor.log import logger
from trident.monitor.writers import Monitors
from trident.optim.clipping import clip_coefficient
from trident.parameter_server import checkpoint as ckpt
from trident.parameter_server.layout import PSLayout
from trident.parameter_server.protocol import (SYNC_ADVICE, Header, Kind, ParameterServerError, Reason,
                                               WorkerLostError, header_buffer, lost_message)
from trident.parameter_server.push import GradientPusher
from trident.parameter_server.remote import RemoteOptimizer, RemoteSchedule
from trident.parameter_server.transport import Endpoint, LinkError, Pending


@dataclass
class _Reply:
    header: Pending
    payload: Pending


@dataclass(frozen=True)
class Held:
    """Version and clock of the parameters a worker holds for one shard."""

    version: int
    clock: int


class WorkerEngine(BatchGetters, torch.nn.Module):
    """What `trident.initialize` returns on a worker rank under `parameter_server`."""

    def __init__(self, module: torch.nn.Module, config: TridentConfig, layout: PSLayout, batch: BatchSizes,
                 compute_dtype: torch.dtype) -> None:
        super().__init__()
        self.module = module
        self.config = config
        self.layout = layout
        self.batch = batch
        self.compute_dtype = compute_dtype
        ps = config.parameter_server
        self.mode, self.staleness = ps.mode, ps.staleness
        self.endpoint = Endpoint(layout.group)
        named = dict(module.named_parameters())
        self.pusher = GradientPusher(layout, [named[n] for n in layout.names], self.endpoint, compute_dtype)
        self.reply_timeout = timedelta(seconds=2 * layout.timeout_s)
        self.global_steps = 0
        self.micro_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.last_loss: float | None = None
        self.last_step_overflowed = False
        self.training_dataloader = None
        self.resumed_client_state = None
        self.optimizer = RemoteOptimizer(self)
        self.lr_scheduler = RemoteSchedule(self)
        self.monitors = Monitors(config.tensorboard, config.csv_monitor, enabled=self.dp_rank == 0)
        self.held = [Held(0, 0)] * layout.servers
        self._base = list(self.held)
        self._replies: list[_Reply | None] = [None] * layout.servers
        self._lrs: tuple[float, ...] = ()
        self._global_grad_norm: float | None = None
        self._window_loss: torch.Tensor | float = 0.0
        self._window_started = False
        self._backward_pending = False
        self._closed = False
        self._broken = False
        for s in range(layout.servers):
            self._request(s, Header(Kind.HELLO, count=layout.fingerprint))
        self._take_replies()
        atexit.register(self._at_exit)

    # -- coordinates (Engine's names; dp counts workers only) ------------------------------

    @property
    def global_rank(self) -> int:
        return self.layout.rank

    @property
    def world_size(self) -> int:
        return len(self.layout.ranks)

    @property
    def dp_rank(self) -> int:
        return self.layout.worker_index

    @property
    def dp_world_size(self) -> int:
        return self.layout.workers

    @property
    def loss_scale(self) -> float:
        return 1.0

    def get_lr(self) -> list[float]:
        """The servers' learning rate per param group, as of the last pull."""
        return list(self._lrs)

    def get_global_grad_norm(self) -> float | None:
        """Norm of the gradient at the last step: this worker's (async, with clipping) or the
        averaged one (sync, with clipping); None without clipping."""
        return self._global_grad_norm

    @property
    def server_version(self) -> int:
        """The oldest shard version among the parameters this worker holds."""
        return min(h.version for h in self.held)

    def comm_bytes(self) -> dict[str, int]:
        """Bytes this worker has sent to and received from the servers."""
        return self.endpoint.traffic()

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of model states on this worker (parameters include the fp32 staging copy a pull
        lands in); the optimizer state lives on the servers."""
        return self.pusher.memory_breakdown()

    # -- training --------------------------------------------------------------------------

    def train(self, mode: bool = True) -> WorkerEngine:
        self.module.train(mode)
        return self

    def eval(self) -> WorkerEngine:
        return self.train(False)

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        """Run the model; the first forward of a window makes sure the parameters are fresh enough."""
        if not self._window_started:
            self._start_window()
        if self.compute_dtype != torch.float32:
            inputs, kwargs = _cast_floats((inputs, kwargs), self.compute_dtype)
        return self.module(*inputs, **kwargs)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backpropagate `loss` averaged over the accumulation window; on the window's last
        micro-step the gradient buckets are pushed while backward runs."""
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise ValueError("engine.backward(loss) needs a scalar loss tensor, got "
                             f"{type(loss).__name__}; reduce your loss to one number (e.g. loss.mean()) first")
        if self._backward_pending:
            raise RuntimeError("engine.backward() was called twice without engine.step() in between; call "
                               "engine.step() after every engine.backward()")
        if not self._window_started:
            self._start_window()
        self._window_loss = self._window_loss + loss.detach().float()
        scale = 1.0 / self.batch.gradient_accumulation_steps if scale_wrt_gas else 1.0
        self.pusher.start_backward(self.is_gradient_accumulation_boundary())
        (loss.float() * scale).backward(retain_graph=retain_graph)
        self.pusher.finish_backward()
        self._backward_pending = True
        return loss

    def step(self) -> None:
        """Advance one micro-step; on the boundary, push the gradient and pull parameters."""
        if self.is_gradient_accumulation_boundary():
            window_loss = float(self._window_loss) / self.batch.gradient_accumulation_steps
            self._push()
            self.pusher.zero_grad()
            self._window_loss = 0.0
            self._window_started = False
            self.last_loss = window_loss
            self.global_steps += 1
            self.global_samples += self.batch.train_batch_size
            self._report()
            self._periodic_checkpoint()
        self.micro_steps += 1
        self._backward_pending = False

    def _start_window(self) -> None:
        """Async: block for a pull only if the held parameters are more than k steps behind."""
        need = self.global_steps - self.staleness
        for s in range(self.layout.servers):
            if self._replies[s] is not None and self.held[s].clock < need:
                self._take_reply(s)
        self._base = list(self.held)
        self._window_started = True

    def _push(self) -> None:
        scale = 1.0
        if self.mode == "async":
            self._take_replies()  # the previous pull; the parameters are not in use between windows
            clip = self.config.gradient_clipping
            if clip > 0:
                norm = self.pusher.grad_norm()
                self._global_grad_norm = norm
                scale = clip_coefficient(norm, clip)
        t = self.global_steps
        need = t + 1 - self.staleness if self.mode == "async" else 0
        for s, base in enumerate(self._base):
            self._request(s, Header(Kind.PUSH, step=t, version=base.version, clock=base.clock, need=need,
                                    value=scale))
        self._wait(self.pusher.wait_sends)
        if self.mode == "sync":
            self._take_replies()

    # -- messages --------------------------------------------------------------------------

    def _request(self, s: int, h: Header, blob: bytes = b"", reply: bool = True) -> None:
        """Send a header (and blob) to server s; post the receives for its reply."""
        try:
            self._issue(s, h, blob, reply)
        except LinkError as err:
            raise self._server_lost(err) from err

    def _issue(self, s: int, h: Header, blob: bytes, reply: bool) -> None:
        peer, tags = self.layout.server_ranks[s], self.layout.tags
        buf = h.encode(header_buffer(len(self.layout.param_groups)))
        self.pusher.sends.append(self.endpoint.isend(buf, peer, tags.UP, f"sending to parameter server {s}"))
        if blob:
            data = torch.tensor(list(blob), dtype=torch.uint8)
            self.pusher.sends.append(self.endpoint.isend(data, peer, tags.BLOB, f"sending to parameter server {s}"))
        if reply:
            what = f"waiting for parameter server {s}"
            head = self.endpoint.irecv(header_buffer(len(self.layout.param_groups)), peer, tags.DOWN, what)
            payload = (self.endpoint.irecv(self.pusher.shards[s].staging, peer, tags.PARAM, what)
                       if h.kind not in (Kind.SAVE, Kind.DONE) else None)
            self._replies[s] = _Reply(head, payload)

    def _take_replies(self) -> None:
        for s in range(self.layout.servers):
            if self._replies[s] is not None:
                self._take_reply(s)

    def _take_reply(self, s: int) -> Header:
        reply, self._replies[s] = self._replies[s], None
        h = Header.decode(self._wait(lambda t: reply.header.wait(t)))
        if h.kind == Kind.ABORT:
            if reply.payload is not None:
                reply.payload.orphan()
            self._broken = True
            raise self._abort_error(s, h)
        if h.kind == Kind.PARAMS:
            self._wait(lambda t: reply.payload.wait(t))
            if h.count != self.layout.fingerprint:
                self._broken = True
                raise ParameterServerError(
                    f"worker {self.dp_rank}: parameter server {s} placed the parameters differently (layout "
                    "fingerprints differ); every rank must build the same model and use the same config")
            self.pusher.shards[s].adopt_staging()
            self.held[s] = Held(h.version, h.clock)
            if s == 0:
                self._lrs = h.lrs
            if self.mode == "sync" and self.config.gradient_clipping > 0 and h.value > 0:
                self._global_grad_norm = h.value
        return h

    def _wait(self, fn):
        """Run a blocking wait; a lost server or a timeout stops this worker with the reason."""
        try:
            return fn(self.reply_timeout)
        except LinkError as err:
            raise self._server_lost(err) from err

    def _server_lost(self, err: LinkError) -> ParameterServerError:
        self._broken = True
        ranks = self.layout.server_ranks
        server = ranks.index(err.peer) if err.peer in ranks else -1
        return ParameterServerError(
            f"worker {self.dp_rank} (global rank {self.global_rank}): "
            f"{lost_message(server, err.peer, Reason.SERVER, str(err))} (a worker waits at most "
            f"{self.reply_timeout.total_seconds():g} s, 2 x distributed.timeout_s, for a server); check that "
            "server's log")

    def _abort_error(self, s: int, h: Header) -> ParameterServerError:
        reason = Reason(h.count)
        what = lost_message(h.need, h.step, reason)
        if reason == Reason.DROPPED:
            return WorkerLostError(f"worker {self.dp_rank} (global rank {self.global_rank}): parameter server {s} "
                                   f"had dropped this worker as lost (it was silent for longer than "
                                   f"distributed.timeout_s = {self.layout.timeout_s:g}); raise the timeout if "
                                   "steps can take that long", self.dp_rank, reason)
        return WorkerLostError(f"worker {self.dp_rank} (global rank {self.global_rank}): parameter server {s} "
                               f"stopped training: {what}; {SYNC_ADVICE}", h.need, reason)

    # -- leaving ---------------------------------------------------------------------------

    def close(self) -> None:
        """Tell the servers this worker is done (also run at exit). Collective-free and idempotent."""
        if self._closed or self._broken:
            return
        self._take_replies()
        for s in range(self.layout.servers):
            self.pusher.flush(s)
            self._request(s, Header(Kind.DONE, step=self.global_steps))
        self._wait(self.pusher.wait_sends)
        for s in range(self.layout.servers):
            self._take_reply(s)
        self._closed = True
        self.monitors.close()

    def _at_exit(self) -> None:
        """At interpreter exit: DONE after a normal end, FAILED when the script died of an exception."""
        if self._closed or self._broken:
            return
        if getattr(sys, "last_value", None) is None:
            self.close()
            return
        self._broken = True
        try:
            for s in range(self.layout.servers):
                self._issue(s, Header(Kind.FAILED), b"", reply=False)
            self.pusher.wait_sends(timedelta(seconds=min(5.0, self.layout.timeout_s)))
        except LinkError:
            pass  # the server is gone as well; it will see this worker's connection close

    def fetch_parameters(self) -> None:
        """Pull every shard's current parameters now (async: for evaluation, or at the end)."""
        self._take_replies()
        for s in range(self.layout.servers):
            self._request(s, Header(Kind.PULL, step=self.global_steps))
        self._wait(self.pusher.wait_sends)
        self._take_replies()

    # -- reporting and checkpoints ---------------------------------------------------------

    def _report(self) -> None:
        if self.monitors.enabled:
            self.monitors.write_events([("Train/Samples/train_loss", self.last_loss, self.global_samples),
                                        ("Train/Samples/lr", self.get_lr()[0], self.global_samples)])
            self.monitors.flush()
        every = self.config.steps_per_print
        if every and self.global_steps % every == 0:
            logger.info("worker %d step %d: loss %.4f, lr %.3e, shard versions %s, clocks %s", self.dp_rank,
                        self.global_steps, self.last_loss, self.get_lr()[0], [h.version for h in self.held],
                        [h.clock for h in self.held])

    def _periodic_checkpoint(self) -> None:
        c = self.config.checkpoint
        if c.path and c.save_interval and self.global_steps % c.save_interval == 0:
            loader = self.training_dataloader
            sampler = getattr(loader, "sampler", None)
            client = {"sampler": sampler.state_dict()} if hasattr(sampler, "state_dict") else {}
            self.save_checkpoint(c.path, client_state=client)

    @torch.no_grad()
    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """The model's state dict in the compute dtype, as this worker holds it (async: call
        `fetch_parameters()` first for the servers' newest)."""
        return {k: v.detach().clone() for k, v in self.module.state_dict().items()}

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        """Worker 0 writes the weights it holds in the compute dtype (`.safetensors` or torch.save)."""
        if self.dp_rank != 0:
            return True
        from safetensors.torch import save_file

        path = Path(save_dir) / save_filename
        path.parent.mkdir(parents=True, exist_ok=True)
        state = self.consolidated_state_dict()
        if path.suffix == ".safetensors":
            seen: set[int] = set()
            unique = {}
            for k, v in self.module.state_dict(keep_vars=True).items():  # tied weights once
                if id(v) not in seen:
                    seen.add(id(v))
                    unique[k] = state[k].contiguous()
            save_file(unique, str(path))
        else:
            torch.save(state, path)
        return True

    def save_checkpoint(self, save_dir: str, tag: str | None = None, client_state: dict | None = None,
                        save_latest: bool = True) -> str:
        """Servers write their shards, worker 0 the counters; returns the checkpoint folder.

        Only worker 0 talks to the servers; the other workers return at once (in async mode the
        shards are saved as they are when worker 0's request arrives).
        """
        tag = tag or f"global_step{self.global_steps}"
        folder = Path(save_dir).resolve() / tag
        if self.dp_rank == 0:
            self._take_replies()
            path = str(folder).encode("utf-8")
            for s in range(self.layout.servers):
                self._request(s, Header(Kind.SAVE, count=len(path)), blob=path)
            self._wait(self.pusher.wait_sends)
            for s in range(self.layout.servers):
                self._take_reply(s)
            ckpt.write_workers(folder, {"global_steps": self.global_steps, "micro_steps": self.micro_steps,
                                        "global_samples": self.global_samples, "client_state": client_state or {},
                                        "servers": self.layout.servers, "workers": self.layout.workers})
            if save_latest:
                ckpt.write_latest(Path(save_dir), tag)
        return str(folder)

    def load_checkpoint(self, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True, load_module_only: bool = False):
        """Every worker calls it: the servers load their shards (any number of servers may have
        written them), every worker pulls them. Returns (folder, client_state), or (None, None)."""
        self._take_replies()
        self._round(b"", 0)  # a barrier: worker 0's save before this call is complete
        folder = ckpt.resolve_folder(load_dir, tag)
        if folder is None:
            return None, None
        state = ckpt.read_workers(folder)
        flags = ((ckpt.LOAD_OPTIMIZER if load_optimizer_states else 0)
                 | (ckpt.LOAD_SCHEDULER if load_lr_scheduler_states else 0)
                 | (ckpt.MODULE_ONLY if load_module_only else 0))
        self._round(str(folder.resolve()).encode("utf-8"), flags)
        if not load_module_only:
            self.global_steps = min(h.clock for h in self.held)
            self.micro_steps = self.global_steps * self.batch.gradient_accumulation_steps
            self.global_samples = int(state["global_samples"])
        self._base = list(self.held)
        return str(folder), state["client_state"]

    def _round(self, path: bytes, flags: int) -> None:
        for s in range(self.layout.servers):
            self._request(s, Header(Kind.LOAD, count=len(path), need=flags), blob=path)
        self._wait(self.pusher.wait_sends)
        self._take_replies()


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast_floats(x, dtype) for x in obj)
    if isinstance(obj, dict):
        return {k: _cast_floats(v, dtype) for k, v in obj.items()}
    return obj


def make_worker_logging(dp_rank: int) -> None:
    """Worker 0 logs its step lines (global rank 0 is a server)."""
    if dp_rank == 0:
        logger.setLevel(logging.INFO)
