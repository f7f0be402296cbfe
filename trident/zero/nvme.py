"""NVMe offload (ZeRO-Infinity): swap directories, a background I/O pool, parameter swap files.

- `check_nvme_path`: missing, non-directory, read-only or too-full paths fail before training.
- `SwapDirectory`: one directory per rank and kind under `nvme_path`
  (`trident-rank<r>-offload_optimizer`, `...-offload_param`), claimed with an exclusive `flock`
  on a lock file beside it, so a second run pointed at the same path fails with a clear error
  instead of overwriting this run's states. It is removed when the engine's optimizer is closed,
  garbage-collected, or the interpreter exits; the lock dies with the process, so a crashed
  run's leftovers are taken over by the next run.
- `AsyncFileIO`: a thread pool doing positioned reads and writes (`os.preadv` / `os.pwrite`) of
  `aio.block_size` bytes per call, one request split over `aio.thread_count` threads. `wait()`
  counts the time the training thread spends blocked, the figure that says whether paging is
  hidden behind compute.
- `ParamSwapper`: stage 3's parameter shards, one file per unit (ZeRO-Infinity's
  `offload_param`). The optimizer states' swapping lives in trident.zero.offload.

Page cache: reads of recently written files may be served from the OS page cache; that memory
belongs to the kernel, not to the process, and is reclaimed under pressure.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import shutil
import tempfile
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor

import torch

def check_nvme_path(path: str | None, need_bytes: int, key: str) -> str:
    """`path`, after checking that it can hold `need_bytes` of swap files; else a clear error."""
    if not path:
        raise ValueError(f"{key} is not set; give a directory on a fast local disk")
    if not os.path.exists(path):
        raise ValueError(f"{key} {path!r} does not exist; create the directory or point the key at an existing one")
    if not os.path.isdir(path):
        raise ValueError(f"{key} {path!r} is not a directory; point it at a directory on a fast local disk")
    try:  # a real write: permissions, read-only mounts and pseudo file systems alike
        with tempfile.NamedTemporaryFile(dir=path, prefix=".trident-probe-"):
            pass
    except OSError as err:
        raise ValueError(f"{key} {path!r} is not writable by this process ({err.strerror}); fix its permissions "
                         "or choose another directory") from None
    free = shutil.disk_usage(path).free
    if free < need_bytes:
        raise ValueError(f"{key} {path!r} has {free / 2**30:.3f} GiB free but this rank needs about "
                         f"{need_bytes / 2**30:.3f} GiB of swap files; free space or choose a larger disk")
    return path


def _cleanup(directory: str, lock: list) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    if lock:
        fd = lock.pop()
        try:
            os.unlink(directory + ".lock")
        except FileNotFoundError:
            pass
        os.close(fd)  # releases the flock


class SwapDirectory:
    """This rank's swap directory for one kind of state (`key`) under `path`, locked for the
    life of the run and removed at its end."""

    def __init__(self, path: str, rank: int, key: str) -> None:
        kind = key.split(".")[-2] if key.count(".") >= 1 else "swap"
        self.path = os.path.join(path, f"trident-rank{rank}-{kind}")
        lock_path = self.path + ".lock"
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"{key} {path!r} is in use by another trident run ({_read_text(lock_path)}), "
                               f"which holds {lock_path}; give each concurrent run its own nvme_path") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}".encode())
        shutil.rmtree(self.path, ignore_errors=True)  # a crashed run's leftovers: its lock was free
        os.makedirs(self.path)
        self._finalizer = weakref.finalize(self, _cleanup, self.path, [fd])
        atexit.register(self._finalizer)

    def file(self, name: str) -> str:
        return os.path.join(self.path, name)

    def bytes_on_disk(self) -> int:
        return sum(e.stat().st_size for e in os.scandir(self.path)) if os.path.isdir(self.path) else 0

    def close(self) -> None:
        """Delete the swap files and release the lock (idempotent)."""
        self._finalizer()


def _read_text(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip() or "pid unknown"
    except OSError:
        return "pid unknown"


class AsyncFileIO:
    """Positioned file reads and writes on background threads (the `aio` section). A request
    is split over the threads; each piece moves `block_size` bytes per system call."""

    def __init__(self, threads: int = 1, block_size: int = 1 << 20) -> None:
        self.threads, self.block_size = threads, block_size
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="trident-aio")
        self.wait_seconds = 0.0  # time callers of `wait` spent blocked
        self.bytes_read = self.bytes_written = 0

    def write(self, path: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Write `tensor`'s bytes into `path` at byte `offset` (created if needed). The tensor
        must stay untouched until the future is done."""
        self.bytes_written += tensor.numel() * tensor.element_size()
        return self._submit(path, tensor, offset, write=True)

    def read(self, path: str, tensor: torch.Tensor, offset: int = 0) -> Future:
        """Fill `tensor` (contiguous, on the CPU) with the bytes of `path` from byte `offset`."""
        self.bytes_read += tensor.numel() * tensor.element_size()
        return self._submit(path, tensor, offset, write=False)

    def wait(self, future: Future):
        start = time.perf_counter()
        result = future.result()
        self.wait_seconds += time.perf_counter() - start
        return result

    def _submit(self, path: str, tensor: torch.Tensor, offset: int, write: bool) -> Future:
        if not tensor.is_contiguous():
            raise ValueError("swap I/O needs a contiguous tensor")
        view = memoryview(tensor.view(torch.uint8).reshape(-1).numpy()) if tensor.numel() else memoryview(b"")
        n = len(view)
        per = -(-max(n, 1) // self.threads)
        per = -(-per // self.block_size) * self.block_size
        parts = [self.pool.submit(_transfer, path, view[a:a + per], offset + a, self.block_size, write)
                 for a in range(0, max(n, 1), per)]
        if len(parts) == 1:
            return parts[0]
        return _all_of(parts)

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _all_of(parts: list[Future]) -> Future:
    """One future done when all `parts` are (with the first error, if any)."""
    joined: Future = Future()
    left = [len(parts)]
    lock = threading.Lock()

    def one_done(f: Future) -> None:
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if f.exception() is not None and not joined.done():
            joined.set_exception(f.exception())
        elif last and not joined.done():
            joined.set_result(None)

    for f in parts:
        f.add_done_callback(one_done)
    return joined


def _transfer(path: str, view: memoryview, offset: int, block: int, write: bool) -> None:
    fd = os.open(path, (os.O_WRONLY | os.O_CREAT) if write else os.O_RDONLY, 0o644)
    try:
        pos = 0
        while pos < len(view):
            piece = view[pos:pos + block]
            n = os.pwrite(fd, piece, offset + pos) if write else os.preadv(fd, [piece], offset + pos)
            if n == 0:
                raise EOFError(f"swap file {path} ended at byte {offset + pos}: it was truncated or removed "
                               "while training; keep nvme_path private to this run")
            pos += n
    finally:
        os.close(fd)


# -- stage 3 parameter shards -----------------------------------------------------------------

class ParamSwapper:
    """Stage 3's parameter shards (compute dtype), one file per unit: read ahead of the unit's
    all-gather, dropped once the gather has its input, updated by positioned writes after the
    step. At most `buffer_count` reads are in flight and `buffer_count` writes pending."""

    def __init__(self, directory: SwapDirectory, io: AsyncFileIO, dtype: torch.dtype, buffer_count: int) -> None:
        self.dir, self.io, self.dtype, self.buffer_count = directory, io, dtype, max(buffer_count, 1)
        self.numel: dict = {}
        self._reads: dict = {}
        self._writes: list[tuple[Future, torch.Tensor]] = []

    def _file(self, key) -> str:
        return self.dir.file(f"param{key[0]}_{key[1]}.swp")

    def create(self, key, shard: torch.Tensor) -> None:
        """A unit's shard as built at start-up; this copy is the only one kept."""
        self.numel[key] = shard.numel()
        self._write(key, shard.detach().to(self.dtype).contiguous().clone(), 0)

    def prefetch(self, key) -> bool:
        """Start reading a unit's shard unless it is on its way; False once the read-ahead
        budget (`buffer_count` shards) is spent."""
        if key in self._reads:
            return True
        if len(self._reads) >= self.buffer_count:
            return False
        self._start_read(key)
        return True

    def _start_read(self, key) -> None:
        self.flush()  # a unit is never read while an update of it is still being written
        buf = torch.empty(self.numel[key], dtype=self.dtype)
        self._reads[key] = (self.io.read(self._file(key), buf), buf)

    def take(self, key) -> torch.Tensor:
        """The unit's shard, read now if it was not read ahead; no longer held here."""
        if key not in self._reads:
            self._start_read(key)
        future, buf = self._reads.pop(key)
        self.io.wait(future)
        return buf

    def write_range(self, key, start: int, values: torch.Tensor) -> None:
        """Elements [start, start + len) of the unit's shard become `values` (in the background)."""
        stale = self._reads.pop(key, None)
        if stale is not None:
            self.io.wait(stale[0])
        self._write(key, values.detach().to(self.dtype).contiguous().clone(), start)

    def read_range(self, key, start: int, end: int) -> torch.Tensor:
        self.flush()
        out = torch.empty(end - start, dtype=self.dtype)
        self.io.wait(self.io.read(self._file(key), out, offset=start * out.element_size()))
        return out

    def _write(self, key, values: torch.Tensor, start: int) -> None:
        self._writes.append((self.io.write(self._file(key), values, offset=start * values.element_size()), values))
        self._writes = [w for w in self._writes if not w[0].done()]
        while len(self._writes) > self.buffer_count:
            self.io.wait(self._writes.pop(0)[0])

    def flush(self) -> None:
        while self._writes:
            self.io.wait(self._writes.pop(0)[0])

    def drop_reads(self) -> None:
        for future, _ in self._reads.values():
            future.result()
        self._reads.clear()

    def bytes_on_disk(self) -> int:
        return sum(self.numel.values()) * torch.empty(0, dtype=self.dtype).element_size()

    def close(self) -> None:
        """Finish I/O, stop the threads, delete the files (idempotent)."""
        self.drop_reads()
        self.flush()
        self.io.close()
        self.dir.close()
