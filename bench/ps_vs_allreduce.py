"""Parameter servers (sync, async k = 0, 2, 8, 1000) vs trident data parallelism, one worker 2x slow.

World size 4 on this machine: 1 server + 3 workers and 2 servers + 2 workers, against data
parallelism (all-reduce) over all 4 ranks. Same model (the reference GPT), micro-batch and
optimizer (AdamW) everywhere. The last worker is slowed by 2x: after each step it sleeps as
long as one forward + backward takes it (measured once, before the runs).

Reported per system, median over interleaved repeats (rotating order, one pool of 4 processes):

- worker steps/s: gradients computed and applied per second, summed over the workers (each is
  one micro-batch, so x micro = samples/s); sync and data parallelism take one optimizer step
  per round, async one per worker step.
- slowest / fastest: steps of the slow worker and of the fastest worker in the timed window.
- MB per worker step: bytes a worker sent plus received per step. Parameter servers: the fp32
  gradient out, the fp32 parameters in (+ headers). All-reduce: gloo's ring on the flat gradient,
  2 (n - 1) / n of it each way (the comms logger's bus bytes, sent and received).

    python bench/ps_vs_allreduce.py [--repeats 5] [--steps 30]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import build_gpt, rotated  # noqa: E402

MODEL = dict(vocab_size=512, seq_len=32, n_layer=2, n_head=4, d_model=128)
MICRO = 8
WARMUP = 3
WORLD = 4
# k=1000 never binds in these runs: fast workers run at their own speed (unbounded staleness)
SYSTEMS = tuple(f"ps{layout} {mode}" for layout in ("1+3", "2+2")
                for mode in ("sync", "async k=0", "async k=2", "async k=8", "async k=1000")) + ("allreduce dp=4",)


def _config(system: str) -> tuple[dict, int]:
    """The trident config of a system, and its number of servers."""
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": 200_000},
           "comms_logger": {"enabled": True}, "distributed": {"timeout_s": 120}}
    if system.startswith("allreduce"):
        return cfg, 0
    servers = int(system[2])
    mode = "sync" if system.endswith("sync") else "async"
    k = int(system.rsplit("=", 1)[1]) if mode == "async" else 0
    cfg["parameter_server"] = {"servers": servers, "mode": mode, "staleness": k}
    return cfg, servers


def _batches(rank: int):
    g = torch.Generator().manual_seed(rank)
    while True:
        yield torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=g)


def calibrate() -> float:
    """Median seconds of one plain forward + backward of the model on this rank."""
    torch.set_num_threads(1)
    model, batches, times = build_gpt(MODEL), _batches(99), []
    for _ in range(6):
        batch = next(batches)
        start = time.perf_counter()
        model(batch[:, :-1], batch[:, 1:]).backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def run_system(system: str, steps: int, slow_s: float) -> dict:
    """One rank of one run (inside a run_on_ranks pool)."""
    import trident
    from trident.parameter_server import serve
    from trident.testing.distributed import cached_mesh

    torch.set_num_threads(1)
    sys.stdout = open(os.devnull, "w")  # keep trident's start-up tables out of the report
    cfg, servers = _config(system)
    mesh = cached_mesh()
    if dist.get_rank() < servers:
        r = serve(cfg, build_gpt(MODEL), mesh=mesh)
        return {"role": "server", "version": r.version}
    engine, _, _, _ = trident.initialize(model=build_gpt(MODEL), config=cfg, mesh=mesh)
    slow = engine.dp_rank == engine.dp_world_size - 1
    workers = engine.dp_world_size
    asynchronous = cfg.get("parameter_server", {}).get("mode") == "async"
    budget = (WARMUP + steps) * workers if asynchronous else WARMUP + steps
    batches = _batches(engine.dp_rank)
    done, t0, bytes0 = 0, 0.0, 0
    while (engine.server_version < budget) if asynchronous else (done < budget):
        if done == WARMUP:
            t0, bytes0 = time.time(), _bytes(engine, servers)
        batch = next(batches)
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
        done += 1
        if slow:
            time.sleep(slow_s)
    t1, bytes1 = time.time(), _bytes(engine, servers)
    if servers:
        engine.close()
    return {"role": "worker", "steps": max(0, done - WARMUP), "t0": t0, "t1": t1, "bytes": bytes1 - bytes0,
            "slow": slow}


def _bytes(engine, servers: int) -> int:
    if servers:
        traffic = engine.comm_bytes()
        return traffic["sent"] + traffic["received"]
    stats = engine.comms_logger.totals().get("all_reduce")
    return int(2 * stats.bus_bytes) if stats else 0  # ring: the bus bytes go out and come in


def summarize(results: list[dict]) -> dict:
    workers = [r for r in results if r["role"] == "worker" and r["steps"] > 0]
    elapsed = max(r["t1"] for r in workers) - min(r["t0"] for r in workers)
    total = sum(r["steps"] for r in workers)
    return {"steps_s": total / elapsed, "slowest": min(r["steps"] for r in workers),
            "fastest": max(r["steps"] for r in workers),
            "mb_per_step": sum(r["bytes"] for r in workers) / total / 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per worker (sync) or their total")
    args = parser.parse_args()
    from trident.testing.distributed import run_on_ranks, shutdown_pool

    slow_s = statistics.median(run_on_ranks(WORLD, calibrate))
    params = sum(p.numel() for p in build_gpt(MODEL).parameters())
    print(f"model: GPT {MODEL}, {params / 1e6:.2f}M parameters ({params * 4 / 1e6:.2f} MB fp32); micro-batch "
          f"{MICRO}; the slow worker sleeps {slow_s * 1e3:.1f} ms per step (its forward + backward)")
    rows: dict[str, list[dict]] = {s: [] for s in SYSTEMS}
    for repeat in range(args.repeats):
        for system in rotated(SYSTEMS, repeat):
            rows[system].append(summarize(run_on_ranks(WORLD, run_system, system, args.steps, slow_s,
                                                       timeout=600)))
    shutdown_pool()
    med = {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in rows.items()}
    base = med["allreduce dp=4"]["steps_s"]
    print(f"\n{'system':<18} {'worker steps/s':>14} {'vs dp':>6} {'vs own sync':>11} {'slowest':>7} "
          f"{'fastest':>7} {'MB/worker step':>14}")
    for s in SYSTEMS:
        m = med[s]
        sync = med[s.split(" ")[0] + " sync"]["steps_s"] if s.startswith("ps") else m["steps_s"]
        print(f"{s:<18} {m['steps_s']:>14.1f} {m['steps_s'] / base:>5.2f}x {m['steps_s'] / sync:>10.2f}x "
              f"{m['slowest']:>7.0f} {m['fastest']:>7.0f} {m['mb_per_step']:>14.2f}")


if __name__ == "__main__":
    main()
