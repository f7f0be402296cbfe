"""A user's script for the elastic-restart tests: periodic checkpoints with auto_resume.

Each rank appends "attempt step loss" lines to OUT/losses_rank<R>.txt. On the first attempt
(TORCHELASTIC_RESTART_COUNT = 0) it can die on purpose:
  --kill-rank R --kill-step S      rank R sends itself SIGKILL before step S
  --kill-in-save S                 rank 0 sends itself SIGKILL while writing the checkpoint of
                                   step S, after the files are in the partial folder and before
                                   the folder is renamed and `latest` is replaced
Every attempt's rank 0 first prints what `latest` names and which partial folders exist.
"""

import argparse
import os
import signal
from pathlib import Path

import torch

import trident
from trident.models.toy import TinyMLP, make_regression_data

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt", required=True)
parser.add_argument("--out", required=True)
parser.add_argument("--steps", type=int, default=8)
parser.add_argument("--kill-rank", type=int, default=-1)
parser.add_argument("--kill-step", type=int, default=-1)
parser.add_argument("--kill-in-save", type=int, default=-1)
args = parser.parse_args()

attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
rank = int(os.environ["RANK"])
ckpt = Path(args.ckpt)
if rank == 0:
    latest = (ckpt / "latest").read_text() if (ckpt / "latest").exists() else None
    partial = sorted(p.name for p in ckpt.glob(".*.partial")) if ckpt.exists() else []
    print(f"START attempt={attempt} latest={latest} partial={','.join(partial) or None}", flush=True)

if attempt == 0 and rank == 0 and args.kill_in_save > 0:
    import trident.checkpointing.state as state

    write_manifest = state._write_manifest

    def dying_write_manifest(engine, *rest):
        if engine.global_steps == args.kill_in_save:
            os.kill(os.getpid(), signal.SIGKILL)
        write_manifest(engine, *rest)

    state._write_manifest = dying_write_manifest

torch.manual_seed(0)
x, y = make_regression_data(32)
config = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0, "seed": 3,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.01}},
          "checkpoint": {"path": str(ckpt), "save_interval": 2, "keep_last": 2, "auto_resume": True},
          "distributed": {"timeout_s": 20}}
engine, _, loader, _ = trident.initialize(model=TinyMLP(), config=config,
                                          training_data=torch.utils.data.TensorDataset(x, y))
print(f"RESUMED rank={rank} attempt={attempt} step={engine.global_steps}", flush=True)


def batches():
    epoch = loader.sampler.epoch
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


stream = batches()
with open(Path(args.out) / f"losses_rank{rank}.txt", "a") as log:
    for step in range(engine.global_steps, args.steps):
        if attempt == 0 and rank == args.kill_rank and step == args.kill_step:
            log.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        xb, yb = next(stream)
        engine.backward(engine(xb, yb))
        engine.step()
        log.write(f"{attempt} {engine.global_steps} {engine.last_loss!r}\n")
        log.flush()
print(f"RESULT rank={rank} attempt={attempt} steps={engine.global_steps} END", flush=True)
