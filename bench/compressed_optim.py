"""1-bit optimizers vs Adam: bytes on the wire per step, step time and the loss after 300 steps.

trident's Adam (stage 0, fp32 gradient all-reduce), OneBitAdam, ZeroOneAdam and OneBitLamb on 2
and 4 gloo ranks, the same tiny GPT on the bundled corpus, the same global batches of 8 sequences
on either. (`--global-batch 16` runs 4 ranks at micro-batch 4, twice the 2-rank run's batch:
there OneBitAdam and ZeroOneAdam end 4.4-4.9% above Adam, of which 2.8% is the algorithm itself,
uncompressed: DeepSpeed's 1-bit optimizers have no bias correction.) For each: the
median bus bytes per rank per step (comms logger; nccl-tests' convention, so an all-reduce
counts 2(n-1)/n of its size) in the warm-up and in the compressed phase, the median step time
of each phase, and the mean training loss of the last 30 of 300 steps. Ratios are to Adam.
Compression starts at step 150 (OneBitAdam), 75 (OneBitLamb) or after the variance schedule
(ZeroOneAdam: variance every step to 64, then sparser; local steps from 200).

DeepSpeed's own 1-bit Adam is run beside them when the interpreter it lives in (the bench venv)
still ships it; otherwise the script prints why not.

    python bench/compressed_optim.py [--worlds 2 4] [--steps 300] [--global-batch 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from _common import run_ranks, start_rank

MODEL = dict(vocab_size=4096, seq_len=32, n_layer=1, n_head=2, d_model=32, dropout=0.0)
GLOBAL_BATCH = 8
"""Sequences per step on every world size (micro-batch = GLOBAL_BATCH / ranks): the same batches
whatever the ranks, so only the span of the compression changes between 2 and 4 ranks."""
OPTIMIZERS = {
    "Adam": {"lr": 3e-3},
    "OneBitAdam": {"lr": 3e-3, "freeze_step": 150},
    "ZeroOneAdam": {"lr": 3e-3, "var_freeze_step": 200, "var_update_scaler": 64, "local_step_scaler": 50,
                    "local_step_clipper": 2},
    "OneBitLamb": {"lr": 0.02, "freeze_step": 75},
}
COMPRESSED_FROM = {"Adam": None, "OneBitAdam": 150, "ZeroOneAdam": 64, "OneBitLamb": 75}
BENCH_PYTHON = Path(__file__).resolve().parent.parent / ".venv-bench" / "bin" / "python"


def _worker(rank: int, port: int, world: int, kind: str, steps: int, micro: int, out) -> None:
    start_rank(rank, world, port)
    import trident
    from trident.data import load_text_dataset
    from trident.models.gpt import GPT, GPTConfig

    train = load_text_dataset(MODEL["seq_len"], split="train")
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_clipping": 1.0, "steps_per_print": 0,
           "optimizer": {"type": kind, "params": OPTIMIZERS[kind]}, "comms_logger": {"enabled": True}}
    engine, *_ = trident.initialize(model=GPT(GPTConfig(**MODEL)), config=cfg)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    rows = []  # (bus bytes, seconds, loss) per step
    for step in range(steps):
        first = (step * world + rank) * micro
        x, y = zip(*(train[int(i)] for i in order[first:first + micro]))
        before = sum(s.bus_bytes for s in engine.comms_logger.totals().values())
        start = time.perf_counter()
        engine.backward(engine(torch.stack(x), torch.stack(y)))
        engine.step()
        seconds = time.perf_counter() - start
        rows.append((sum(s.bus_bytes for s in engine.comms_logger.totals().values()) - before, seconds,
                     engine.last_loss))
    out.put((rank, rows))


def summarise(kind: str, rows: list[tuple[float, float, float]]) -> dict:
    split = COMPRESSED_FROM[kind]
    warm, late = (rows, rows) if split is None else (rows[:split], rows[split:])
    return {"warm_bytes": statistics.median(r[0] for r in warm), "bytes": statistics.median(r[0] for r in late),
            "mean_bytes": statistics.fmean(r[0] for r in late),
            "warm_time": statistics.median(r[1] for r in warm), "time": statistics.median(r[1] for r in late),
            "loss": statistics.fmean(r[2] for r in rows[-30:])}


def deepspeed_onebit_status() -> str:
    """Why DeepSpeed's own 1-bit Adam can or cannot run beside trident here."""
    probe = ("import deepspeed, sys\n"
             "from deepspeed.runtime import config\n"
             "print('DeepSpeed', deepspeed.__version__, '| optimizers it knows:', config.DEEPSPEED_OPTIMIZERS)\n"
             "try:\n"
             "    from deepspeed.runtime.fp16.onebit.adam import OnebitAdam\n"
             "    print('OnebitAdam importable')\n"
             "except Exception as err:\n"
             "    print(f'{type(err).__name__}: {err}')\n")
    python = str(BENCH_PYTHON) if BENCH_PYTHON.exists() else sys.executable
    done = subprocess.run([python, "-c", probe], capture_output=True, text=True, timeout=300)
    lines = ([line for line in done.stdout.splitlines() if line.strip() and not line.startswith("[")]
             or done.stderr.strip().splitlines()[-1:])
    return " / ".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--global-batch", type=int, default=GLOBAL_BATCH,
                        help="sequences per step, split over the ranks (16 on 4 ranks: micro-batch 4)")
    args = parser.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"tiny GPT {MODEL}, global batch {args.global_batch}, {args.steps} steps, gloo on CPU")
    for world in args.worlds:
        results = {}
        micro = args.global_batch // world
        if micro * world != args.global_batch:
            raise SystemExit(f"--global-batch {args.global_batch} does not split over {world} ranks")
        for kind in OPTIMIZERS:
            per_rank = dict(run_ranks(_worker, world, (world, kind, args.steps, micro), f"{kind} on {world} ranks"))
            results[kind] = summarise(kind, per_rank[0])
        adam = results["Adam"]
        print(f"\n{world} ranks x micro {micro}  bytes/step  (warm-up)  x Adam   step ms (warm-up)  x Adam   loss@{args.steps}"
              "  x Adam")
        for kind, r in results.items():
            print(f"  {kind:<12} {r['bytes']:>10.0f} {r['warm_bytes']:>10.0f} {r['bytes'] / adam['bytes']:>7.4f}  "
                  f"{r['time'] * 1e3:>7.2f} {r['warm_time'] * 1e3:>8.2f}  {r['time'] / adam['time']:>7.3f}  "
                  f"{r['loss']:>8.4f} {r['loss'] / adam['loss']:>7.4f}")
        z = results["ZeroOneAdam"]
        print(f"  (ZeroOneAdam's mean bytes per compressed-phase step, local steps included: {z['mean_bytes']:.0f}, "
              f"x Adam {z['mean_bytes'] / adam['bytes']:.4f})")
    print(f"\nDeepSpeed's 1-bit Adam: {deepspeed_onebit_status()}")
    print("-> not run: DeepSpeed removed its 1-bit optimizers (deepspeed.runtime.fp16.onebit) before this "
          "version, and its compressed backends were NCCL / MPI / HCCL only (no gloo), so there is nothing "
          "to compare on this CPU-only machine.")


if __name__ == "__main__":
    main()
