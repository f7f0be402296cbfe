"""torch.compile per block vs eager: the demo GPT's training step time on CPU (inductor).

The engine is trident/configs/demo.json's (micro batch 8, AdamW, clipping 1.0, its LR schedule)
on the demo GPT (4.24M parameters), with `compile: {enabled: true}` or without. Every (system,
repeat) runs in fresh processes (one per rank, one thread each), the systems interleaved repeat
by repeat in rotating order; the warm-up steps include the compilation (inductor's FX graph
cache on disk makes every run after the first reuse its kernels). Prints the median step time
of each system, the ratio (target: compiled >= 1.2x eager's speed), the graph breaks per block, and
the most compiling could give here (`gemm_bound`: 1 / the share of an eager step in GEMMs), and
what compiling the whole plain model gives (`whole_model_speedup`).

    python bench/compile_vs_eager.py [--repeats 5] [--steps 10] [--world 1]

bench/suite.py (or any script) can call `run(system, steps)` for one fresh run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from importlib import resources

import torch
import torch.distributed as dist

from _common import DEMO_GPT, build_gpt, rotated, run_ranks, start_rank, timed_steps, token_batches

SYSTEMS = ("eager", "compiled")
WARMUP = 3  # the first step compiles; two more settle the allocator


def demo_config(system: str) -> dict:
    """demo.json's engine sections (the `trident train` ones dropped), compiled or not."""
    data = json.loads(resources.files("trident.configs").joinpath("demo.json").read_text())
    config = {k: v for k, v in data.items() if k not in ("model", "data", "trainer")}
    return {**config, "compile": {"enabled": system == "compiled", "backend": "inductor"}}


def _worker(rank: int, port: int, system: str, world: int, warmup: int, steps: int, out) -> None:
    start_rank(rank, world, port)
    sys.stdout = open(os.devnull, "w")  # keep trident's start-up tables out of the report
    import trident

    dist.init_process_group("gloo", rank=rank, world_size=world)
    config = demo_config(system)
    engine, *_ = trident.initialize(model=build_gpt(DEMO_GPT), config=config)

    def step(batch: torch.Tensor) -> None:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()

    started = time.perf_counter()
    first = next(token_batches(rank, DEMO_GPT, config["train_micro_batch_size_per_gpu"]))
    step(first)  # eager: one plain step; compiled: the compilation
    first_s = time.perf_counter() - started
    median, _ = timed_steps(step, token_batches(rank, DEMO_GPT, config["train_micro_batch_size_per_gpu"]),
                            warmup, steps)
    report = engine.compile_report
    out.put({"rank": rank, "step_s": median, "first_step_s": first_s,
             "graph_breaks": report.graph_breaks() if report is not None else None})
    dist.destroy_process_group()


def run(system: str, steps: int = 10, warmup: int = WARMUP, world: int = 1) -> dict:
    """One fresh run of `system` ("eager" or "compiled") on `world` ranks: {"system", "step_s"
    (the slowest rank's median seconds per step), "first_step_s" (compilation included),
    "graph_breaks" (block name -> breaks, compiled only)}."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {SYSTEMS}, got {system!r}")
    results = run_ranks(_worker, world, (system, world, warmup, steps), f"compile_vs_eager {system}")
    slowest = max(results, key=lambda r: r["step_s"])
    return {"system": system, "step_s": slowest["step_s"], "first_step_s": max(r["first_step_s"] for r in results),
            "graph_breaks": slowest["graph_breaks"]}


GEMM_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def gemm_bound(steps: int = 3) -> dict:
    """What compiling can gain at most on this CPU: the share of an eager step (demo GPT, demo.json's
    micro-batch, one thread, AdamW, clipping) spent in GEMMs, by torch.profiler's self time, and
    1 / that share -- the speed-up if compiling made everything else free. Inductor calls the
    same oneDNN / MKL kernels for a training step's matrix multiplies as eager does, so it can
    shorten only the rest; the GEMMs' own rate is printed beside the share."""
    from torch.profiler import profile

    torch.set_num_threads(1)
    micro = json.loads(resources.files("trident.configs").joinpath("demo.json").read_text())["train_micro_batch_size_per_gpu"]
    model = build_gpt(DEMO_GPT)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    batch = next(token_batches(0, DEMO_GPT, micro))

    def step() -> None:
        out = model(batch[:, :-1], batch[:, 1:])
        (out if torch.is_tensor(out) else out[0]).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    with profile(record_shapes=True) as prof:
        for _ in range(steps):
            step()
    events = prof.key_averages(group_by_input_shape=True)
    total = sum(e.self_cpu_time_total for e in events)
    gemm = [e for e in events if e.key in GEMM_OPS]
    gemm_us = sum(e.self_cpu_time_total for e in gemm)
    flops = 0.0
    for e in gemm:  # mm [m, k] x [k, n]; addmm (bias, [m, k], [k, n]); bmm [b, m, k] x [b, k, n]
        shapes = [sh for sh in e.input_shapes if sh]
        if e.key in ("aten::addmm", "aten::baddbmm"):
            shapes = shapes[1:]
        a, b = shapes[0], shapes[1]
        flops += e.count * 2.0 * math.prod(a) * b[-1]
    share = gemm_us / total
    return {"gemm_share": share, "bound": 1.0 / share, "gemm_gflops": flops / (gemm_us * 1e-6) / 1e9}


