"""A user's training script that goes wrong on purpose, for the hang-detector and failure tests.

--mode skip:   at --step, rank --rank never reaches the step's all-reduce (it is stuck in its
               data loading instead); the others wait in it.
--mode dtype:  at --step, rank --rank all-reduces int32 where the others all-reduce float32
               (gloo does not notice: the job runs on with garbage); strict mode must.
--mode raise:  at --step, rank --rank raises while the others wait in the step's all-reduce;
               with --linger it keeps a non-daemon thread alive, so its process does not exit.
--mode ok:     nothing goes wrong.
"""

import argparse
import threading
import time

import torch

import trident
from trident.comm import collectives
from trident.models.toy import TinyMLP

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["skip", "dtype", "raise", "ok"], default="ok")
parser.add_argument("--rank", type=int, default=1)
parser.add_argument("--step", type=int, default=2)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--timeout", type=float, default=1800.0)
parser.add_argument("--strict", action="store_true")
parser.add_argument("--linger", action="store_true")
args = parser.parse_args()


def load_next_batch(step: int, rank: int):
    if args.mode == "skip" and step == args.step and rank == args.rank:
        time.sleep(600)  # a data loader that never returns
    g = torch.Generator().manual_seed(step * 10 + rank)
    return torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)


torch.manual_seed(0)
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "distributed": {"timeout_s": args.timeout, "strict_collectives": args.strict}}
engine, *_ = trident.initialize(model=TinyMLP(), config=config)
rank = engine.global_rank
for step in range(args.steps):
    if step == args.step and rank == 0:
        print(f"ENTERING step {step} at {time.time():.3f}", flush=True)
    x, y = load_next_batch(step, rank)
    engine.backward(engine(x, y))
    engine.step()
    if args.mode == "raise" and step == args.step and rank == args.rank:
        if args.linger:
            threading.Thread(target=time.sleep, args=(600,), daemon=False).start()
        raise RuntimeError(f"injected failure on rank {rank}")
    stats = torch.ones(16)
    if args.mode == "dtype" and step == args.step and rank == args.rank:
        stats = torch.ones(16, dtype=torch.int32)
    collectives.all_reduce(stats, group=engine.mesh.dp_group)
    if args.mode == "dtype":
        for _ in range(40):  # enough calls for strict mode's periodic comparison
            collectives.all_reduce(torch.ones(4), group=engine.mesh.dp_group)
        time.sleep(0.3)
print(f"RESULT rank={rank} steps={engine.global_steps} END", flush=True)
