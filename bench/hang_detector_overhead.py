"""The hang detector's cost on a data-parallel step: the same step with it on and off.

Two gloo ranks train the reference GPT with trident's data parallelism. The detector is a
per-process switch (`trident.reliability.configure`), so both settings run in the same
processes on the same engine, interleaved repeat by repeat in rotating order; each repeat
times `--steps` steps (a barrier before each, median per repeat), and the report gives the
median over repeats of each setting, their ratio, and the median of the per-repeat ratios
(the two settings of a repeat run back to back, so machine drift cancels best there).

Small gradient buckets make the step issue many collectives (the worst case for a per-call
cost); the report also times the recorder alone (record + complete one call) and multiplies
by the calls per step, which bounds the overhead more precisely than the difference of two
noisy step times.

    python bench/hang_detector_overhead.py [--repeats 7] [--steps 10] [--bucket 20000]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import build_gpt, free_port, rotated, start_rank, timed_steps, token_batches

MODEL = dict(vocab_size=2048, seq_len=64, n_layer=2, n_head=4, d_model=128)
MICRO = 4
WARMUP = 2
SETTINGS = ("off", "on")


def _engine_step(bucket: int):
    import trident
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket}}
    engine, *_ = trident.initialize(model=build_gpt(MODEL), config=cfg)

    def step(batch):
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    return engine, step


def _switch(setting: str) -> None:
    from trident.config.schema import DistributedConfig
    from trident.reliability import configure
    configure(DistributedConfig(hang_detector=setting == "on"))


def _recorder_cost(calls: int = 20000) -> float:
    """Seconds to record and complete one collective call, measured on this rank alone."""
    from trident.comm.recorder import FlightRecorder
    recorder = FlightRecorder(256, dist.get_rank(), 1800.0)
    t = torch.ones(1000)
    group = dist.group.WORLD
    start = time.perf_counter()
    for _ in range(calls):
        recorder.end(recorder.collective("all_reduce", group, t, True))
    return (time.perf_counter() - start) / calls


def _calls_per_step(step, batches) -> int:
    from trident.reliability import active_recorder
    recorder = active_recorder()
    before = recorder.count
    step(next(batches))
    return recorder.count - before


def _worker(rank: int, world: int, port: int, args, out) -> None:
    start_rank(rank, world, port)
    sys.stdout = open(os.devnull, "w")  # keep trident's start-up tables out of the report
    import trident.comm.backend as backend
    backend.init_distributed(backend="gloo")
    engine, step = _engine_step(args.bucket)
    batches = token_batches(rank, MODEL, MICRO)
    times = {s: [] for s in SETTINGS}
    for repeat in range(args.repeats):
        for setting in rotated(SETTINGS, repeat):
            _switch(setting)
            times[setting].append(timed_steps(step, batches, WARMUP, args.steps)[0])
    _switch("on")
    calls = _calls_per_step(step, batches)
    cost = _recorder_cost()
    if rank == 0:
        out.put((times, calls, cost))
    dist.barrier()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--bucket", type=int, default=20000, help="gradient bucket size in elements")
    args = parser.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    mp.start_processes(_worker, args=(2, free_port(), args, out), nprocs=2, join=True, start_method="spawn")
    times, calls, cost = out.get()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    print(f"reference GPT {MODEL}, micro {MICRO}, dp 2 (gloo, 1 thread per rank), "
          f"buckets of {args.bucket} elements; {args.repeats} interleaved repeats x {args.steps} steps")
    print(f"{'detector':<10}{'median step ms':>16}{'per-repeat medians (ms)':>40}")
    for setting, median in (("off", off), ("on", on)):
        per = " ".join(f"{t * 1e3:.1f}" for t in times[setting])
        print(f"{setting:<10}{median * 1e3:>16.2f}   {per}")
    paired = statistics.median(a / b for a, b in zip(times["on"], times["off"]))
    print(f"on / off: {on / off:.4f} ({(on / off - 1) * 100:+.2f}%); median of the per-repeat ratios "
          f"(adjacent runs): {paired:.4f} ({(paired - 1) * 100:+.2f}%)")
    print(f"recorded calls per step: {calls}; recorder cost per call: {cost * 1e6:.2f} us; "
          f"bound: {calls * cost / off * 100:.3f}% of the step")


if __name__ == "__main__":
    main()