def whole_model_speedup(repeats: int = 5, steps: int = 4) -> dict:
    """Eager against `torch.compile` of the whole plain model (not trident's per-block compile):
    how much more compiling the embedding, head and loss too could give. One process, one
    thread, two models with the same initial weights, AdamW and clipping; the systems'
    timed blocks of `steps` steps interleave, `repeats` times, in rotating order; medians."""
    torch.set_num_threads(1)
    micro = json.loads(resources.files("trident.configs").joinpath("demo.json").read_text())["train_micro_batch_size_per_gpu"]
    batch = next(token_batches(0, DEMO_GPT, micro))

    def system(compiled: bool):
        model = build_gpt(DEMO_GPT)
        forward = torch.compile(model) if compiled else model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)

        def step() -> None:
            out = forward(batch[:, :-1], batch[:, 1:])
            (out if torch.is_tensor(out) else out[0]).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        for _ in range(2):  # compiles
            step()
        return step

    steps_of = {"eager": system(False), "whole model compiled": system(True)}
    times: dict[str, list[float]] = {name: [] for name in steps_of}
    for repeat in range(repeats):
        for name in rotated(list(steps_of), repeat):
            started = time.perf_counter()
            for _ in range(steps):
                steps_of[name]()
            times[name].append((time.perf_counter() - started) / steps)
    eager, whole = (statistics.median(times[n]) for n in steps_of)
    return {"eager_s": eager, "whole_model_s": whole, "speedup": eager / whole}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--world", type=int, default=1, help="ranks (data parallel), one thread each")
    args = parser.parse_args(argv)
    times: dict[str, list[float]] = {s: [] for s in SYSTEMS}
    breaks = None
    for repeat in range(args.repeats):
        for system in rotated(SYSTEMS, repeat):
            result = run(system, args.steps, world=args.world)
            times[system].append(result["step_s"])
            breaks = result["graph_breaks"] if system == "compiled" else breaks
            print(f"repeat {repeat}: {system:8s} {result['step_s'] * 1e3:8.1f} ms/step "
                  f"(first step {result['first_step_s']:.1f} s)", flush=True)
    eager, compiled = (statistics.median(times[s]) for s in SYSTEMS)
    print(f"\ndemo GPT, world {args.world}, {args.repeats} repeats x {args.steps} steps (medians):")
    print(f"  eager    {eager * 1e3:8.1f} ms/step")
    print(f"  compiled {compiled * 1e3:8.1f} ms/step   speed-up {eager / compiled:.2f}x (target >= 1.2x)")
    print(f"  graph breaks per block: {breaks}")
    bound = gemm_bound()
    print(f"  GEMMs are {bound['gemm_share']:.0%} of an eager step ({bound['gemm_gflops']:.0f} GFLOP/s on one thread): "
          f"compiling the rest away entirely would give at most {bound['bound']:.2f}x")
    whole = whole_model_speedup()
    print(f"  torch.compile of the whole plain model, one process, interleaved: {whole['eager_s'] * 1e3:.1f} ms eager, "
          f"{whole['whole_model_s'] * 1e3:.1f} ms compiled, {whole['speedup']:.2f}x")


if __name__ == "__main__":
    main()
