"""Pipeline schedules at pp=2 on the reference GPT: measured idle vs the simulator, step times
against one process and against torch.distributed.pipelining.

Two gloo ranks, one thread each. For every schedule and micro-batch count M the benchmark
times `engine.train_batch` (forward, backward and optimizer step of M micro-batches). It also
records each stage's instruction trace and measures every stage's idle share of the pipeline
phase (time not spent in forward or backward compute, between the first instruction on any
stage and the last). The prediction is `trident.pipeline.simulate` fed with what the trace
measured: the mean cost of each compute kind per stage and chunk, the mean load, the median
time a stage spends posting a batch of sends, and the median transfer latency (from a send's
posting to the end of its receive, over receives posted before the send).

Baselines on the same model, batch and optimizer (AdamW): one process running the M
micro-batches with gradient accumulation (pp=1), and torch.distributed.pipelining's
ScheduleGPipe and Schedule1F1B over the same two-stage split (with the tied embedding's
gradient summed across the stages, as trident does). Configurations are interleaved repeat
by repeat in rotating order; medians are reported, and the best (minimum) step time too: on
a shared machine it is the least disturbed measurement.

    python bench/pp_schedules.py [--micro-batches 4 8 16] [--repeats 8] [--steps 2]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

MODEL = dict(vocab_size=2048, seq_len=64, n_layer=4, n_head=4, d_model=192, dropout=0.0)
MICRO = 4
LR = 1e-4
TRIDENT = [("gpipe", 1), ("1f1b", 1), ("interleaved_1f1b", 2), ("zb_h1", 1)]
TORCH = ["gpipe", "1f1b"]
COMPUTE_KINDS = {"Forward": "forward", "Backward": "backward", "BackwardInput": "backward_input",
                 "BackwardWeight": "backward_weight"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _batch(m: int, step: int, shape: dict = MODEL, micro: int = MICRO) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, shape["vocab_size"], (m * micro, shape["seq_len"] + 1), generator=g)
    return [(tokens[k:k + micro, :-1], tokens[k:k + micro, 1:]) for k in range(0, m * micro, micro)]


def _gpt(shape: dict = MODEL):
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**{"dropout": 0.0, **shape}))


# -- the three systems; each returns step(step_index) -> None ---------------------------------

def _trident(schedule: str, v: int, m: int, mesh, shape: dict = MODEL, micro: int = MICRO):
    """(engine, step(step index)) for trident's pipeline engine over pp = 2 with `schedule`."""
    import trident
    from trident.models.gpt import GPTConfig
    from trident.models.gpt_pipe import gpt_pipe, load_gpt_state_dict

    cfg = GPTConfig(**{"dropout": 0.0, **shape})
    pipe = gpt_pipe(cfg, 2, partition_method="type:Block", virtual_stages=v, stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, _gpt(shape).state_dict(), cfg)
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": m, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "pipeline": {"stages": 2, "schedule": schedule, "virtual_stages": v,
                           "partition_method": "type:Block"}}
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    return engine, lambda step: engine.train_batch(iter(_batch(m, step, shape, micro)))


