"""Context parallelism: activation bytes per rank and step time, cp=1 vs cp=2 (ring, Ulysses)
vs PyTorch's own `torch.distributed.tensor.experimental.context_parallel`.

The reference GPT (2 layers, d_model 128, 4 heads, learned positions, no dropout, fp32, AdamW)
at sequence lengths 1k, 4k and 16k, one sequence per step (batch 1):

    cp1       one process, the whole sequence (trident.initialize, no cp)
    ring      2 ranks, trident `context_parallel: {size: 2, method: ring}`: each rank holds 2 of 4
              zigzag chunks, key/value blocks go around the ring
    ulysses   2 ranks, `method: ulysses`: all-to-all to head shards around attention
    torch     2 ranks, PyTorch's experimental context_parallel (ring attention through DTensor's
              SDPA dispatch, head-tail load balancing) on the plain GPT, wrapped in DDP

Same sequence on every rank of a run (the cp ranks split it), same weights (seed 0). Each
(length, system, repeat) runs in fresh processes, one thread per rank; systems in rotating order
per repeat; medians over repeats.

Activation bytes per rank are the bytes of the tensors autograd saves for backward during one
forward (torch.autograd.graph.saved_tensors_hooks, counted once per storage, parameters
excluded), i.e. what the forward leaves alive for the backward; the transient peak (operator
outputs alive at once over forward, backward and the optimizer step, after the warm-up;
trident.testing.memory.LiveTensorBytes) is printed next to it. Ratios printed per length:

    act ratio      saved bytes per rank at cp=2 / (saved bytes at cp=1 / 2)   target <= 1.10
    time vs cp1    step time / the one-process step time
    time vs torch  step time / PyTorch context_parallel's step time           target <= 1

PyTorch's context_parallel does not run on CPU with torch 2.13: its ring handlers cover only the
CUDA SDPA kernels (flash, memory-efficient, cuDNN); CPU SDPA's
`aten._scaled_dot_product_flash_attention_for_cpu` has no DTensor sharding strategy
(NotImplementedError), and forcing the math kernel fails inside the CP dispatcher (a plain mask
tensor meets DTensors). The bench tries both and prints the errors instead of a time.

    python bench/context_parallel.py [--lengths 1024 4096 16384] [--repeats 2] [--systems ...]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback

import torch
import torch.distributed as dist

from _common import rotated, run_ranks, start_rank, timed_steps, token_batches

MODEL = dict(vocab_size=4096, n_layer=2, n_head=4, d_model=128, dropout=0.0, bias=True, tie_embeddings=True)
MICRO = 1
STEPS = {1024: (1, 4), 4096: (1, 2), 16384: (1, 1)}  # (warm-up, timed) steps per run; a 16k step takes ~10-60 s
SYSTEMS = ["cp1", "ring", "ulysses", "torch"]


def _model(seq_len: int) -> dict:
    return dict(MODEL, seq_len=seq_len)


def _gpt(model: dict):
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**model))


def _trident(system: str, model: dict):
    import trident
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0, "host_allocator": {"enabled": False},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}}
    if system != "cp1":
        config["context_parallel"] = {"size": 2, "method": system}
    engine, *_ = trident.initialize(model=_gpt(model), config=config)

    def forward(batch):
        return engine(batch[:, :-1], batch[:, 1:])

    def step(loss):
        engine.backward(loss)
        engine.step()
    return engine.module, forward, step


def _torch(model: dict, backend=None):
    """PyTorch's context parallel as torchtitan uses it: the inputs, targets and position ids are
    sharded along the sequence (in place) inside `context_parallel(mesh, buffers=...)`, where
    SDPA becomes ring attention; gradients are averaged over the cp ranks by DDP. `backend`
    pins SDPA's kernel (the second attempt, when the default CPU kernel is refused)."""
    from contextlib import nullcontext

    from torch.nn.attention import sdpa_kernel
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.parallel import DistributedDataParallel
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("cp",))
    gpt = _gpt(model)
    ddp = DistributedDataParallel(gpt)
    opt = torch.optim.AdamW(gpt.parameters(), lr=1e-4)

    def forward(batch):
        idx, targets = batch[:, :-1].contiguous(), batch[:, 1:].contiguous()
        positions = torch.arange(idx.shape[1]).expand_as(idx).contiguous()
        with sdpa_kernel(backend) if backend is not None else nullcontext(), \
                context_parallel(mesh, buffers=[idx, targets, positions], buffer_seq_dims=[1, 1, 1],
                                 no_restore_buffers={idx, targets, positions}):
            return ddp(idx, targets, position_ids=positions)

    def step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return gpt, forward, step


