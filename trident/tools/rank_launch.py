"""Run one function on N fresh processes, one per device, and collect each rank's return value.

The GPU check starts a new process group for every check: a check that crashes, hangs or
leaves memory behind cannot spoil the next one, and `torch.cuda.max_memory_allocated` starts
from zero. Each process sets torchrun's variables (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) and starts its group through `trident.comm.init_distributed`, so it takes the same
start-up path as a job under `trident launch`: NCCL with one GPU per rank on CUDA, gloo on CPU.

When a rank raises, the others get `GRACE_S` to finish (they are usually waiting for it in a
collective) and are then killed; a run past its timeout is killed as a whole.
"""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import queue
import socket
import sys
import time
import traceback
from typing import Any, Callable

GRACE_S = 5.0
PROCESS_GROUP_TIMEOUT_S = 120.0
LOG_TAIL_LINES = 20


class RankError(RuntimeError):
    """A rank raised, died without answering, or the run timed out."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, device_type: str, fn: Callable, results: Any) -> None:
    """One rank: start the group, run `fn(device)`, send ("ok", value) or ("error", traceback)."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    import torch
    import torch.distributed as dist

    from trident.comm.backend import init_distributed

    log = io.StringIO()
    sys.stdout = log  # the engine's start-up report: kept, and shown only with a failure
    try:
        if device_type == "cpu":
            torch.set_num_threads(1)
        env = init_distributed(backend="nccl" if device_type == "cuda" else "gloo",
                               timeout_s=PROCESS_GROUP_TIMEOUT_S)
        value = fn(env.device)
        if device_type == "cuda":
            torch.cuda.synchronize()
        results.put((rank, "ok", value))
    except BaseException:
        tail = "".join(log.getvalue().splitlines(keepends=True)[-LOG_TAIL_LINES:])
        results.put((rank, "error", (f"rank {rank}'s output, last lines:\n{tail}" if tail else "")
                     + traceback.format_exc()))
        return
    from trident.reliability import shutdown

    shutdown()  # the hang detector's watchdog first: it talks to the other ranks too
    dist.barrier()  # nobody tears the group down while another rank still uses it
    dist.destroy_process_group()


def run_ranks(fn: Callable, world: int, device_type: str, timeout_s: float = 600.0) -> list:
    """`fn(device)` on `world` new processes (NCCL on CUDA, gloo on CPU); the values in rank order.

    `fn` must be a module-level function (it is pickled by reference). Raises RankError with
    the first failing rank's traceback.
    """
    if device_type not in ("cuda", "cpu"):
        raise ValueError(f"device_type must be 'cuda' or 'cpu', got {device_type!r}")
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, device_type, fn, results),
                         name=f"trident-check-rank{r}", daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    try:
        return _collect(procs, results, timeout_s)
    finally:
        deadline = time.monotonic() + GRACE_S  # ranks that answered are tearing their group down
        for p in procs:
            p.join(timeout=max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
        results.join_thread()


def _collect(procs: list, results: Any, timeout_s: float) -> list:
    values: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    failure: str | None = None
    while len(values) < len(procs):
        try:
            rank, status, value = results.get(timeout=0.5)
        except queue.Empty:
            if time.monotonic() > deadline:
                missing = sorted(set(range(len(procs))) - set(values))
                raise RankError(failure or f"ranks {missing} did not finish within {timeout_s:g} s") from None
            dead = [r for r, p in enumerate(procs) if r not in values and not p.is_alive() and p.exitcode]
            if dead and failure is None:
                failure = f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} without answering"
                deadline = min(deadline, time.monotonic() + GRACE_S)
            continue
        values[rank] = value
        if status == "error" and failure is None:
            failure = f"rank {rank} raised:\n{value.rstrip()}"
            deadline = min(deadline, time.monotonic() + GRACE_S)
    if failure is not None:
        raise RankError(failure)
    return [values[r] for r in range(len(procs))]
