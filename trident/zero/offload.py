"""Where ZeRO's fp32 masters and optimizer states live: with the parameters, in host memory, on NVMe.

`ZeroOptimizer` steps its partition one sub-group (at most `sub_group_size` elements) at a
time and asks a placement object around each sub-group's step:

- `OnDevice` (offload_optimizer.device none): masters next to the parameters (views of them in
  fp32 training), gradients used in place; every hook is a no-op.
- `HostOffload` (device cpu, ZeRO-Offload): masters and optimizer states in host memory (pinned
  on CUDA with `pin_memory`), each sub-group's gradients copied into a host fp32 buffer, the
  step on the CPU, the new values copied back into the device's parameter shards
  (non-blocking on CUDA).
- `NVMeOffload` (device nvme, ZeRO-Infinity): as `HostOffload`, but each sub-group's masters
  and optimizer-state tensors are packed into one host buffer that is written to its own swap
  file after the step and read back before the next one. Reads of the next sub-group are
  started while the current one steps (`pipeline_read`) and writes finish in the background
  (`pipeline_write`); at most `buffer_count` buffers exist at once.

Swapped-out tensors become empty tensors in place (the same Parameter and state-dict objects),
so the torch optimizer, its param groups and `state_dict()` keep their shape.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from trident.optim.clipping import contiguous_runs

from trident.zero.nvme import AsyncFileIO, SwapDirectory, check_nvme_path

_ALIGN = 64
_STATE_BYTES_GUESS = 8
"""Bytes per element of optimizer state assumed when checking free disk space before the first
step (Adam's two fp32 moments; the masters' 4 bytes come on top)."""


def _pinned(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    return torch.empty(numel, dtype=dtype, pin_memory=pin and torch.cuda.is_available())


class OnDevice:
    """Masters and optimizer states with the parameters (no offload)."""

    device = "none"

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def make_master(self, piece: torch.Tensor) -> torch.Tensor:
        return piece if piece.dtype == torch.float32 else piece.detach().float().clone()

    def step_grads(self, grads: list[torch.Tensor], coef: float) -> list[torch.Tensor]:
        """fp32 gradients for the masters of one sub-group, multiplied by `coef`: in place when
        they are fp32 already (the partition is rewritten next window anyway), else as one fp32
        temporary of the sub-group. A few operators whatever the number of chunks, when the
        chunks lie side by side in the partition (they do, except under stage 1)."""
        runs = contiguous_runs(grads)
        if grads and grads[0].dtype == torch.float32:
            if coef != 1.0:
                torch._foreach_mul_(runs, coef)
            return grads
        if len(runs) == 1:
            flat = runs[0].float()
            if coef != 1.0:
                flat.mul_(coef)
            return list(flat.split([g.numel() for g in grads]))
        out = [g.float() for g in grads]
        if coef != 1.0:
            torch._foreach_mul_(out, coef)
        return out

    def copy_back(self, targets: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        """The updated masters into the (16-bit) parameter shards; nothing where they are one."""
        pairs = [(t, m) for t, m in zip(targets, masters) if t.data_ptr() != m.data_ptr()]
        if pairs:
            torch._foreach_copy_([t for t, _ in pairs], [m for _, m in pairs])

    def adopt(self, s: int, masters: list[torch.nn.Parameter]) -> None:
        """A new sub-group's masters exist (NVMe writes them out)."""

    def fetch(self, s: int) -> None:
        """Make sub-group `s`'s masters and optimizer states resident."""

    def prefetch(self, s: int) -> None:
        """Start making sub-group `s` resident."""

    def evict(self, s: int, dirty: bool = True) -> None:
        """Sub-group `s` is not needed until its next step."""

    def drain(self) -> None:
        """Wait for background writes."""

    def close(self) -> None:
        """Free files and threads."""

    def state_bytes(self, masters: list[torch.nn.Parameter], separate_masters: bool) -> int:
        n = sum(m.numel() * 4 for m in masters) if separate_masters else 0
        for m in masters:
            for t in self.optimizer.state.get(m, {}).values():
                if isinstance(t, torch.Tensor) and t.dim() > 0:
                    n += t.numel() * t.element_size()
        return n

    def placement(self, masters: list[torch.nn.Parameter], separate_masters: bool) -> dict[str, int]:
        """{where: bytes} of masters and optimizer states."""
        return {"device": self.state_bytes(masters, separate_masters), "host": 0, "nvme": 0}


