"""Run a function on N gloo ranks from a test: `run_on_ranks(2, fn, *args)`.

Starting processes and a process group costs seconds, running a function on them costs
milliseconds, so the worker processes are kept: one pool per world size, spawned on first use,
with the gloo group initialised once, reused by every later call and shut down at exit.

A call pickles `fn` (by reference: it must be a module-level function) and its arguments to
every worker and returns the per-rank results in rank order. When a rank raises, the caller
gets a `RankFailure` with that rank's traceback. Ranks left behind (typically waiting in a
collective for the rank that failed) or a call past its timeout get the pool killed; the
next call starts a fresh one, so one broken test does not break the next.

Inside a worker, `cached_mesh()` and `cached_solo_mesh()` return process-wide cached meshes:
tests share a handful of gloo groups instead of creating new ones on every call.
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import socket
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

import torch
import torch.distributed as dist

from trident.comm.backend import init_distributed
from trident.parallel.mesh import ParallelMesh
from trident.parallel.topology import Topology

PROCESS_GROUP_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0
GRACE_AFTER_FAILURE_S = 1.0  # how long the other ranks may take to finish after one raised

_WORKER_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}


class RankFailure(RuntimeError):
    """A rank raised, died, or the call timed out. `rank` is None for a timeout."""

    def __init__(self, message: str, rank: int | None, finished: list[int], running: list[int]) -> None:
        super().__init__(message)
        self.rank, self.finished, self.running = rank, finished, running


class RankTimeout(RankFailure):
    """The call did not finish on every rank within its timeout."""


# -- worker side ----------------------------------------------------------------------------

def _worker_main(rank: int, world_size: int, port: int, conn: Connection) -> None:
    """Initialise gloo once, then run the functions sent down `conn` until the parent closes it."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        torch.set_num_threads(1)
        init_distributed(backend="gloo", timeout_s=PROCESS_GROUP_TIMEOUT_S)
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        try:
            payload = conn.recv_bytes()
        except EOFError:  # the parent is gone
            break
        try:
            fn, args, kwargs = pickle.loads(payload)
            reply = pickle.dumps(("ok", fn(*args, **kwargs)))
        except BaseException:
            reply = pickle.dumps(("error", traceback.format_exc()))
        conn.send_bytes(reply)
    dist.destroy_process_group()


# -- parent side ----------------------------------------------------------------------------

