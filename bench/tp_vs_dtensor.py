"""trident tensor parallelism vs PyTorch DTensor tensor parallelism, side by side.

Same model (the reference GPT, embeddings untied because DTensor's module plans do not keep a
tie), same batches on every tp rank, AdamW, gloo on CPU, one thread per rank. trident runs
`GPT(cfg, mesh, sequence_parallel=...)` (vocabulary-parallel embedding and loss); PyTorch runs
the plain GPT through `parallelize_module` with ColwiseParallel / RowwiseParallel (and
SequenceParallel / PrepareModuleInput for sequence parallelism), the embedding split by rows
and the loss under `loss_parallel()`, as torchtitan does. Every (system, layout, repeat) runs
in fresh processes so peak RSS is that run's own; systems alternate within each repeat, in
rotating order, so machine noise hits them alike. Reports the median step time, the median
peak RSS per rank, parameter bytes per rank (with trident's expected value: split weights / tp
+ replicated ones) and the ratios trident / DTensor.

    python bench/tp_vs_dtensor.py [--layouts 1 2 4 2sp] [--repeats 2] [--steps 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from _common import peak_rss_bytes, rotated, run_ranks, start_rank, timed_steps, token_batches

MODEL = dict(vocab_size=8192, seq_len=128, n_layer=4, n_head=8, d_model=256, tie_embeddings=False, bias=True)
MICRO = 4
WARMUP = 2
SYSTEMS = ["dtensor", "trident"]


def _gpt(mesh=None, sequence_parallel: bool = False, shape: dict = MODEL):
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**shape), mesh, sequence_parallel=sequence_parallel)


def _trident(world: int, sp: bool, shape: dict = MODEL):
    from trident.parallel.mesh import ParallelMesh
    model = _gpt(ParallelMesh.build(tp=world), sp, shape)
    return model, lambda x, y: model(x, y), [_adamw(model.parameters())]


def _adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-4, foreach=True)


def _dtensor_plan(n_layer: int, sp: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)
    plan = {"embed.wte": RowwiseParallel(input_layouts=Replicate()),
            "lm_head": ColwiseParallel(input_layouts=Shard(1) if sp else Replicate(), output_layouts=Shard(-1),
                                       use_local_output=False)}
    if sp:  # the position embedding is added to the whole sequence, then the sequence is split
        plan["embed"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1))
        plan["ln_f"] = SequenceParallel()
    for i in range(n_layer):
        b = f"blocks.{i}"
        plan |= {f"{b}.attn.qkv": ColwiseParallel(), f"{b}.mlp.fc": ColwiseParallel(),
                 f"{b}.attn.proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate()),
                 f"{b}.mlp.proj": RowwiseParallel(output_layouts=Shard(1) if sp else Replicate())}
        if sp:
            gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan |= {f"{b}.ln_1": SequenceParallel(), f"{b}.ln_2": SequenceParallel(),
                     f"{b}.attn": gather, f"{b}.mlp": gather}
    return plan


def _dtensor(world: int, sp: bool, shape: dict = MODEL):
    """Needs untied embeddings (`shape["tie_embeddings"]` False): a module plan unties them."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import loss_parallel, parallelize_module
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(_gpt(shape=shape), mesh, _dtensor_plan(shape["n_layer"], sp))

    def loss_fn(x, y):
        with loss_parallel():
            return model(x, y)
    # foreach AdamW cannot mix DTensors (split weights) with plain tensors (the replicated rest)
    dtensors = [p for p in model.parameters() if isinstance(p, DTensor)]
    plain = [p for p in model.parameters() if not isinstance(p, DTensor)]
    return model, loss_fn, [_adamw(dtensors), _adamw(plain)]


def _param_bytes(params) -> int:
    seen, total = set(), 0
    for p in params:
        local = p.to_local() if hasattr(p, "to_local") else p
        if id(p) not in seen:
            seen.add(id(p))
            total += local.numel() * local.element_size()
    return total


SPLIT = ("attn.qkv.weight", "attn.qkv.bias", "mlp.fc.weight", "mlp.fc.bias", "attn.proj.weight", "mlp.proj.weight")
VOCAB_SPLIT = ("embed.wte.weight", "lm_head.weight")


