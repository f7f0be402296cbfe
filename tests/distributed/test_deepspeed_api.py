"""`deepspeed.comm`'s functions, `initialize(mpu=...)`, the "auto" values initialize fills, and
the engine methods DeepSpeed scripts call, on real gloo groups."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import trident as deepspeed
from trident.comm import recorder
from trident.testing.distributed import cached_mesh, run_on_ranks


def _recorded() -> int:
    """How many calls the flight recorder has noted so far (its ring keeps only the newest)."""
    records = recorder.active.records() if recorder.active is not None else []
    return records[-1].index + 1 if records else 0


def comm_calls() -> dict:
    """Every deepspeed.comm collective with DeepSpeed's arguments (no group = all ranks; global ranks)."""
    rank, world = deepspeed.comm.get_rank(), deepspeed.comm.get_world_size()
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "comms_logger": {"enabled": True}}
    engine, *_ = deepspeed.initialize(model=nn.Linear(2, 2), config=config, mesh=cached_mesh())
    before = _recorded()
    out = {}
    t = torch.tensor([float(rank + 1)])
    deepspeed.comm.all_reduce(t)
    out["all_reduce"] = t.item()
    t = torch.tensor([float(rank)])
    deepspeed.comm.broadcast(t, src=1)
    out["broadcast"] = t.item()
    t = torch.tensor([float(rank + 1)])
    deepspeed.comm.reduce(t, dst=1)
    out["reduce_on_1"] = t.item() if rank == 1 else None
    parts = [torch.zeros(1) for _ in range(world)]
    deepspeed.comm.all_gather(parts, torch.tensor([float(rank)]))
    out["all_gather"] = [p.item() for p in parts]
    flat = torch.zeros(world)
    deepspeed.comm.all_gather_into_tensor(flat, torch.tensor([float(rank)]))
    out["all_gather_into_tensor"] = flat.tolist()
    mine = torch.zeros(1)
    deepspeed.comm.reduce_scatter_tensor(mine, torch.arange(float(world)))
    out["reduce_scatter_tensor"] = mine.item()
    a2a = torch.zeros(world)
    deepspeed.comm.all_to_all_single(a2a, torch.full((world,), float(rank)))
    out["all_to_all_single"] = a2a.tolist()
    if rank == 0:
        deepspeed.comm.send(torch.tensor([7.0]), dst=1)
    else:
        got = torch.zeros(1)
        deepspeed.comm.recv(got, src=0)
        out["recv"] = got.item()
    group = deepspeed.comm.new_group([0, 1])
    t = torch.ones(1)
    deepspeed.comm.all_reduce(t, op=deepspeed.comm.ReduceOp.MAX, group=group)
    deepspeed.comm.barrier()
    out["logged"] = sorted(engine.comms_logger.totals())
    out["recorded"] = _recorded() - before if recorder.active is not None else -1
    out["local_rank"] = deepspeed.comm.get_local_rank()
    return out


def test_deepspeed_comm_on_two_ranks():
    r0, r1 = run_on_ranks(2, comm_calls)
    assert r0["all_reduce"] == r1["all_reduce"] == 3.0
    assert r0["broadcast"] == r1["broadcast"] == 1.0
    assert r1["reduce_on_1"] == 3.0
    assert r0["all_gather"] == r0["all_gather_into_tensor"] == [0.0, 1.0]
    assert (r0["reduce_scatter_tensor"], r1["reduce_scatter_tensor"]) == (0.0, 2.0)
    assert r1["all_to_all_single"] == [0.0, 1.0] and r1["recv"] == 7.0
    # each call went through trident's collectives: timed by the comms logger, noted by the hang detector
    for op in ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "send", "barrier"):
        assert any(op in logged for logged in r0["logged"]), (op, r0["logged"])
    assert r0["recorded"] >= 10


