"""ZeRO-Infinity on one rank: a model whose model states (16 Phi bytes) are at least 3x the memory
the rank may use still trains with optimizer states and parameters paged to NVMe.

Each mode runs in a fresh process (1 gloo rank, ZeRO stage 3, bf16, AdamW). After the imports
and the model's construction (in bf16) the process's address space is capped with
`resource.setrlimit(RLIMIT_AS)` at its current size plus a budget of 16 Phi / `--ratio` bytes
(MALLOC_ARENA_MAX=1 and a 64 KiB mmap threshold keep glibc's reservations and fragmentation
from eating it). Modes:
- no offload: the whole model states must fit; expected to fail with an allocation error;
- nvme, prefetch on: offload_optimizer + offload_param on NVMe, sub-groups read ahead and
  written behind (pipeline_read/pipeline_write), parameter shards read ahead along the trace;
- nvme, prefetch off: the same, every read on demand and every write waited for.
Per mode: steps/s over the timed steps and the fraction of step time the training thread was
blocked on swap I/O.

    python bench/nvme_offload.py [--dir DIR] [--layers 8] [--d-model 768] [--steps 3] [--ratio 3]
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import sys
import tempfile
import time

import torch.multiprocessing as mp

from _common import free_port, start_rank

MODES = ("no offload", "nvme, prefetch on", "nvme, prefetch off")


def _config(mode: str, path: str) -> dict:
    zero = {"stage": 3, "sub_group_size": 500_000, "reduce_bucket_size": 1_000_000,
            "stage3_max_reuse_distance": 0, "stage3_max_live_parameters": 4_000_000,
            "stage3_prefetch_bucket_size": 2_000_000}
    if mode != "no offload":
        on = mode == "nvme, prefetch on"
        zero["offload_optimizer"] = {"device": "nvme", "nvme_path": path, "pipeline_read": on,
                                     "pipeline_write": on, "buffer_count": 4}
        zero["offload_param"] = {"device": "nvme", "nvme_path": path, "buffer_count": 3}
        if not on:
            zero["stage3_prefetch_bucket_size"] = 0
    return {"train_micro_batch_size_per_gpu": 1, "steps_per_print": 0, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "host_allocator": {"enabled": False},
            "zero_optimization": zero}


def _address_space() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))


def _worker(mode: str, port: int, path: str, layers: int, d_model: int, steps: int, ratio: float, out) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 1 << 16)  # M_MMAP_THRESHOLD: large blocks are unmapped on free
    libc.mallopt(-1, 1 << 16)  # M_TRIM_THRESHOLD
    start_rank(0, 1, port)
    sys.stdout = open(os.devnull, "w")
    import torch
    import trident
    from trident.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)
    model = GPT(GPTConfig(vocab_size=512, seq_len=32, n_layer=layers, n_head=8, d_model=d_model, dropout=0.0,
                          bias=False))
    torch.set_default_dtype(torch.float32)
    phi = sum(p.numel() for p in model.parameters())
    budget = int(16 * phi / ratio)
    resource.setrlimit(resource.RLIMIT_AS, (_address_space() + budget, resource.RLIM_INFINITY))
    result = {"mode": mode, "phi": phi, "budget": budget}
    phase = "initialize"
    try:
        engine, *_ = trident.initialize(model=model, config=_config(mode, path))
        data = torch.randint(0, 512, (1, 33), generator=torch.Generator().manual_seed(0))
        times, waits = [], []
        for step in range(steps + 1):
            phase = f"step {step + 1}"
            before = _io_wait(engine.reducer)
            t = time.perf_counter()
            engine.backward(engine(data[:, :-1], data[:, 1:]))
            engine.step()
            if step > 0:  # the first step records the trace and creates the optimizer states
                times.append(time.perf_counter() - t)
                waits.append(_io_wait(engine.reducer) - before)
        result.update(ok=True, steps_per_s=len(times) / sum(times), io_fraction=sum(waits) / sum(times),
                      placed=engine.reducer.placement_bytes(), loss=engine.last_loss)
        engine.reducer.close()
    except (MemoryError, RuntimeError) as e:  # torch reports a refused allocation as RuntimeError
        refused = "out of memory" if "can't allocate memory" in str(e) else str(e).splitlines()[0][:80]
        result.update(ok=False, error=f"{type(e).__name__} ({refused}) in {phase}")
    out.put(result)


def _io_wait(reducer) -> float:
    wait = getattr(reducer.placement, "io_wait", 0.0)
    if reducer.param_store is not None:
        wait += reducer.param_store.io.wait_seconds
    return wait


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="nvme_path (default: a fresh temporary directory)")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--ratio", type=float, default=3.0, help="model states (16 Phi) / memory budget")
    args = parser.parse_args()
    os.environ.update(MALLOC_ARENA_MAX="1", OMP_NUM_THREADS="1")
    path = args.dir or tempfile.mkdtemp(prefix="trident-nvme-bench-")
    ctx = mp.get_context("spawn")
    rows = []
    for mode in MODES:
        out = ctx.Queue()
        proc = ctx.Process(target=_worker, args=(mode, free_port(), path, args.layers, args.d_model, args.steps,
                                                  args.ratio, out))
        proc.start()
        proc.join()
        rows.append(out.get() if not out.empty() else {"mode": mode, "ok": False,
                                                       "error": f"killed (exit code {proc.exitcode})"})
    phi, budget = rows[0].get("phi", 0), rows[0].get("budget", 0)
    print(f"model: {phi / 1e6:.1f}M parameters, model states 16 Phi = {16 * phi / 2**20:.0f} MiB; "
          f"memory budget per rank {budget / 2**20:.0f} MiB (RLIMIT_AS above the size after imports and model construction)")
    print("| mode | result | steps/s | I/O wait / step | on NVMe | host buffers |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        if r["ok"]:
            p = r["placed"]
            print(f"| {r['mode']} | trains (loss {r['loss']:.3f}) | {r['steps_per_s']:.2f} | "
                  f"{100 * r['io_fraction']:.0f}% | {p['nvme'] / 2**20:.0f} MiB | {p['host'] / 2**20:.0f} MiB |")
        else:
            print(f"| {r['mode']} | fails: {r['error']} | | | | |")


if __name__ == "__main__":
    main()