class HostGradients:
    """ZeRO-Offload's gradient copies, overlapped with backward: as each bucket's reduction lands
    in the (stage 2-3) gradient partition on the window's last backward, its range goes down to
    a pinned fp32 host buffer on a side stream (converted to fp32 on the GPU first), while
    backward carries on; the step then finds the whole partition on the host and waits only for
    the last copies. On a CPU the copies are plain ones, in the same order."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self.buffers: dict[int, torch.Tensor] = {}   # partition storage -> its host fp32 copy
        self.origin: dict[int, int] = {}             # partition storage -> the partition's storage offset
        self.staged: dict[int, int] = {}             # partition storage -> elements copied this window
        self._stream = None
        self._pending = False

    def copy_down(self, partition: torch.Tensor, lo: int, hi: int) -> None:
        """Start copying partition[lo:hi] (final for this window) to the host."""
        key = partition.untyped_storage().data_ptr()
        host = self.buffers.get(key)
        if host is None:
            host = self.buffers[key] = _pinned(partition.numel(), torch.float32, self.pin)
            self.origin[key] = partition.storage_offset()
        if partition.is_cuda:
            if self._stream is None:
                self._stream = torch.cuda.Stream(partition.device)
            self._stream.wait_stream(torch.cuda.current_stream(partition.device))
            with torch.cuda.stream(self._stream):
                host[lo:hi].copy_(partition[lo:hi], non_blocking=self.pin)
            self._pending = True
        else:
            host[lo:hi].copy_(partition[lo:hi])
        self.staged[key] = self.staged.get(key, 0) + (hi - lo)

    def views(self, grads: list[torch.Tensor]) -> list[torch.Tensor] | None:
        """Host views of `grads` (1-D views of one partition) when the whole partition was copied
        down this window, after the copies finished; else None (copy them now)."""
        if not grads:
            return None
        key = grads[0].untyped_storage().data_ptr()
        host = self.buffers.get(key)
        if host is None or self.staged.get(key, 0) < host.numel():
            return None
        if self._pending:
            self._stream.synchronize()
            self._pending = False
        base = self.origin[key]
        views = []
        for g in grads:
            at = g.storage_offset() - base
            views.append(host[at:at + g.numel()])
        return views

    def window_done(self) -> None:
        """The step consumed this window's copies."""
        self.staged.clear()


class HostOffload(OnDevice):
    """Masters and optimizer states in host memory; the step on the CPU (ZeRO-Offload)."""

    device = "cpu"

    def __init__(self, optimizer: torch.optim.Optimizer, pin_memory: bool) -> None:
        super().__init__(optimizer)
        self.pin = pin_memory
        self._grad_buffer = torch.empty(0)
        self.gradients = HostGradients(pin_memory)
        self._out: dict[torch.dtype, torch.Tensor] = {}  # pinned staging of updated 16-bit shards
        self._out_event = None

    def make_master(self, piece: torch.Tensor) -> torch.Tensor:
        master = _pinned(piece.numel(), torch.float32, self.pin)
        master.copy_(piece.detach().reshape(-1))
        return master

    def step_grads(self, grads: list[torch.Tensor], coef: float) -> list[torch.Tensor]:
        """The sub-group's gradients in host fp32, multiplied by `coef`: the copies made during
        backward (`HostGradients`), or made now into one reused buffer."""
        staged = self.gradients.views(grads)
        if staged is not None:
            if coef != 1.0:
                torch._foreach_mul_(contiguous_runs(staged), coef)
            return staged
        total = sum(g.numel() for g in grads)
        if self._grad_buffer.numel() < total:
            self._grad_buffer = _pinned(total, torch.float32, self.pin)
        out = list(self._grad_buffer[:total].split([g.numel() for g in grads]))
        runs = contiguous_runs(grads)
        if len(runs) == 1:
            self._grad_buffer[:total].copy_(runs[0], non_blocking=self.pin)
        else:
            torch._foreach_copy_(out, grads, non_blocking=self.pin)
        if self.pin and torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        if coef != 1.0:
            self._grad_buffer[:total].mul_(coef)
        return out

    def copy_back(self, targets: list[torch.Tensor], masters: list[torch.Tensor]) -> None:
        """Updated masters into the device shards. To a GPU in another dtype they are converted on
        the host into a pinned staging buffer first, so the copy up is asynchronous (a copy that
        converts on the way goes through pageable memory and blocks)."""
        if not targets:
            return
        if targets[0].device.type != "cuda":
            torch._foreach_copy_(targets, masters)
            return
        dtype = targets[0].dtype
        if dtype == masters[0].dtype and all(m.is_pinned() for m in masters):
            torch._foreach_copy_(targets, masters, non_blocking=True)
            return
        total = sum(t.numel() for t in targets)
        if self._out_event is not None:
            self._out_event.synchronize()  # the last copy up from the staging buffer is done
        out = self._out.get(dtype)
        if out is None or out.numel() < total:
            out = self._out[dtype] = _pinned(total, dtype, self.pin)
        stage = list(out[:total].split([t.numel() for t in targets]))
        torch._foreach_copy_(stage, masters)
        torch._foreach_copy_(targets, [s.view(t.shape) for s, t in zip(stage, targets)], non_blocking=True)
        self._out_event = torch.cuda.current_stream(targets[0].device).record_event()

    def drain(self) -> None:
        self.gradients.window_done()

    def placement(self, masters: list[torch.nn.Parameter], separate_masters: bool) -> dict[str, int]:
        return {"device": 0, "host": self.state_bytes(masters, True), "nvme": 0}