class FakeMpu:
    """Megatron's model-parallel unit for tp = pp = 1: the data-parallel group is every rank."""

    def get_model_parallel_world_size(self):
        return 1

    def get_data_parallel_group(self):
        return dist.group.WORLD


def mpu_and_auto() -> dict:
    model = nn.Linear(4, 4).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    config = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": "auto",
              "bf16": {"enabled": "auto"}, "fp16": {"enabled": "auto"},
              "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_min_lr": "auto",
                                                          "warmup_num_steps": 2}}}
    engine, optimizer, _, scheduler = deepspeed.initialize(model=model, optimizer=opt, config=config, mpu=FakeMpu())
    x = torch.randn(2, 4)
    with engine.no_sync():
        engine.backward(engine(x).float().pow(2).mean())
        synced = engine.is_gradient_accumulation_boundary()
    engine.step()
    engine.set_gradient_accumulation_boundary(True)
    engine.backward(engine(x).float().pow(2).mean())
    engine.step()
    with pytest.raises(RuntimeError, match="pipeline engine's"):
        engine.train_batch()
    return {"dp": engine.dp_world_size, "tb": engine.train_batch_size(), "bf16": engine.config.bf16.enabled,
            "optimizer": type(optimizer).__name__, "scheduler": type(scheduler).__name__,
            "max_lr": scheduler.max_lrs[0], "synced": synced, "applied": engine.was_step_applied(),
            "steps": engine.global_steps, "stage": engine.zero_optimization_stage(), "device": str(engine.device)}


def test_initialize_with_mpu_fills_auto_from_the_run():
    r0, r1 = run_on_ranks(2, mpu_and_auto)
    assert r0 == r1
    assert (r0["dp"], r0["tb"], r0["bf16"]) == (2, 4, True)  # batch from the world size, precision from the dtype
    assert (r0["optimizer"], r0["scheduler"], r0["max_lr"]) == ("SGD", "WarmupLR", 0.05)  # client optimizer's lr
    assert r0["synced"] is False and r0["applied"] and r0["steps"] == 2
    assert (r0["stage"], r0["device"]) == (0, "cpu")


def zero2_no_sync() -> str:
    engine, *_ = deepspeed.initialize(model=nn.Linear(2, 2), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2},
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, mesh=cached_mesh())
    try:
        engine.no_sync()
    except RuntimeError as err:
        return str(err)
    return ""


def test_no_sync_is_refused_by_name_under_zero2():
    assert "not supported under ZeRO stage 2" in run_on_ranks(2, zero2_no_sync)[0]


def two_engines() -> dict:
    """Two engines in one process, each with its comms logger: `engine.comm` logs to its own."""
    config = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "comms_logger": {"enabled": True}}
    a, *_ = deepspeed.initialize(model=nn.Linear(2, 2), config=config, mesh=cached_mesh())
    b, *_ = deepspeed.initialize(model=nn.Linear(2, 2), config=config, mesh=cached_mesh())
    a.comms_logger.reset()
    b.comms_logger.reset()
    for _ in range(3):
        a.comm.all_reduce(torch.ones(1))
    b.comm.broadcast(torch.ones(1), src=0)
    a.comm.barrier()
    process_before = {op: s.calls for op, s in b.comms_logger.totals().items()}
    deepspeed.comm.all_gather_into_tensor(torch.zeros(2), torch.ones(1))  # the process's: the engine built last
    return {"a": {op: s.calls for op, s in a.comms_logger.totals().items()},
            "b": process_before, "b_after": {op: s.calls for op, s in b.comms_logger.totals().items()},
            "process_is_b": deepspeed.comm.comms_logger() is b.comms_logger}


def test_two_engines_in_one_process_log_to_their_own_loggers():
    r0, r1 = run_on_ranks(2, two_engines)
    for r in (r0, r1):
        assert r["a"] == {"all_reduce": 3, "barrier": 1}
        assert r["b"] == {"broadcast": 1}
        assert r["process_is_b"] and r["b_after"] == {"broadcast": 1, "all_gather": 1}