def _measure(module, forward, step, batch) -> tuple[int, int]:
    """(saved-for-backward bytes after one forward, peak live operator-made bytes over forward,
    backward and the update), model states excluded."""
    from trident.testing.memory import LiveTensorBytes
    states = {t.untyped_storage().data_ptr() for p in module.parameters() for t in (p, p.grad) if t is not None}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in states:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    tracker = LiveTensorBytes(states)
    with tracker:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = forward(batch)
        step(loss)
    return sum(saved.values()), tracker.peak


def _worker(rank: int, port: int, world: int, system: str, seq_len: int, steps: tuple[int, int], out) -> None:
    start_rank(rank, world, port)
    sys.stdout = open(os.devnull, "w")
    model = _model(seq_len)
    batches = token_batches(0, model, MICRO)  # every cp rank gets the same sequence
    if system == "torch":
        dist.init_process_group("gloo", rank=rank, world_size=world)
    why = []
    for backend in ((None, "math") if system == "torch" else (None,)):
        try:
            if system == "torch":
                from torch.nn.attention import SDPBackend
                module, forward, step = _torch(model, backend and SDPBackend.MATH)
            else:
                module, forward, step = _trident(system, model)
            median, _ = timed_steps(lambda b: step(forward(b)), batches, *steps)
            saved, peak = _measure(module, forward, step, next(batches))
            out.put((rank, "ok", median, saved, peak))
            break
        except Exception as err:  # noqa: BLE001 - reported as the system's result, not a crash
            last = traceback.extract_tb(err.__traceback__)[-1]
            why.append(f"{'default SDPA kernel' if backend is None else 'SDPA math kernel'}: {type(err).__name__}: "
                       f"{str(err).strip().splitlines()[0][:300]} (at {os.path.basename(last.filename)}:"
                       f"{last.lineno})")
    else:
        out.put((rank, "failed", "; ".join(why), 0, 0))
    if dist.is_initialized():
        dist.destroy_process_group()


def run_once(system: str, seq_len: int, steps: tuple[int, int]):
    """Fresh processes: ("ok", slowest rank's median step s, largest saved bytes, largest peak) or
    ("failed", why)."""
    world = 1 if system == "cp1" else 2
    results = run_ranks(_worker, world, (world, system, seq_len, steps), f"{system}, seq {seq_len}")
    failed = [r for r in results if r[1] != "ok"]
    if failed:
        return ("failed", failed[0][2])
    return ("ok", max(r[2] for r in results), max(r[3] for r in results), max(r[4] for r in results))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", nargs="+", type=int, default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--systems", nargs="+", default=SYSTEMS, choices=SYSTEMS)
    args = parser.parse_args()
    mib = 2 ** 20
    print(f"GPT {MODEL}, batch {MICRO} sequence per step, fp32, AdamW, gloo, 1 thread/rank; "
          f"(warm-up, timed) steps per run by length {STEPS}; medians of {args.repeats} interleaved repeats\n")
    print("| seq | system | ranks | step ms | saved MiB/rank | peak MiB/rank | act ratio | time vs cp1 "
          "| time vs torch |\n"
          "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    failures: dict[str, str] = {}
    for seq_len in args.lengths:
        steps = STEPS.get(seq_len, (1, 1))
        runs: dict[str, list] = {s: [] for s in args.systems}
        for repeat in range(args.repeats):
            for system in rotated(args.systems, repeat):
                if system in failures:
                    continue
                result = run_once(system, seq_len, steps)
                if result[0] == "failed":
                    failures[system] = f"seq {seq_len}: {result[1]}"
                    continue
                runs[system].append(result[1:])
        med = {s: tuple(statistics.median(r[k] for r in rows) for k in range(3)) for s, rows in runs.items() if rows}
        for system in args.systems:
            if system not in med:
                print(f"| {seq_len} | {system} | | did not run (see below) | | | | | |")
                continue
            t, saved, peak = med[system]
            act = f"{saved / (med['cp1'][1] / 2):.3f}" if system != "cp1" and "cp1" in med else ""
            vs = f"{t / med['torch'][0]:.2f}" if system != "torch" and "torch" in med else \
                ("n/a: torch did not run" if system != "torch" else "")
            vs1 = f"{t / med['cp1'][0]:.2f}" if system != "cp1" and "cp1" in med else ""
            print(f"| {seq_len} | {system} | {1 if system == 'cp1' else 2} | {t * 1e3:.0f} | {saved / mib:.2f} | "
                  f"{peak / mib:.2f} | {act} | {vs1} | {vs} |")
        sys.stdout.flush()
    for system, why in failures.items():
        print(f"\n{system} did not run: {why}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
