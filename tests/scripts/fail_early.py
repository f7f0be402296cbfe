"""Fails before trident.initialize (so before trident's failure hook): `--mode both` raises the same
error on every rank; `--mode one` raises on rank 1 after a moment while the others wait in a
barrier (and are then stopped by torchrun's agent)."""

import argparse
import os
import time

import torch.distributed as dist

parser = argparse.ArgumentParser()
parser.add_argument("--mode", choices=["both", "one"], required=True)
args = parser.parse_args()
rank = int(os.environ.get("RANK", 0))
if args.mode == "both":
    raise ValueError("bad value in the script's own set-up")
dist.init_process_group("gloo")
if rank == 1:
    time.sleep(1.0)
    raise KeyError("missing key on rank 1")
dist.barrier()
