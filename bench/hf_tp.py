"""trident tensor parallelism vs transformers' own (`tp_plan="auto"`, DTensor) on an unmodified
LlamaForCausalLM of about 50M parameters, side by side.

Both systems load the same checkpoint (written once with `save_pretrained` into a temporary
folder), each rank reading only its shard, and train on the same batches (every tp rank sees
the same ones): trident through `trident.hf.from_pretrained` and `trident.initialize` with
`tensor_parallel: {size: N, plan: "hf"}` (the model's published plan applied with trident's
layers), transformers through `from_pretrained(..., tp_plan="auto")`
with torch's AdamW. Each (system, repeat) runs in fresh processes so peak RSS is that run's
own; systems alternate within each repeat in rotating order. Reports the median step time,
median peak RSS per rank, parameter bytes per rank, the first loss (the two should agree),
and the ratios trident / transformers.

    python bench/hf_tp.py [--tp 2] [--repeats 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.distributed as dist

from _common import peak_rss_bytes, rotated, run_ranks, start_rank, timed_steps, token_batches
from zero_vs_peers import LLAMA, SEQ_LEN, CausalLM

MICRO = 4
WARMUP = 1
LR = 1e-4
SYSTEMS = ["transformers", "trident"]


def save_checkpoint(folder: str) -> int:
    import transformers
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    model.save_pretrained(folder)
    return sum(p.numel() for p in model.parameters())


def _trident(folder: str, tp: int):
    import trident
    from trident.parallel.mesh import ParallelMesh
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "tensor_parallel": {"size": tp, "plan": "hf"}}
    mesh = ParallelMesh.build(tp=tp)
    # each rank reads only its tp shard of the checkpoint, as transformers' tp_plan loading does
    model = CausalLM(trident.hf.from_pretrained(folder, mesh=mesh, config=cfg, dtype=torch.float32))
    engine, *_ = trident.initialize(model=model, config=cfg, mesh=mesh)

    def step(batch: torch.Tensor) -> float:
        loss = engine(batch[:, :-1], batch[:, 1:])
        engine.backward(loss)
        engine.step()
        return float(loss)
    return engine.module, step


def _transformers(folder: str, tp: int):
    import transformers
    from torch.distributed.tensor import DTensor
    model = CausalLM(transformers.AutoModelForCausalLM.from_pretrained(folder, tp_plan="auto",
                                                                        dtype=torch.float32))
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    optimizers = [torch.optim.AdamW(group, lr=LR, foreach=True) for group in (dtensors, plain) if group]

    def step(batch: torch.Tensor) -> float:
        loss = model(batch[:, :-1], batch[:, 1:])
        loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        return float(loss)
    return model, step


def _param_bytes(model: torch.nn.Module) -> int:
    total = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        total += local.numel() * local.element_size()
    return total


def _worker(rank: int, port: int, world: int, system: str, folder: str, steps: int, out) -> None:
    start_rank(rank, world, port)
    sys.stdout = open(os.devnull, "w")
    sys.stderr = open(os.devnull, "w")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, step = (_trident if system == "trident" else _transformers)(folder, world)
    losses = []
    median, _ = timed_steps(lambda b: losses.append(step(b)), token_batches(0, {"vocab_size": LLAMA["vocab_size"],
                                                                               "seq_len": SEQ_LEN}, MICRO),
                            WARMUP, steps)
    out.put((rank, median, peak_rss_bytes(), _param_bytes(model), losses[0]))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    with tempfile.TemporaryDirectory(prefix="hf_tp-") as folder:
        n = save_checkpoint(folder)
        print(f"transformers LlamaForCausalLM {LLAMA} ({n / 1e6:.1f}M params), seq {SEQ_LEN}, micro batch {MICRO}, "
              f"fp32, AdamW, gloo, 1 thread/rank, tp={args.tp}, {args.steps} timed steps after {WARMUP} warm-up, "
              f"{args.repeats} interleaved repeats (fresh processes each)")
        samples: dict[str, list] = {s: [] for s in SYSTEMS}
        for r in range(args.repeats):
            for system in rotated(SYSTEMS, r):
                results = run_ranks(_worker, args.tp, (args.tp, system, folder, args.steps), f"{system} tp={args.tp}")
                samples[system].append((max(x[1] for x in results), max(x[2] for x in results),
                                        max(x[3] for x in results), next(x[4] for x in results if x[0] == 0)))
    t = {s: statistics.median(x[0] for x in samples[s]) for s in SYSTEMS}
    m = {s: statistics.median(x[1] for x in samples[s]) for s in SYSTEMS}
    print(f"\n{'system':<14}{'step ms':>9}{'peak RSS MiB':>14}{'param MiB/rank':>16}{'loss@1':>9}"
          f"{'time ratio':>12}{'RSS ratio':>11}{'param ratio':>13}")
    for s in SYSTEMS:
        pbytes, loss = samples[s][0][2], samples[s][0][3]
        ratios = (f"{t[s] / t['transformers']:>12.3f}{m[s] / m['transformers']:>11.3f}"
                  f"{pbytes / samples['transformers'][0][2]:>13.3f}") if s == "trident" else ""
        print(f"{s:<14}{t[s] * 1e3:>9.1f}{m[s] / 2**20:>14.1f}{pbytes / 2**20:>16.1f}{loss:>9.4f}{ratios}")


if __name__ == "__main__":
    main()