@dataclass
class _Entry:
    """One tensor of a packed sub-group: master `index` (key None) or its state `key`."""

    index: int
    key: str | None
    shape: torch.Size
    dtype: torch.dtype
    offset: int

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * torch.empty((), dtype=self.dtype).element_size()


class NVMeOffload(HostOffload):
    """Masters and optimizer states in swap files, one per sub-group (ZeRO-Infinity)."""

    device = "nvme"

    def __init__(self, optimizer: torch.optim.Optimizer, cfg, aio, rank: int, numel: int) -> None:
        super().__init__(optimizer, cfg.pin_memory)
        key = "zero_optimization.offload_optimizer.nvme_path"
        path = check_nvme_path(cfg.nvme_path, numel * (4 + _STATE_BYTES_GUESS), key)
        self.dir = SwapDirectory(path, rank, key)
        self.io = AsyncFileIO(aio.threads, aio.block_size)
        self.read_ahead = cfg.pipeline_read is not False
        self.write_behind = cfg.pipeline_write is not False
        self.buffer_count = cfg.buffer_count
        self.groups: list[list[torch.nn.Parameter]] = []
        self.layouts: list[list[_Entry]] = []
        self.resident: dict[int, torch.Tensor] = {}
        self.reads: dict[int, tuple[Future, torch.Tensor]] = {}
        self.writes: dict[int, tuple[Future, torch.Tensor]] = {}
        self.free: list[torch.Tensor] = []
        self.io_wait = 0.0  # seconds the step spent blocked on reads and writes

    # -- buffers -------------------------------------------------------------------------------

    def _in_flight(self) -> int:
        return len(self.resident) + len(self.reads) + len(self.writes) + len(self.free)

    def _buffer(self, nbytes: int) -> torch.Tensor:
        """A free buffer of at least `nbytes`; waits for the oldest write when `buffer_count`
        buffers exist already."""
        while True:
            fit = next((i for i, b in enumerate(self.free) if b.numel() >= nbytes), None)
            if fit is not None:
                return self.free.pop(fit)  # by position: list.remove would compare tensors
            if self._in_flight() < self.buffer_count:
                return _pinned(nbytes, torch.uint8, self.pin)
            if self.free:
                self.free.pop(0)  # too small: make room for a larger one
            elif self.writes:
                self._finish_write(next(iter(self.writes)))
            else:  # every buffer is resident or being read: the caller needs one more
                return _pinned(nbytes, torch.uint8, self.pin)

    def _finish_write(self, s: int) -> None:
        future, buf = self.writes.pop(s)
        self._wait(future)
        self.free.append(buf)

    def _wait(self, future: Future) -> None:
        if not future.done():
            t = time.perf_counter()
            future.result()
            self.io_wait += time.perf_counter() - t
        else:
            future.result()

    # -- packing -------------------------------------------------------------------------------

    def _current_layout(self, s: int) -> list[_Entry]:
        entries, offset = [], 0
        for i, m in enumerate(self.groups[s]):
            tensors = [(None, m.data)] + sorted(
                (k, t) for k, t in self.optimizer.state.get(m, {}).items() if isinstance(t, torch.Tensor) and t.dim() > 0)
            for key, t in tensors:
                entries.append(_Entry(i, key, t.shape, t.dtype, offset))
                offset += -(-entries[-1].nbytes // _ALIGN) * _ALIGN
        return entries

    def _bind(self, s: int, buf: torch.Tensor) -> None:
        for e in self.layouts[s]:
            view = buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape)
            m = self.groups[s][e.index]
            if e.key is None:
                m.data = view
            else:
                self.optimizer.state[m][e.key] = view

    def _unbind(self, s: int) -> None:
        for e in self.layouts[s]:
            m = self.groups[s][e.index]
            if e.key is None:
                m.data = torch.empty(0, dtype=e.dtype)
            else:
                self.optimizer.state[m][e.key] = torch.empty(0, dtype=e.dtype)

    def _tensor(self, s: int, e: _Entry) -> torch.Tensor:
        m = self.groups[s][e.index]
        return m.data if e.key is None else self.optimizer.state[m][e.key]

    # -- the placement hooks -------------------------------------------------------------------

    def adopt(self, s: int, masters: list[torch.nn.Parameter]) -> None:
        assert s == len(self.groups), "sub-groups are adopted in order"
        self.groups.append(masters)
        self.layouts.append([])
        self.evict(s)

    def fetch(self, s: int) -> None:
        if s in self.resident:
            return
        if s in self.writes:  # still in memory: take the buffer back, no read
            future, buf = self.writes.pop(s)
            self._wait(future)
        elif s in self.reads:
            future, buf = self.reads.pop(s)
            self._wait(future)
        else:
            buf = self._buffer(self._nbytes(s))
            self._wait(self.io.read(self.dir.file(f"sub{s}.swp"), buf[:self._nbytes(s)]))
        self.resident[s] = buf
        self._bind(s, buf)

    def prefetch(self, s: int) -> None:
        if (not self.read_ahead or s >= len(self.groups) or s in self.resident or s in self.reads
                or s in self.writes or len(self.resident) + len(self.reads) >= self.buffer_count - 1):
            return
        buf = self._buffer(self._nbytes(s))
        self.reads[s] = (self.io.read(self.dir.file(f"sub{s}.swp"), buf[:self._nbytes(s)]), buf)

    def _nbytes(self, s: int) -> int:
        last = self.layouts[s][-1] if self.layouts[s] else None
        return last.offset + last.nbytes if last else 0

    def evict(self, s: int, dirty: bool = True) -> None:
        old = self.resident.pop(s, None)
        if not dirty and old is not None:
            self._unbind(s)
            self.free.append(old)
            return
        layout = self._current_layout(s)
        nbytes = layout[-1].offset + layout[-1].nbytes if layout else 0
        same = old is not None and layout == self.layouts[s] and all(
            self._tensor(s, e).data_ptr() == old[e.offset:].data_ptr() for e in layout)
        if same:
            buf = old
        else:
            buf = self._buffer(nbytes)
            for e in layout:
                buf[e.offset:e.offset + e.nbytes].view(e.dtype).view(e.shape).copy_(self._tensor(s, e))
            if old is not None:
                self.free.append(old)
        self.layouts[s] = layout
        self._unbind(s)
        self.writes[s] = (self.io.write(self.dir.file(f"sub{s}.swp"), buf[:nbytes]), buf)
        if not self.write_behind:
            self._finish_write(s)

    def drain(self) -> None:
        self.gradients.window_done()
        for s in list(self.writes):
            self._finish_write(s)
        for s in list(self.reads):  # prefetched but not used: keep the buffers
            future, buf = self.reads.pop(s)
            future.result()
            self.free.append(buf)
        self.free = self.free[:max(self.buffer_count - len(self.resident), 0)]

    def close(self) -> None:
        self.drain()
        self.io.close()
        self.dir.close()

    def placement(self, masters: list[torch.nn.Parameter], separate_masters: bool) -> dict[str, int]:
        on_disk = sum(self._nbytes(s) for s in range(len(self.groups)))
        held = sum(b.numel() for b in list(self.resident.values()) + self.free)
        held += sum(b.numel() for _, b in list(self.reads.values()) + list(self.writes.values()))
        return {"device": 0, "host": held, "nvme": on_disk}