class _TorchStage(nn.Module):
    """Half of the GPT for torch.distributed.pipelining: embeddings + 2 blocks, or 2 blocks + head
    (a copy of the token table when the GPT ties them; its gradient is summed over the stages)."""

    def __init__(self, gpt, first: bool) -> None:
        super().__init__()
        half = len(gpt.blocks) // 2
        self.first = first
        self.tied = gpt.config.tie_embeddings
        self.blocks = nn.ModuleList(gpt.blocks[:half] if first else gpt.blocks[half:])
        if first:
            self.embed = gpt.embed
        else:
            self.ln_f = gpt.ln_f
            head = gpt.embed.wte.weight if self.tied else gpt.lm_head.weight
            self.head = nn.Parameter(head.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return x if self.first else F.linear(self.ln_f(x), self.head)


def _torch(schedule: str, m: int, mesh, shape: dict = MODEL, micro: int = MICRO):
    """step(step index) for torch.distributed.pipelining's ScheduleGPipe / Schedule1F1B over pp = 2."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    first = mesh.pp_rank == 0
    module = _TorchStage(_gpt(shape), first)
    tied = (module.embed.wte.weight if first else module.head) if module.tied else None
    stage = PipelineStage(module, mesh.pp_rank, 2, torch.device("cpu"), group=mesh.pp_group)

    def loss_fn(logits, target):
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), target.reshape(-1))

    runner = (ScheduleGPipe if schedule == "gpipe" else Schedule1F1B)(stage, m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(module.parameters(), lr=LR)

    def step(i: int) -> None:
        batch = _batch(m, i, shape, micro)
        if first:
            runner.step(torch.cat([x for x, _ in batch]))
        else:
            runner.step(target=torch.cat([y for _, y in batch]), losses=[])
        if tied is not None:
            dist.all_reduce(tied.grad, group=mesh.pp_group)  # the tied embedding's two gradients
        opt.step()
        opt.zero_grad()
    return step


def _serial(m: int, mesh):
    model = _gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)

    def step(i: int) -> None:
        if mesh.pp_rank == 0:  # one process does everything; the other waits
            for x, y in _batch(m, i):
                (model(x, y) / m).backward()
            opt.step()
            opt.zero_grad()
    return step


# -- measuring ---------------------------------------------------------------------------------

def _trace(engine) -> list[tuple]:
    """(instruction, start, end) on the perf_counter clock, which all processes of a machine share."""
    origin = engine.executor.trace_start
    return [(sp.instr, origin + sp.start, origin + sp.end) for sp in engine.executor.trace]


def _latency(traces: list[list]) -> float:
    """Median time from a send's posting to the end of its receive, over receives posted first."""
    from trident.pipeline.instructions import RECVS, SENDS, channel_kind, peer

    posted = {}
    for stage, trace in enumerate(traces):
        for instr, start, _ in trace:
            if isinstance(instr, SENDS):
                to, chunk = peer(instr, stage, 2)
                posted[(to, channel_kind(instr), instr.micro, chunk)] = start
    samples = [end - max(start, posted[(stage, channel_kind(instr), instr.micro, instr.chunk)])
               for stage, trace in enumerate(traces) for instr, start, end in trace
               if isinstance(instr, RECVS) and posted[(stage, channel_kind(instr), instr.micro, instr.chunk)] >= start]
    return statistics.median(samples) if samples else 0.0


def _batches(trace: list[tuple]) -> list[list[tuple]]:
    """Transfers the executor posted together (one batch) share their span."""
    from trident.pipeline.instructions import COMM

    out: list[list[tuple]] = []
    for entry in trace:
        if isinstance(entry[0], COMM) and out and isinstance(out[-1][0][0], COMM) and out[-1][0][1:] == entry[1:]:
            out[-1].append(entry)
        else:
            out.append([entry])
    return [b for b in out if isinstance(b[0][0], COMM)]


def _idle_measured(traces: list[list]) -> list[float]:
    t0 = min(t[1] for trace in traces for t in trace)
    t1 = max(t[2] for trace in traces for t in trace)
    return [1 - sum(e - s for instr, s, e in trace if type(instr).__name__ in COMPUTE_KINDS) / (t1 - t0)
            for trace in traces]


def _idle_predicted(traces: list[list], schedule: str, v: int, m: int) -> list[float]:
    from trident.pipeline import Costs, build_all, simulate
    from trident.pipeline.instructions import COMPUTE, RECVS

    latency = _latency(traces)
    costs = []
    for trace in traces:
        sends_only = [e - s for batch in _batches(trace) for _, s, e in batch[:1]
                      if not any(isinstance(i, RECVS) for i, _, _ in batch)]
        post = statistics.median(sends_only) if sends_only else 0.0
        loads = [e - s for instr, s, e in trace if type(instr).__name__ == "LoadMicroBatch"]
        per_chunk = []
        for chunk in range(v):
            means = {field: statistics.fmean(spans) for kind, field in COMPUTE_KINDS.items()
                     if (spans := [e - s for instr, s, e in trace
                                   if type(instr).__name__ == kind and instr.chunk == chunk])}
            per_chunk.append(Costs(p2p=latency, post=post, load=statistics.fmean(loads) if loads else 0.0, **means))
        costs.append(per_chunk)
    timeline = simulate(build_all(schedule, 2, m, v), costs)
    return [1 - sum(sp.end - sp.start for sp in timeline.spans[s] if isinstance(sp.instr, COMPUTE))
            / timeline.makespan for s in range(2)]


def _worker(rank: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from trident.comm.backend import init_distributed
    from trident.monitor.log import logger
    from trident.parallel.mesh import ParallelMesh

    init_distributed(backend="gloo")
    mesh = ParallelMesh.build(pp=2)
    logger.disabled = True
    runs = {}
    for m in args.micro_batches:
        for schedule, v in TRIDENT:
            runs[("trident", schedule, v, m)] = _trident(schedule, v, m, mesh)
        for schedule in TORCH:
            runs[("torch", schedule, 1, m)] = (None, _torch(schedule, m, mesh))
        runs[("pp=1", "serial", 1, m)] = (None, _serial(m, mesh))
    keys = list(runs)
    times: dict[tuple, list[float]] = {k: [] for k in keys}
    idle: dict[tuple, list[tuple[list[float], list[float]]]] = {k: [] for k in keys}
    for _, step in runs.values():
        step(-1)  # warm-up: shapes exchanged, allocator and optimizer state in place
    for r in range(args.repeats):
        order = keys[r % len(keys):] + keys[:r % len(keys)]
        for key in order:
            engine, step = runs[key]
            for i in range(args.steps):
                if engine is not None:
                    engine.executor.record = True
                dist.barrier(group=mesh.pp_group)
                t0 = time.perf_counter()
                step(r * args.steps + i)
                dist.barrier(group=mesh.pp_group)
                times[key].append(time.perf_counter() - t0)
                if engine is not None:
                    traces = [None, None]
                    dist.all_gather_object(traces, _trace(engine), group=mesh.pp_group)
                    _, schedule, v, m = key
                    idle[key].append((_idle_measured(traces), _idle_predicted(traces, schedule, v, m),
                                      _latency(traces)))
    if rank == 0:
        _report(args, times, idle)
    dist.barrier()


def _report(args, times, idle) -> None:
    med = {k: statistics.median(v) for k, v in times.items()}
    latency = statistics.median(x[2] for v in idle.values() for x in v)
    print(f"pp=2 on 2 gloo ranks x 1 thread; GPT {MODEL}, micro-batch {MICRO}; {args.repeats} repeats x "
          f"{args.steps} steps; median measured transfer latency {latency * 1e3:.2f} ms")
    best = {k: min(v) for k, v in times.items()}
    print("speedup: pp=1 step time / this step time; / torch: this step time / torch's at the same schedule")
    print(f"{'system':<8} {'schedule':<20} {'M':>3} {'step ms':>8} {'speedup':>8} {'/ torch':>9} {'best ms':>8} "
          f"{'/ torch':>9}  {'idle stage 0 meas/sim':>22} {'idle stage 1 meas/sim':>22}")
    for key, t in med.items():
        system, schedule, v, m = key
        name = f"{schedule}" + (f" v={v}" if v > 1 else "")
        serial = med[("pp=1", "serial", 1, m)]
        torch_key = ("torch", schedule if schedule in TORCH else "1f1b", 1, m)
        same = system == "trident" and schedule in TORCH
        vs_torch = f"{t / med[torch_key]:.2f}x" if same else ""
        best_vs_torch = f"{best[key] / best[torch_key]:.2f}x" if same else ""
        line = (f"{system:<8} {name:<20} {m:>3} {t * 1e3:>8.1f} {serial / t:>7.2f}x {vs_torch:>9} "
                f"{best[key] * 1e3:>8.1f} {best_vs_torch:>9}")
        if idle[key]:
            meas = [statistics.median(x[0][s] for x in idle[key]) for s in range(2)]
            pred = [statistics.median(x[1][s] for x in idle[key]) for s in range(2)]
            line += "  " + " ".join(f"{100 * a:>9.1f}%/{100 * b:>5.1f}%{'':>5}" for a, b in zip(meas, pred))
        print(line)
    gaps = [abs(statistics.median(x[0][s] for x in v) - statistics.median(x[1][s] for x in v))
            for v in idle.values() if v for s in range(2)]
    print(f"idle share, measured vs simulated from measured costs: largest gap {100 * max(gaps):.1f} "
          f"percentage points, median {100 * statistics.median(gaps):.1f} (over {len(gaps)} stage results)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8, 16])
    parser.add_argument("--repeats", type=int, default=8)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    os.environ["OMP_NUM_THREADS"] = "1"
    t0 = time.time()
    mp.spawn(_worker, args=(_free_port(), args), nprocs=2, join=True)
    print(f"total {time.time() - t0:.0f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
