"""How long a checkpoint save and load take per GB, trident against plain torch.save and torch's
distributed checkpoint (DCP), side by side.

Two gloo ranks train the reference GPT with ZeRO-1 for a few steps (so the optimizer state
exists), then, in rotating order per repeat:
- trident save:   `engine.save_checkpoint` (model file, every rank's partition, manifest with
                  sha256 of every file, atomic rename)
- trident load:   `engine.load_checkpoint` under the same layout (every file verified)
- trident reshard-load: the same checkpoint loaded by an engine with another partitioning
                  (ZeRO-2, other bucket sizes): whole tensors rebuilt and re-cut
- torch.save / torch.load: the same per-rank tensors (model state dict + this rank's ZeRO
                  partition) with no manifest, no checksum, no atomic rename: the I/O floor
- DCP save / load: torch.distributed.checkpoint of the same tensors (keys made rank-unique)
Each figure is the median over repeats of the slowest rank's wall time, divided by the
checkpoint's bytes on disk. Files go to --dir (default: the system's temp folder), so the page
cache takes the writes: these are memory-speed figures for this machine, not a disk's.

    python bench/checkpoint_io.py [--params 50] [--repeats 3] [--dir DIR]
"""

from __future__ import annotations

import argparse
import os
import queue
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from _common import free_port, start_rank, token_batches

SYSTEMS = ["trident", "torch.save", "dcp"]


def _model_dims(millions: int) -> dict:
    d = 512
    layers = max(1, round(millions * 1e6 / (12 * d * d)))
    return dict(vocab_size=8192, seq_len=64, n_layer=layers, n_head=8, d_model=d, dropout=0.0)


def _engine(model: dict, stage: int, bucket: int):
    import trident
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
              "zero_optimization": {"stage": stage, "reduce_bucket_size": bucket}}
    engine, *_ = trident.initialize(model=GPT(GPTConfig(**model)), config=config)
    return engine


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def _bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _rank_main(rank: int, world: int, port: int, args, out: mp.Queue) -> None:
    start_rank(rank, world, port)
    model = _model_dims(args.params)
    engine = _engine(model, 1, 50_000_000)
    batches = token_batches(rank, model, 2)
    for _ in range(2):
        batch = next(batches)
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    other = _engine(model, 2, 20_000_000)  # another partitioning: loads go through resharding
    root = Path(args.dir)
    results: dict[str, list[float]] = {}
    sizes: dict[str, int] = {}
    numel = sum(p.numel() for p in engine.module.parameters())
    for repeat in range(args.repeats):
        for k in range(len(SYSTEMS)):
            system = SYSTEMS[(k + repeat) % len(SYSTEMS)]
            folder = root / f"{system}-{repeat}"
            if system == "trident":
                results.setdefault("trident save", []).append(_timed(lambda: engine.save_checkpoint(str(folder))))
                results.setdefault("trident load", []).append(_timed(lambda: engine.load_checkpoint(str(folder))))
                results.setdefault("trident reshard-load", []).append(
                    _timed(lambda: other.load_checkpoint(str(folder))))
            else:
                state = {**{f"model.{k}": v for k, v in engine.module.state_dict().items()},
                         **{f"rank{rank}.{k}": v for k, v in _flat_partition(engine).items()}}
                if system == "torch.save":
                    path = folder / f"rank{rank}.pt"
                    if rank == 0:
                        folder.mkdir(parents=True)
                    dist.barrier()
                    results.setdefault("torch.save", []).append(_timed(lambda: torch.save(state, path)))
                    results.setdefault("torch.load", []).append(_timed(lambda: torch.load(path)))
                else:
                    import torch.distributed.checkpoint as dcp
                    results.setdefault("DCP save", []).append(_timed(lambda: dcp.save(state, checkpoint_id=str(folder))))
                    results.setdefault("DCP load", []).append(_timed(lambda: dcp.load(state, checkpoint_id=str(folder))))
            dist.barrier()
            if rank == 0:
                sizes[system] = _bytes(folder)
                shutil.rmtree(folder)
            dist.barrier()
    if rank == 0:
        out.put((numel, sizes, {k: statistics.median(v) for k, v in results.items()}))
    dist.destroy_process_group()


def _flat_partition(engine) -> dict[str, torch.Tensor]:
    part = engine.reducer.state_dict()
    flat = {}
    for g, group in enumerate(part["groups"]):
        for k, m in enumerate(group["masters"]):
            flat[f"g{g}.master{k}"] = m
    for index, state in part["optimizer"]["state"].items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                flat[f"opt{index}.{key}"] = value
    return flat


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=50, help="model size in millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where checkpoints are written (default: a temp folder)")
    args = parser.parse_args()
    args.dir = tempfile.mkdtemp(prefix="trident-ckpt-bench-", dir=args.dir)
    world, port = 2, free_port()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, args, out)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        numel, sizes, medians = out.get(timeout=3600)
    except queue.Empty:
        print("benchmark ranks did not report", file=sys.stderr)
        return 1
    finally:
        for p in procs:
            p.join(timeout=60)
        shutil.rmtree(args.dir, ignore_errors=True)
    gib = 1024 ** 3
    print(f"GPT {numel / 1e6:.1f}M parameters, fp32, ZeRO-1 over 2 ranks; checkpoint bytes on disk: "
          + ", ".join(f"{k} {v / gib:.2f} GiB" for k, v in sizes.items()))
    size_of = {"trident": sizes["trident"], "torch": sizes["torch.save"], "DCP": sizes["dcp"]}
    print("\n| operation | seconds | s per GiB | GiB/s | s per GiB vs torch.save / torch.load |\n"
          "| --- | ---: | ---: | ---: | ---: |")
    floor = {"save": medians["torch.save"] / (size_of["torch"] / gib),
             "load": medians["torch.load"] / (size_of["torch"] / gib)}
    for name, seconds in medians.items():
        system = "trident" if name.startswith("trident") else ("DCP" if name.startswith("DCP") else "torch")
        per_gib = seconds / (size_of[system] / gib)
        kind = "save" if "save" in name else "load"
        print(f"| {name} | {seconds:.3f} | {per_gib:.3f} | {1 / per_gib:.2f} | {per_gib / floor[kind]:.2f} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
