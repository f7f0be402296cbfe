"""trident data parallelism vs PyTorch DDP, side by side: step time and peak RSS per rank.

Same model (the reference GPT), same global batch, same optimizer (AdamW), gloo on CPU, one
thread per rank. Every (system, repeat) runs in fresh processes so peak RSS is that run's own,
and the systems are interleaved repeat by repeat, in rotating order, so machine noise
hits them alike. Prints the
median step time and median peak RSS per rank of each system and the ratios to DDP.

Models: `demo` (the demo GPT, 4.24M parameters, micro batch 4 per rank) or `gpt-3.7m` (issue
24's shape: 4 layers, d_model 256, 4 heads, vocabulary 1024, untied embeddings, sequence 128,
global batch 16 split over the ranks).

    python bench/dp_vs_ddp.py [--model demo|gpt-3.7m] [--worlds 2 4] [--repeats 3] [--steps 12]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import (DEMO_GPT, GPT_3_7M, build_gpt, free_port, peak_rss_bytes, rotated, start_rank, timed_steps,
                     token_batches)

MODEL = DEMO_GPT
MICRO = 4
# --model: (shape, micro batch per rank at world w); gpt-3.7m keeps the global batch at 16
MODELS = {"demo": (DEMO_GPT, lambda world: MICRO), "gpt-3.7m": (GPT_3_7M, lambda world: max(1, 16 // world))}
WARMUP = 3
BUCKET_MB = 25  # DDP's default bucket_cap_mb; trident gets the same bucket size in elements


def _trident_step_fn(model, world: int, bucket_elements: int, micro: int = MICRO):
    import trident
    cfg = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": {"stage": 0, "reduce_bucket_size": bucket_elements}}
    engine, *_ = trident.initialize(model=model, config=cfg)

    def step(batch):
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
    return step


def _ddp_step_fn(model, world: int, bucket_view: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, bucket_cap_mb=BUCKET_MB, gradient_as_bucket_view=bucket_view)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4, foreach=True)

    def step(batch):
        loss = ddp(batch[:, :-1], batch[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def step_fn(system: str, model, world: int, micro: int = MICRO):
    """One training step of `system` ("trident", "ddp", "ddp-bucket-view") on a built model."""
    if system == "trident":
        return _trident_step_fn(model, world, BUCKET_MB * 2**20 // 4, micro)
    return _ddp_step_fn(model, world, bucket_view=system == "ddp-bucket-view")


def _worker(rank: int, world: int, port: int, system: str, steps: int, out, model_name: str = "demo") -> None:
    start_rank(rank, world, port)
    sys.stdout = open(os.devnull, "w")  # keep trident's start-up tables out of the report
    dist.init_process_group("gloo", rank=rank, world_size=world)
    shape, micro = MODELS[model_name][0], MODELS[model_name][1](world)
    step = step_fn(system, build_gpt(shape), world, micro)
    median, faults = timed_steps(step, token_batches(rank, shape, micro), WARMUP, steps)
    out.put((rank, median, peak_rss_bytes(), faults))
    dist.destroy_process_group()


def run_once(system: str, world: int, steps: int, model_name: str = "demo") -> tuple[float, float, float]:
    """One fresh multi-process run: the slowest rank's median step seconds, the largest peak
    RSS, and the most minor page faults per step of any rank."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, system, steps, out, model_name)) for r in range(world)]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise RuntimeError(f"{system} worker exited with {p.exitcode}")
    return max(r[1] for r in results), max(r[2] for r in results), max(r[3] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--model", choices=sorted(MODELS), default="demo",
                        help="demo: the demo GPT, micro batch 4 per rank; gpt-3.7m: issue 24's shape, global batch 16")
    args = parser.parse_args()
    systems = ["ddp", "ddp-bucket-view", "trident"]
    shape = MODELS[args.model][0]
    n_params = sum(p.numel() for p in build_gpt(shape).parameters())
    micro = ", ".join(f"{MODELS[args.model][1](w)} at world {w}" for w in args.worlds)
    print(f"GPT {shape} ({n_params / 1e6:.2f}M params), micro batch per rank {micro}, fp32, AdamW, gloo, "
          f"1 thread/rank, {args.steps} timed steps after {WARMUP} warm-up, {args.repeats} interleaved repeats")
    for world in args.worlds:
        samples: dict[str, list[tuple[float, float, float]]] = {s: [] for s in systems}
        for r in range(args.repeats):
            for system in rotated(systems, r):
                samples[system].append(run_once(system, world, args.steps, args.model))
        print(f"\nworld size {world}")
        print(f"{'system':<18}{'step ms (median)':>18}{'peak RSS/rank MiB':>20}{'faults/step':>13}"
              f"{'time / DDP':>12}{'RSS / DDP':>11}")
        base_t = statistics.median(x[0] for x in samples["ddp"])
        base_m = statistics.median(x[1] for x in samples["ddp"])
        for system in systems:
            t, m, f = (statistics.median(x[i] for x in samples[system]) for i in range(3))
            print(f"{system:<18}{t * 1000:>18.1f}{m / 2**20:>20.1f}{f:>13.0f}{t / base_t:>12.3f}{m / base_m:>11.3f}")


if __name__ == "__main__":
    main()