def make_placement(zero_cfg, aio, optimizer: torch.optim.Optimizer, rank: int, numel: int) -> OnDevice:
    """The placement `zero_optimization.offload_optimizer` asks for."""
    cfg = zero_cfg.offload_optimizer
    if cfg.device == "cpu":
        return HostOffload(optimizer, cfg.pin_memory)
    if cfg.device == "nvme":
        return NVMeOffload(optimizer, cfg, aio, rank, numel)
    return OnDevice(optimizer)


def make_param_store(zero_cfg, aio, dtype: torch.dtype, rank: int, numel: int):
    """Stage 3 with `offload_param.device` nvme: the swap files of the parameter shards; else None."""
    from trident.zero.nvme import ParamSwapper

    cfg = zero_cfg.offload_param
    if cfg.device != "nvme":
        return None
    key = "zero_optimization.offload_param.nvme_path"
    itemsize = torch.empty((), dtype=dtype).element_size()
    path = check_nvme_path(cfg.nvme_path, numel * itemsize, key)
    return ParamSwapper(SwapDirectory(path, rank, key), AsyncFileIO(aio.threads, aio.block_size), dtype,
                        cfg.buffer_count)


def host_partition(numel: int, dtype: torch.dtype, device: torch.device, zero_cfg) -> torch.Tensor:
    """Stage 3's parameter partition: in (pinned) host memory with `offload_param.device` cpu,
    else on the parameters' device."""
    cfg = zero_cfg.offload_param
    if cfg.device == "cpu":
        return _pinned(numel, dtype, cfg.pin_memory).zero_()
    return torch.zeros(numel, dtype=dtype, device=device)