def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Pool:
    """`world_size` spawned workers forming one gloo group."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        ctx = mp.get_context("spawn")
        port = _free_port()
        self.conns: list[Connection] = []
        self.procs: list[mp.process.BaseProcess] = []
        saved = {k: os.environ.get(k) for k in _WORKER_ENV}
        os.environ.update(_WORKER_ENV)  # spawned children copy it before importing torch
        try:
            for rank in range(world_size):
                parent, child = ctx.Pipe(duplex=True)
                proc = ctx.Process(target=_worker_main, args=(rank, world_size, port, child),
                                   name=f"trident-rank{rank}-of-{world_size}")
                proc.start()
                child.close()
                self.conns.append(parent)
                self.procs.append(proc)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        self._await_ready()

    def _await_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        for rank, conn in enumerate(self.conns):
            if not self._readable(rank, deadline):
                self.kill()
                raise RuntimeError(f"rank {rank} of a {self.world_size}-rank test pool did not start within "
                                   f"{START_TIMEOUT_S:.0f} s (exit code {self.procs[rank].exitcode})")
            status, detail = self._reply(rank)
            if status != "ready":
                self.kill()
                raise RuntimeError(f"rank {rank} of a {self.world_size}-rank test pool failed to start:\n{detail}")

    def _readable(self, rank: int, deadline: float) -> bool:
        """Wait until rank's pipe has data; False if it died first or the deadline passed."""
        conn, proc = self.conns[rank], self.procs[rank]
        while not conn.poll():
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not proc.is_alive():
                return conn.poll()
            wait([conn, proc.sentinel], timeout=remaining)
        return True

    def run(self, fn: Callable, args: tuple, kwargs: dict, timeout: float) -> list:
        payload = pickle.dumps((fn, args, kwargs))
        try:
            for conn in self.conns:
                conn.send_bytes(payload)
            results, finished, failure, running = self._collect(timeout)
        except BaseException:  # e.g. Ctrl-C: the workers are in an unknown state
            self.kill()
            raise
        restart = bool(running) or not all(p.is_alive() for p in self.procs)
        if restart:
            self.kill()
        name = getattr(fn, "__qualname__", repr(fn))
        state = (f"finished: {finished or 'none'}; still running: {running or 'none'}"
                 + ("; the pool was killed and the next call starts a new one" if restart else ""))
        if failure is not None:
            rank, tb = failure
            raise RankFailure(f"rank {rank} of {self.world_size} raised in {name}:\n{tb.rstrip()}\n{state}",
                              rank, finished, running)
        if running:
            raise RankTimeout(f"{name} did not finish on {self.world_size} ranks within {timeout:g} s; {state}",
                              None, finished, running)
        return results

    def _collect(self, timeout: float) -> tuple[list, list[int], tuple[int, str] | None, list[int]]:
        """Read replies until all ranks answered, the timeout passed, or the grace after a failure."""
        results: list[Any] = [None] * self.world_size
        pending = set(range(self.world_size))
        finished: list[int] = []
        failure: tuple[int, str] | None = None
        deadline = time.monotonic() + timeout
        while pending and (remaining := deadline - time.monotonic()) > 0:
            waitables = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            for ready in wait(list(waitables), timeout=remaining):
                rank = waitables[ready]
                if rank not in pending or not (self.conns[rank].poll() or not self.procs[rank].is_alive()):
                    continue
                pending.discard(rank)
                status, value = self._reply(rank)
                if status == "ok":
                    results[rank] = value
                    finished.append(rank)
                elif failure is None:
                    failure = (rank, value)
                    deadline = min(deadline, time.monotonic() + GRACE_AFTER_FAILURE_S)
        return results, sorted(finished), failure, sorted(pending)

    def _reply(self, rank: int) -> tuple[str, Any]:
        """The (status, value) rank sent, or an error if it died without sending one."""
        try:
            data = self.conns[rank].recv_bytes() if self.conns[rank].poll() else None
        except EOFError:
            data = None
        if data is None:
            self.procs[rank].join(timeout=5)
            return "error", f"worker process exited with code {self.procs[rank].exitcode} without replying"
        try:
            return pickle.loads(data)
        except Exception:
            return "error", "the result could not be unpickled in the test process:\n" + traceback.format_exc()

    def kill(self) -> None:
        """Stop every worker now. Idle workers hold nothing worth a graceful exit (~1 s each)."""
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join()
        for conn in self.conns:
            conn.close()
        if _POOLS.get(self.world_size) is self:
            del _POOLS[self.world_size]


_POOLS: dict[int, _Pool] = {}


def run_on_ranks(world_size: int, fn: Callable, *args: Any, timeout: float = 180, **kwargs: Any) -> list:
    """Run `fn(*args, **kwargs)` on every rank of a `world_size`-rank gloo group; results in rank order.

    `fn` must be a module-level function (it is pickled by reference). Raises `RankFailure`
    with the failing rank's traceback, or `RankTimeout` after `timeout` seconds.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    pool = _POOLS.get(world_size)
    if pool is None:
        pool = _POOLS[world_size] = _Pool(world_size)
    return pool.run(fn, args, kwargs, timeout)


def shutdown_pool(world_size: int | None = None) -> None:
    """Stop the pool of `world_size` ranks (all pools when None); the next call starts a new one."""
    sizes = list(_POOLS) if world_size is None else [world_size]
    for size in sizes:
        pool = _POOLS.pop(size, None)
        if pool is not None:
            pool.kill()


atexit.register(shutdown_pool)


# -- inside workers -------------------------------------------------------------------------

_MESHES: dict[object, ParallelMesh] = {}


def cached_mesh(pp: int = 1, tp: int = 1, dp: int | None = None, *, cp: int = 1, ep: int = 1) -> ParallelMesh:
    """This process's ParallelMesh for the layout, built on first use and then reused.

    Collective on first use of a layout: call it on every rank in the same order.
    """
    if dp is None:
        dp = Topology.for_world(dist.get_world_size(), pp=pp, tp=tp, cp=cp, ep=ep).dp
    key = (pp, dp, cp, ep, tp)
    if key not in _MESHES:
        _MESHES[key] = ParallelMesh.build(pp=pp, tp=tp, dp=dp, cp=cp, ep=ep)
    return _MESHES[key]


def cached_solo_mesh() -> ParallelMesh:
    """This process's one-rank mesh (`ParallelMesh.solo()`), built on first use and then reused."""
    if "solo" not in _MESHES:
        _MESHES["solo"] = ParallelMesh.solo()
    return _MESHES["solo"]
