"""The GPU check's process-group and equivalence bodies: each runs on every rank of a fresh group.

The equivalence bodies train the small GPT of `gpu_common` through `trident.initialize` (the
user's path: the engine builds its mesh from the config) and compare each rank's final weights
(its tensor-parallel shard, its pipeline stage) and every step's global gradient norm with one
process training plain PyTorch on the same device and the same global batches.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trident.engine.build import initialize
from trident.engine.pipeline_engine import PipelineEngine
from trident.models.gpt_pipe import gpt_pipe, gpt_state_dict, load_gpt_state_dict
from trident.parallel.mesh import ParallelMesh
from trident.tensor_parallel import shard_specs
from trident.tensor_parallel.split import split_state_dict
from trident.tools.gpu_common import (MICRO, SMALL, STEPS, Outcome, compare, elapsed_seconds, engine_config, exact_fp32,
                                      make_gpt, median, rank_rows, serial_run, tokens)

ALL_REDUCE_BYTES = {"cuda": 64 * 2**20, "cpu": 2**20}


def process_group(device: torch.device) -> Outcome:
    """all_reduce, all_gather and broadcast give the right values; one large all-reduce timed."""
    world, rank = dist.get_world_size(), dist.get_rank()
    t = torch.full((4,), float(rank + 1), device=device)
    dist.all_reduce(t)
    gathered = [torch.empty(1, device=device) for _ in range(world)]
    dist.all_gather(gathered, torch.tensor([float(rank)], device=device))
    b = torch.tensor([float(rank + 7)], device=device)
    dist.broadcast(b, src=world - 1)
    ok = (t.eq(world * (world + 1) / 2).all().item() and [g.item() for g in gathered] == list(range(world))
          and b.item() == world + 6)
    if device.type == "cuda":  # one rank per GPU: every rank on a device of its own
        dist.all_gather(gathered, torch.tensor([float(device.index)], device=device))
        ok = ok and len({g.item() for g in gathered}) == world
    seconds = _time_all_reduce(device, ALL_REDUCE_BYTES[device.type])
    size = ALL_REDUCE_BYTES[device.type]
    # bus bandwidth: what each rank sends and receives in a ring all-reduce, per second
    bus = f"bus {2 * (world - 1) / world * size / seconds / 1e9:.1f} GB/s" if world > 1 else "one rank: no link used"
    return Outcome.judge(bool(ok), f"{dist.get_backend()} on {world} rank(s): all_reduce/all_gather/broadcast "
                                   f"{'correct' if ok else 'WRONG VALUES'}; all_reduce {size / 2**20:.0f} MiB in "
                                   f"{seconds * 1e3:.2f} ms ({bus})")


def _time_all_reduce(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Median seconds of one all-reduce of `nbytes`."""
    x = torch.ones(nbytes // 4, device=device)
    dist.all_reduce(x)  # warm-up: NCCL builds its communicator on the first call
    return median([elapsed_seconds(lambda: dist.all_reduce(x), device) for _ in range(repeats)])


def _train_engine(engine, dp_rank: int, dp_size: int, device: torch.device) -> list:
    """STEPS optimizer steps on this dp rank's share of each global batch; the global grad norms."""
    global_batch = MICRO * dp_size
    data = tokens(global_batch).to(device)
    norms = []
    for step in range(STEPS):
        rows = rank_rows(data, step, global_batch, dp_rank, dp_size)
        engine.backward(engine(rows[:, :-1], rows[:, 1:]))
        engine.step()
        norms.append(engine.get_global_grad_norm())
    return norms


def equivalence(device: torch.device, stage: int = 0, tp: int = 1) -> Outcome:
    """DP (stage 0), ZeRO (`stage`) and TP (`tp`) over every rank against one process."""
    exact_fp32(device)
    zero = {"stage": stage, "reduce_bucket_size": 4096}  # several buckets: overlapped reductions
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every parameter partitioned and gathered
    config = engine_config(MICRO, zero_optimization=zero, tensor_parallel={"size": tp})
    engine, *_ = initialize(model=make_gpt(device), config=config)
    mesh = engine.mesh
    norms = _train_engine(engine, mesh.dp_rank, mesh.dp_size, device)
    if stage == 3:
        weights = engine.consolidated_state_dict()  # collective: every rank
    else:
        weights = {k: v.detach() for k, v in engine.module.state_dict().items()}
    ref = serial_run(device, MICRO * mesh.dp_size)
    expected = split_state_dict(ref.weights, shard_specs(engine.module), mesh.tp_rank) if tp > 1 else ref.weights
    layout = f"dp={mesh.dp_size}" + (f" zero={stage}" if stage else "") + (f" tp={tp}" if tp > 1 else "")
    return compare(device, weights, expected, norms, ref.norms, layout)


def pipeline_equivalence(device: torch.device, pp: int = 2) -> Outcome:
    """The GPT as a `pp`-stage 1F1B pipeline (dp = world / pp) against one process."""
    exact_fp32(device)
    mesh = ParallelMesh.build(pp=pp, device_type=device.type)
    pipe = gpt_pipe(SMALL, pp, partition_method="uniform", stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, make_gpt(torch.device("cpu")).state_dict(), SMALL)
    pipe.to(device)
    gas = 2
    config = engine_config(MICRO, gas, pipeline={"stages": pp, "schedule": "1f1b", "partition_method": "uniform"})
    engine, *_ = initialize(model=pipe, config=config, mesh=mesh)
    if not isinstance(engine, PipelineEngine):
        return Outcome.judge(False, f"trident.initialize returned {type(engine).__name__}, not a PipelineEngine")
    global_batch = MICRO * gas * mesh.dp_size
    data = tokens(global_batch).to(device)
    norms = []
    for step in range(STEPS):
        rows = rank_rows(data, step, global_batch, mesh.dp_rank, mesh.dp_size)
        engine.train_batch(iter([(rows[k:k + MICRO, :-1], rows[k:k + MICRO, 1:]) for k in range(0, len(rows), MICRO)]))
        norms.append(engine.get_global_grad_norm())
    ref = serial_run(device, global_batch)
    return compare(device, gpt_state_dict(pipe, SMALL), ref.weights, norms, ref.norms,
                   f"pp={pp} dp={mesh.dp_size} stage {mesh.pp_rank}")


BF16_LOSS_RTOL = 0.02
"""bf16 keeps 8 significant bits: its losses track fp32 training, they do not equal it."""


def bf16_training(device: torch.device) -> Outcome:
    """bf16 data parallelism over every rank: bf16 weights, fp32 masters, losses track fp32."""
    config = engine_config(MICRO, bf16={"enabled": True})
    engine, *_ = initialize(model=make_gpt(device), config=config)
    world = engine.mesh.dp_size
    dtypes = {p.dtype for p in engine.module.parameters()}
    global_batch = MICRO * world
    data = tokens(global_batch).to(device)
    losses = []
    for step in range(STEPS):
        rows = rank_rows(data, step, global_batch, engine.mesh.dp_rank, world)
        loss = engine(rows[:, :-1], rows[:, 1:])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().float())
    mean = torch.stack(losses)
    dist.all_reduce(mean)  # every rank's loss is its own micro-batch's: the global batch's is their mean
    mean = (mean / world).tolist()
    ref = serial_run(device, global_batch).losses
    err = max(abs(a - e) / e for a, e in zip(mean, ref))
    ok = dtypes == {torch.bfloat16} and err <= BF16_LOSS_RTOL
    return Outcome.judge(ok, f"dp={world}: parameters {sorted(str(d) for d in dtypes)}, losses within "
                             f"{err:.1e} of fp32 over {STEPS} steps (bar {BF16_LOSS_RTOL})")
