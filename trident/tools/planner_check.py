"""Predicted against measured: run trident's reference GPT in a layout here and time its steps.

`LAYOUTS` are the layouts the planner is checked on with 2 ranks (DP, ZeRO 1-3, tp=2, pp=2
1F1B, ZeRO-2 with the optimizer offloaded to the host). `measure_layout` runs on every rank
(`trident.testing.distributed.run_on_ranks`): warm-up steps, then the median of timed steps,
and the model-state bytes the engine holds; `predict_layout` asks the planner for the same
layout on a calibrated cluster. The test (tests/distributed/test_planner_step_time.py) and
the benchmark (bench/planner_vs_measured.py) share them, so both compare the same runs.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trident.planner.cluster import Calibration, calibrated_cluster
from trident.planner.estimate import Estimate, estimate
from trident.planner.layout import Layout, Workload
from trident.planner.memory import trident_state_bytes
from trident.planner.presets import model_from_gpt_config

MODEL = dict(vocab_size=256, seq_len=64, n_layer=4, n_head=4, d_model=256, dropout=0.0, bias=True)
"""Big enough that its GEMMs, not Python, dominate a step (~0.1-0.3 s on one core)."""
MICRO = 8
WARMUP, TIMED = 2, 5


@dataclass(frozen=True)
class CheckLayout:
    name: str
    layout: Layout
    gas: int = 1


LAYOUTS = [
    CheckLayout("dp2", Layout(dp=2, micro_batch=MICRO)),
    CheckLayout("dp2 zero1", Layout(dp=2, zero_stage=1, micro_batch=MICRO)),
    CheckLayout("dp2 zero2", Layout(dp=2, zero_stage=2, micro_batch=MICRO)),
    CheckLayout("dp2 zero3", Layout(dp=2, zero_stage=3, micro_batch=MICRO)),
    CheckLayout("tp2", Layout(tp=2, micro_batch=MICRO)),
    CheckLayout("pp2 1f1b", Layout(pp=2, micro_batch=MICRO // 2), gas=4),
    CheckLayout("dp2 zero2 offload", Layout(dp=2, zero_stage=2, micro_batch=MICRO, offload_optimizer="cpu")),
]


def _config(c: CheckLayout) -> dict:
    lay = c.layout
    zero = {"stage": lay.zero_stage, "stage3_param_persistence_threshold": 0}
    if lay.offload_optimizer != "none":
        zero["offload_optimizer"] = {"device": lay.offload_optimizer}
    cfg = {"train_micro_batch_size_per_gpu": lay.micro_batch, "gradient_accumulation_steps": c.gas,
           "steps_per_print": 0, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
           "zero_optimization": zero, "tensor_parallel": {"size": lay.tp}}
    if lay.pp > 1:
        cfg["pipeline"] = {"stages": lay.pp, "schedule": "1f1b", "partition_method": "uniform"}
    return cfg


def _engine(c: CheckLayout):
    from trident.engine.build import initialize
    from trident.models.gpt import GPT, GPTConfig
    from trident.models.gpt_pipe import gpt_pipe
    from trident.testing.distributed import cached_mesh

    lay = c.layout
    mesh = cached_mesh(pp=lay.pp, tp=lay.tp)
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    model = gpt_pipe(cfg, lay.pp, partition_method="uniform", stage_id=mesh.pp_rank) if lay.pp > 1 else GPT(cfg)
    engine, *_ = initialize(model=model, config=_config(c), mesh=mesh)
    return engine, mesh


def measure_layout(c: CheckLayout) -> dict:
    """On every rank: median seconds per optimizer step after warm-up, and model-state bytes."""
    engine, mesh = _engine(c)
    g = torch.Generator().manual_seed(1 + mesh.dp_rank)
    lay = c.layout
    data = torch.randint(0, MODEL["vocab_size"], (c.gas * lay.micro_batch, MODEL["seq_len"] + 1), generator=g)
    micro = [(b[:, :-1], b[:, 1:]) for b in data.split(lay.micro_batch)]

    def step():
        if lay.pp > 1:
            engine.train_batch(iter(micro))
            return
        for x, y in micro:
            engine.backward(engine(x, y))
            engine.step()

    times = []
    for i in range(WARMUP + TIMED):
        dist.barrier(group=mesh.mesh_group)
        start = time.perf_counter()
        step()
        if i >= WARMUP:
            times.append(time.perf_counter() - start)
    return {"seconds": statistics.median(times), "all": times, "memory": dict(engine.memory_breakdown())}


def calibrate_on_rank() -> dict:
    """This rank's share of a calibration on the ranks of the test pool (one thread each, the
    conditions the layouts run under); rank 0's result is the cluster file's content."""
    from trident.tools.calibrate import measure_rank
    return measure_rank("cpu", dist.group.WORLD, 1)


def predict_layout(c: CheckLayout, cal: Calibration) -> Estimate:
    """The planner's prediction of `c` on the calibrated cluster (fp32, AdamW, fused attention)."""
    from trident.models.gpt import GPTConfig
    lay = c.layout
    workload = Workload(seq_len=MODEL["seq_len"], global_batch=lay.data_parallel * lay.micro_batch * c.gas,
                        precision="fp32", optimizer="adamw", attention="flash",
                        zero3_persistence_threshold=0)
    return estimate(model_from_gpt_config(GPTConfig(**MODEL)), lay, calibrated_cluster(cal, lay.world_size),
                    workload, trident_state_bytes(lay.zero_stage, "fp32", "adamw"))


