"""A user's script for the hostfile-launch tests (tests/distributed/test_launch_hosts.py).

Trains TinyMLP with SGD + momentum on data parallel ranks: step S's global batch is
`global_batch(S, world)`, rank r takes rows 4r..4r+3. Each rank writes `pid_rank<R>` (its pid)
into --out, prints `STEP rank=R step=S loss=L` after every step and, at the end, rank 0 saves
the weights to --out/weights.pt. --sleep slows the steps down so that a test can kill a rank
in the middle of the run.
"""

import argparse
import os
import time
from pathlib import Path

import torch

import trident
from trident.models.toy import TinyMLP
from trident.testing.parity import optimizer_section

MICRO = 4
LR = 0.1


def global_batch(step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(MICRO * world, 16, generator=g), torch.randn(MICRO * world, 16, generator=g)


def make_model() -> TinyMLP:
    torch.manual_seed(0)
    return TinyMLP()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sleep", type=float, default=0.0)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args()

    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
              "optimizer": optimizer_section("sgd", LR), "distributed": {"timeout_s": args.timeout}}
    engine, *_ = trident.initialize(model=make_model(), config=config)
    rank, world = engine.dp_rank, engine.dp_world_size
    out = Path(args.out)
    (out / f"pid_rank{engine.global_rank}").write_text(str(os.getpid()))
    for step in range(args.steps):
        x, y = global_batch(step, world)
        loss = engine(x[MICRO * rank:MICRO * (rank + 1)], y[MICRO * rank:MICRO * (rank + 1)])
        engine.backward(loss)
        engine.step()
        print(f"STEP rank={engine.global_rank} step={step} loss={loss.item()!r}", flush=True)
        time.sleep(args.sleep)
    if engine.global_rank == 0:
        torch.save({k: v.detach().clone() for k, v in engine.module.state_dict().items()}, out / "weights.pt")
    print(f"RESULT rank={engine.global_rank} world={engine.world_size} steps={engine.global_steps} END", flush=True)
