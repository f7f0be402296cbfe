"""The systems bench/suite.py times, and one fresh run of one of them.

A `Job` names a system (trident at a ZeRO stage, DDP, DeepSpeed, FSDP2, trident or DTensor
tensor parallelism, trident or torch pipelining, compiled or eager); the step it times comes
from the benchmark that compares that system on its own (dp_vs_ddp, zero_vs_peers,
tp_vs_dtensor, pp_schedules), so the suite times exactly the loops those scripts time. Each
run starts fresh ranks (one process per rank, system and run), sends their output to
per-rank logs, and returns the slowest rank's median step time, or the reason it failed.
Compiled and eager runs are bench/compile_vs_eager.py's own `run` (demo.json's engine).

The ranks are forked from a fork server that has imported torch, trident and the benchmark
modules once (nothing else: no tensors, no threads, no process group), so each of the suite's
~100 runs starts in a fraction of a second instead of re-importing them; DeepSpeed is imported
by its own ranks.
"""

from __future__ import annotations

import datetime
import itertools
import os
import queue
import time
import traceback
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import DEMO_GPT, GPT_3_7M, build_gpt, free_port, start_rank, timed_steps, token_batches

SHAPES = {"gpt-3.7m": GPT_3_7M, "demo": DEMO_GPT}
GLOBAL_BATCH = 16
PP_MICRO_BATCHES = 4
RUN_TIMEOUT_S = 900
PRELOAD = ["suite_jobs", "trident", "dp_vs_ddp", "zero_vs_peers", "tp_vs_dtensor", "pp_schedules"]


@dataclass(frozen=True)
class Job:
    """One system; `kind` is trident | ddp | deepspeed | fsdp2 | tp | dtensor | pp | torch-pp | compile
    (`compile` True: compiled, else eager)."""

    kind: str
    model: str = "gpt-3.7m"
    stage: int = 0
    offload: bool = False
    compile: bool = False
    world: int = 2

    @property
    def micro(self) -> int:
        """Micro batch per rank for a global batch of 16: split over dp, whole under tp, M = 4 under pp."""
        if self.kind in ("tp", "dtensor"):
            return GLOBAL_BATCH
        if self.kind in ("pp", "torch-pp"):
            return GLOBAL_BATCH // PP_MICRO_BATCHES
        return GLOBAL_BATCH // self.world


def _dp_step(job: Job, shape: dict):
    """Data parallelism, ZeRO, their peers: step(batch) from dp_vs_ddp / zero_vs_peers."""
    import dp_vs_ddp
    import zero_vs_peers
    model = build_gpt(shape)
    if job.kind in ("trident", "ddp") and job.stage == 0:
        return dp_vs_ddp.step_fn(job.kind, model, job.world, job.micro)
    options = {"offload": True} if job.offload else {}
    backward, opt_step, _ = zero_vs_peers.SYSTEMS[job.kind](model, job.stage, job.world, micro=job.micro, **options)

    def step(batch: torch.Tensor) -> None:
        backward(batch)
        opt_step()
    return step


def _build(job: Job, rank: int):
    """(step, its inputs) for this rank."""
    shape = SHAPES[job.model]
    if job.kind in ("tp", "dtensor"):
        import tp_vs_dtensor
        _, step, _ = tp_vs_dtensor.make_step("trident" if job.kind == "tp" else "dtensor", job.world, False, shape)
        return step, token_batches(0, shape, job.micro)  # every tp rank sees the same batches
    if job.kind in ("pp", "torch-pp"):
        import pp_schedules
        from trident.parallel.mesh import ParallelMesh
        mesh = ParallelMesh.build(pp=job.world)
        if job.kind == "pp":
            step = pp_schedules._trident("1f1b", 1, PP_MICRO_BATCHES, mesh, shape, job.micro)[1]
        else:
            step = pp_schedules._torch("1f1b", PP_MICRO_BATCHES, mesh, shape, job.micro)
        return step, itertools.count()  # the pipeline steps draw their batches from the step index
    return _dp_step(job, shape), token_batches(rank, shape, job.micro)


def _worker(rank: int, port: int, job: Job, warmup: int, steps: int, log_path: str, out) -> None:
    """One rank: build the system, time the steps, put (rank, seconds) or (rank, error) on `out`."""
    start_rank(rank, job.world, port)
    log = open(log_path, "w", buffering=1)
    os.dup2(log.fileno(), 1)  # start-up tables, DeepSpeed's logs and C++ warnings stay out of the report
    os.dup2(log.fileno(), 2)
    if job.kind == "deepspeed":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        dist.init_process_group("gloo", rank=rank, world_size=job.world, timeout=datetime.timedelta(seconds=300))
        step, batches = _build(job, rank)
        median, _ = timed_steps(step, batches, warmup, steps)
        out.put((rank, median))
        dist.destroy_process_group()
    except BaseException as e:  # the parent reports it on the row; the log keeps the traceback
        traceback.print_exc()
        out.put((rank, reason(e)))


def reason(e: BaseException) -> str:
    """An exception as one short line for a table cell."""
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def _compile_run(job: Job, warmup: int, steps: int) -> float | str:
    """compile_vs_eager.run: seconds per step, or why not; a "compiled" run that compiled nothing
    (no compile report) would time eager code, so it is reported instead."""
    try:
        import compile_vs_eager
        result = compile_vs_eager.run("compiled" if job.compile else "eager", steps, warmup, job.world)
    except Exception as e:
        return f"bench/compile_vs_eager.py: {reason(e)}"
    if job.compile and result.get("graph_breaks") is None:
        return "the engine made no compile report: nothing was compiled"
    return result["step_s"]


def run_job(job: Job, warmup: int, steps: int, log_dir: str, tag: str) -> float | str:
    """Fresh ranks for one run: the slowest rank's median step seconds, or why the run failed."""
    if job.kind == "compile":
        return _compile_run(job, warmup, steps)
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # takes effect when the server starts, at the first run
    out, port = ctx.Queue(), free_port()
    logs = [os.path.join(log_dir, f"{tag}-rank{r}.log") for r in range(job.world)]
    procs = [ctx.Process(target=_worker, daemon=True, args=(r, port, job, warmup, steps, logs[r], out))
             for r in range(job.world)]
    for p in procs:
        p.start()
    answers: dict[int, float | str] = {}
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while len(answers) < job.world:
            try:
                rank, value = out.get(timeout=1.0)
                answers[rank] = value
                if isinstance(value, str):
                    return f"{value} (rank {rank}; log {logs[rank]})"
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead:
                    return f"rank {dead[0]} exited with code {procs[dead[0]].exitcode} (log {logs[dead[0]]})"
                if time.monotonic() > deadline:
                    return f"no answer within {RUN_TIMEOUT_S} s (logs {logs})"
        return max(answers.values())
    finally:
        for p in procs:
            p.join(30 if len(answers) == job.world else 0)
            if p.is_alive():
                p.kill()
                p.join()