def expected_trident_bytes(world: int) -> int:
    """Split weights / tp (the vocabulary padded to a multiple of tp) + replicated ones, in fp32."""
    total = 0
    for name, p in _gpt().named_parameters():
        if name.endswith(VOCAB_SPLIT):
            total += -(-p.shape[0] // world) * p.shape[1]  # padded rows / tp, whole rows
        elif name.endswith(SPLIT):
            total += p.numel() // world
        else:
            total += p.numel()
    return 4 * total


def make_step(system: str, world: int, sp: bool, shape: dict = MODEL):
    """(model, step(batch), first losses) for "trident" or "dtensor" at tp = world; every tp rank
    must be fed the same batches."""
    model, loss_fn, optimizers = (_trident if system == "trident" else _dtensor)(world, sp, shape)
    first_loss = []

    def step(batch):
        loss = loss_fn(batch[:, :-1], batch[:, 1:])
        if system == "dtensor":
            from torch.distributed.tensor.parallel import loss_parallel
            with loss_parallel():
                loss.backward()
        else:
            loss.backward()
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if not first_loss:
            first_loss.append(float((loss.full_tensor() if hasattr(loss, "full_tensor") else loss).detach()))
    return model, step, first_loss


def _worker(rank: int, port: int, world: int, system: str, sp: bool, steps: int, out) -> None:
    start_rank(rank, world, port)
    sys.stdout = open(os.devnull, "w")
    dist.init_process_group("gloo", rank=rank, world_size=world)
    model, step, first_loss = make_step(system, world, sp)
    median, _ = timed_steps(step, token_batches(0, MODEL, MICRO), WARMUP, steps)  # one batch stream: tp ranks share it
    out.put((rank, median, peak_rss_bytes(), _param_bytes(model.parameters()), first_loss[0]))
    dist.destroy_process_group()


def run_once(system: str, world: int, sp: bool, steps: int) -> tuple[float, int, int, float]:
    """Fresh processes: slowest rank's median step seconds, largest peak RSS, largest parameter bytes."""
    results = run_ranks(_worker, world, (world, system, sp, steps), f"{system}, tp={world}, sp={sp}")
    return (max(r[1] for r in results), max(r[2] for r in results), max(r[3] for r in results),
            next(r[4] for r in results if r[0] == 0))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layouts", nargs="+", default=["1", "2", "4", "2sp"],
                        help="tp sizes; a suffix 'sp' turns on sequence parallelism")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    n_params = sum(p.numel() for p in _gpt().parameters())
    print(f"GPT {MODEL} ({n_params / 1e6:.1f}M params), micro batch {MICRO}, AdamW, gloo, 1 thread/rank, "
          f"{args.steps} timed steps after {WARMUP} warm-up, {args.repeats} interleaved repeats")
    print(f"\n{'layout':<8}{'system':<9}{'step ms':>9}{'peak RSS MiB':>14}{'param MiB/rank':>16}"
          f"{'expected':>10}{'loss@1':>9}{'time ratio':>12}{'RSS ratio':>11}")
    for layout in args.layouts:
        world, sp = int(layout.removesuffix("sp")), layout.endswith("sp")
        samples: dict[str, list] = {s: [] for s in SYSTEMS}
        for r in range(args.repeats):
            for system in rotated(SYSTEMS, r):
                samples[system].append(run_once(system, world, sp, args.steps))
        t = {s: statistics.median(x[0] for x in samples[s]) for s in SYSTEMS}
        m = {s: statistics.median(x[1] for x in samples[s]) for s in SYSTEMS}
        for s in SYSTEMS:
            pbytes, loss = samples[s][0][2], samples[s][0][3]
            expected = f"{expected_trident_bytes(world) / 2**20:.3f}" if s == "trident" else ""
            ratios = f"{t[s] / t['dtensor']:>12.3f}{m[s] / m['dtensor']:>11.3f}" if s == "trident" else ""
            print(f"{layout:<8}{s:<9}{t[s] * 1e3:>9.1f}{m[s] / 2**20:>14.1f}{pbytes / 2**20:>16.3f}"
                  f"{expected:>10}{loss:>9.4f}{ratios}")


if __name__ == "__main__":
    main()
