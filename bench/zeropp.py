"""ZeRO-3 with and without ZeRO++: bytes per step (cross-node apart), step time, loss after 300 steps.

trident stage 3 in bf16 (the ZeRO++ paper's setting is 16-bit training) on 2 and 4 gloo ranks,
the same tiny GPT on the bundled corpus, the same batches, AdamW. ZeRO++ means
`zero_quantized_weights` + `zero_quantized_gradients` + `zero_hpz_partition_size`:

  4 ranks = 2 nodes of 2: hpZ 2 (backward gathers inside the node), qgZ's hops inside and across;
  2 ranks = 2 nodes of 1: no hpZ possible, so qwZ + qgZ only (the paper's "without hpZ" case).

Both runs set `stage3_max_reuse_distance: 0`, so backward gathers every layer again, as it does
on a model too large to keep gathered (on this tiny model the default keeps them, and there is
nothing for hpZ to save). Bytes are what one rank sends per step, from the flight recorder's
record of every collective (group, shape, dtype; `trident.compression.traffic`): cross-node =
bytes to ranks on another node. Step time is the median over the run; loss the mean of the last
30 steps. Timings on a shared 2-core CPU are noise; the byte counts are exact.

DeepSpeed's own ZeRO++ (bench venv) is tried on 2 ranks and the script prints what happens.

    python bench/zeropp.py [--worlds 2 4] [--steps 300]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from _common import run_ranks, start_rank

MODEL = dict(vocab_size=4096, seq_len=32, n_layer=2, n_head=2, d_model=64, dropout=0.0)
MICRO = 4
BENCH_PYTHON = Path(__file__).resolve().parent.parent / ".venv-bench" / "bin" / "python"


def node_size(world: int) -> int:
    return 2 if world >= 4 else 1


def zero_section(world: int, zeropp: bool) -> dict:
    zero = {"stage": 3, "stage3_max_reuse_distance": 0, "stage3_param_persistence_threshold": 1000,
            "reduce_bucket_size": 200_000, "stage3_prefetch_bucket_size": 200_000}
    if zeropp:
        zero.update(zero_quantized_weights=True, zero_quantized_gradients=True)
        if node_size(world) > 1:
            zero["zero_hpz_partition_size"] = node_size(world)
    return zero


def _worker(rank: int, port: int, world: int, zeropp: bool, steps: int, out) -> None:
    start_rank(rank, world, port)
    import trident
    from trident.comm import recorder as flight
    from trident.compression.traffic import traffic
    from trident.data import load_text_dataset
    from trident.models.gpt import GPT, GPTConfig

    train = load_text_dataset(MODEL["seq_len"], split="train")
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_clipping": 1.0, "steps_per_print": 0,
           "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}},
           "zero_optimization": zero_section(world, zeropp), "distributed": {"flight_recorder_size": 4096}}
    engine, *_ = trident.initialize(model=GPT(GPTConfig(**MODEL)), config=cfg)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    rows = []  # (bytes sent, cross-node bytes sent, seconds, loss) per step
    for step in range(steps):
        first = (step * world + rank) * MICRO
        x, y = zip(*(train[int(i)] for i in order[first:first + MICRO]))
        mark = flight.active.count
        start = time.perf_counter()
        engine.backward(engine(torch.stack(x), torch.stack(y)))
        engine.step()
        seconds = time.perf_counter() - start
        sent = traffic([r for r in flight.active.records() if r.index >= mark], rank, node_size(world))
        rows.append((sent.total, sent.cross, seconds, engine.last_loss))
    out.put((rank, rows))


def summarise(rows: list[tuple]) -> dict:
    steady = rows[1:]  # the first step records the gather order
    return {"bytes": statistics.median(r[0] for r in steady), "cross": statistics.median(r[1] for r in steady),
            "time": statistics.median(r[2] for r in steady), "loss": statistics.fmean(r[3] for r in rows[-30:])}


_DS_PROBE = r'''
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp

def run(rank, port, keys):
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    import deepspeed
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64))
    cfg = {"train_micro_batch_size_per_gpu": 4, "bf16": {"enabled": True},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
           "zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2, **keys}}
    try:
        deepspeed.init_distributed(dist_backend="gloo")
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        x = torch.randn(4, 64, dtype=torch.bfloat16)
        loss = engine(x).float().pow(2).mean()
        engine.backward(loss)
        engine.step()
        msg = f"ran one step, loss {loss.item():.4f}"
    except Exception as err:
        import traceback
        where = [f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in traceback.extract_tb(err.__traceback__)]
        msg = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''} (raised in {' <- '.join(where[-1:-4:-1])})"
    if rank == 0:
        print("DS_PROBE", deepspeed.__version__, "|", msg, flush=True)

if __name__ == "__main__":
    import socket
    s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
    keys = {"zero_quantized_weights": True, "zero_quantized_gradients": True} if sys.argv[1] == "all" else {}
    mp.spawn(run, args=(port, keys), nprocs=2)
'''


def deepspeed_zeropp_status(switches: str) -> str:
    """Try DeepSpeed's stage 3 with hpZ 2 and (`switches` "all") qwZ + qgZ on 2 CPU ranks, one
    step of a small MLP; say what happened. Tried twice: its first start builds a C++ op."""
    if not BENCH_PYTHON.exists():
        return f"not run: no bench venv at {BENCH_PYTHON}"
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp) / "ds_zeropp_probe.py"  # a file: spawned ranks re-import their main module
        script.write_text(_DS_PROBE)
        for _ in range(2):
            try:
                done = subprocess.run([str(BENCH_PYTHON), str(script), switches], capture_output=True, text=True,
                                      timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
            except subprocess.TimeoutExpired:
                return "not run: DeepSpeed's probe did not finish within 10 minutes"
            lines = [line for line in done.stdout.splitlines() if line.startswith("DS_PROBE")]
            if lines:
                return lines[0][len("DS_PROBE "):]
    return "probe failed: " + " / ".join(done.stderr.strip().splitlines()[-2:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4], help="ranks per run (4: 2 nodes of 2)")
    parser.add_argument("--steps", type=int, default=300, help="training steps per run")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"tiny GPT {MODEL}, bf16, micro batch {MICRO} per rank, {args.steps} steps, gloo on CPU")
    for world in args.worlds:
        results = {}
        for name, zeropp in (("stage 3", False), ("ZeRO++", True)):
            per_rank = dict(run_ranks(_worker, world, (world, zeropp, args.steps), f"{name} on {world} ranks"))
            results[name] = summarise(per_rank[0])
        base = results["stage 3"]
        nodes = f"{world // node_size(world)} nodes of {node_size(world)}"
        print(f"\n{world} ranks ({nodes})  bytes/step  cross-node  x stage 3  step ms  x stage 3  "
              f"loss@{args.steps}  x stage 3")
        for name, r in results.items():
            print(f"  {name:<20} {r['bytes']:>10.0f} {r['cross']:>11.0f} {r['cross'] / base['cross']:>10.3f} "
                  f"{r['time'] * 1e3:>8.2f} {r['time'] / base['time']:>10.3f} {r['loss']:>9.4f} "
                  f"{r['loss'] / base['loss']:>10.4f}")
    print(f"\nDeepSpeed's ZeRO++ (stage 3 + qwZ + qgZ + hpZ 2, 2 CPU ranks): {deepspeed_zeropp_status('all')}")
    print(f"DeepSpeed's hpZ alone (stage 3 + hpZ 2, 2 CPU ranks): {deepspeed_zeropp_status('hpz')}")
    print("-> DeepSpeed's qwZ and qgZ quantize with a CUDA kernel (QuantizerBuilder; CUDAQuantizer at "
          "zero.Init), which has no CPU build, so its ZeRO++ cannot run on this CPU-only machine and no DeepSpeed "
          "row is given (its hpZ alone starts, but is not the configuration compared here).")


if __name__ == "__main__":
    main()