def compare(c: CheckLayout, cal: Calibration, measured: list[dict]) -> dict:
    """Ratios predicted / measured of step time (the slower rank's median; ranks step together)
    and of the model-state bytes rank 0 holds on its device (`engine.memory_breakdown()`, which
    leaves out what offload keeps on the host, as the planner's device placement does)."""
    est = predict_layout(c, cal)
    seconds = max(m["seconds"] for m in measured)
    device = sum(measured[0]["memory"].values())
    predicted = est.memory.placement.device
    return {"layout": c.name, "predicted_s": est.time.step, "measured_s": seconds,
            "time_ratio": est.time.step / seconds, "predicted_state_bytes": predicted,
            "measured_state_bytes": device, "memory_ratio": predicted / max(1, device)}


STEPS_BEFORE_REPORT = 4
"""`trident train` reports predicted against measured step time after this many steps (the
first is warm-up and left out)."""


def step_time_report(engine, model_cfg, measured: list[float], cluster_file=None) -> str:
    """One line for `trident train`: the median of the measured steps (the first left out) and
    the planner's step time for this run on the calibrated cluster file, with their ratio."""
    from trident.planner.cluster import default_cluster_path, load_calibration
    median = statistics.median(measured[1:] or measured)
    try:
        cal = load_calibration(cluster_file)
    except ValueError as err:
        return f"step time: measured median {median:.3f} s; no prediction ({err})"
    mesh = engine.mesh
    precision = {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(engine.compute_dtype, "fp32")
    layout = Layout(dp=mesh.dp_size, tp=mesh.tp_size, pp=mesh.pp_size, ep=mesh.ep_size, cp=mesh.cp_size,
                    zero_stage=engine.strategy.zero_stage, micro_batch=engine.train_micro_batch_size_per_gpu())
    workload = Workload(seq_len=model_cfg.seq_len, global_batch=engine.train_batch_size(), precision=precision,
                        optimizer="adamw", attention="flash", dropout=model_cfg.dropout > 0)
    est = estimate(model_from_gpt_config(model_cfg), layout, calibrated_cluster(cal, mesh.world_size), workload,
                   trident_state_bytes(layout.zero_stage, precision, "adamw"))
    where = cluster_file or default_cluster_path()
    return (f"step time: measured median {median:.3f} s over steps 2-{len(measured)}, planner {est.time.step:.3f} s "
            f"(predicted / measured {est.time.step / median:.2f}; cluster file {where})")
