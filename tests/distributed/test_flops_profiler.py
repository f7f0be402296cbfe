"""The `flops_profiler` section on 2 gloo ranks: tensor parallelism, a pipeline, ZeRO-3.

A rank counts what it computes; the report adds a replica's ranks up. However the model is
split, the replica's training FLOPs per token are the reference GPT's 6 N + 14 L T d
(tests/unit/test_flops_profiler.py derives the formula), and its parameters the model's.
"""

from __future__ import annotations

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe
from trident.testing.distributed import cached_mesh, run_on_ranks

MODEL = dict(vocab_size=128, seq_len=32, n_layer=2, n_head=2, d_model=64)
MICRO, GAS = 2, 2


def training_flops_per_token() -> float:
    cfg = GPTConfig(**MODEL)
    n_matmul = cfg.n_layer * 12 * cfg.d_model ** 2 + cfg.vocab_size * cfg.d_model
    return 6 * n_matmul + 14 * cfg.n_layer * cfg.seq_len * cfg.d_model


def profiled_run(tp: int, pp: int, zero_stage: int, output_file: str | None) -> dict:
    """Three steps with profile_step 1 (step 1 counted, step 2 timed, the report after it)."""
    mesh = cached_mesh(pp=pp, tp=tp)
    torch.manual_seed(0)
    cfg = GPTConfig(**MODEL)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS, "steps_per_print": 0,
              "optimizer": {"type": "SGD", "params": {"lr": 0.01}}, "tensor_parallel": {"size": tp},
              "zero_optimization": {"stage": zero_stage},
              "flops_profiler": {"enabled": True, "profile_step": 1, "module_depth": 2, "output_file": output_file}}
    if pp > 1:
        model = gpt_pipe(cfg, pp, partition_method="uniform", stage_id=mesh.pp_rank)
        config["pipeline"] = {"stages": pp, "partition_method": "uniform"}
    else:
        model = GPT(cfg)
    engine, *_ = trident.initialize(model=model, config=config, mesh=mesh)
    rows = MICRO * GAS * mesh.dp_size
    data = torch.randint(0, cfg.vocab_size, (3 * rows, cfg.seq_len + 1), generator=torch.Generator().manual_seed(1))
    for step in range(3):
        assert engine.flops_profiler.report is None
        mine = data[step * rows:][:rows][mesh.dp_rank * MICRO * GAS:][:MICRO * GAS]
        micro = [(mine[i:i + MICRO, :-1], mine[i:i + MICRO, 1:]) for i in range(0, MICRO * GAS, MICRO)]
        if pp > 1:
            engine.train_batch(iter(micro))
        else:
            for x, y in micro:
                engine.backward(engine(x, y))
                engine.step()
    prof = engine.flops_profiler
    counted = prof.counted
    return {"report": prof.report, "forward": counted["forward"], "backward": counted["backward"],
            "tokens": counted["tokens"], "dp": mesh.dp_rank, "params": sum(p.numel() for p in GPT(cfg).parameters())}


def check(results: list[dict], replica_ranks: int) -> str:
    replica = [r for r in results if r["dp"] == 0]
    assert len(replica) == replica_ranks
    tokens = max(r["tokens"] for r in replica)
    assert tokens == MICRO * GAS * MODEL["seq_len"]
    per_token = sum(r["forward"] + r["backward"] for r in replica) / tokens
    assert per_token == pytest.approx(training_flops_per_token(), rel=0.01)
    report = results[0]["report"]
    assert all(r["report"] is None for r in results[1:])  # rank 0 writes it
    assert "Profile Summary at step 1:" in report
    line = next(x for x in report.splitlines() if x.startswith("flops per token, fwd+bwd as counted:"))
    assert float(line.split()[-2]) * 1e3 == pytest.approx(training_flops_per_token(), rel=0.01)  # "696.32 K"
    params = f"{results[0]['params'] / 1e3:.2f}".rstrip("0").rstrip(".")
    assert any(x.startswith("params of model (one replica):") and x.endswith(f" {params} K") for x in report.splitlines())
    return report


def test_tensor_parallel_ranks_sum_to_the_model(tmp_path):
    out = tmp_path / "flops.txt"
    report = check(run_on_ranks(2, profiled_run, 2, 1, 0, str(out)), replica_ranks=2)
    assert out.read_text() == report
    lines = report.splitlines()
    assert any(x.startswith("    blocks.0 (Block): ") for x in lines)  # module_depth 2
    assert not any("blocks.0.attn" in x for x in lines)
    assert any(x.startswith("  lm_head (ColumnParallelLinear): ") for x in lines)
    assert "tensor parallel size:" in report and "ranks per replica:" in report


def test_pipeline_stages_sum_to_the_model():
    report = check(run_on_ranks(2, profiled_run, 1, 2, 0, None), replica_ranks=2)
    assert "fwd+bwd latency (pipeline schedule):" in report
    assert "  (functions outside any module): " in report  # the tied output layer's matmul on stage 1
    assert any(x.startswith("  2 (PipeBlock): ") for x in report.splitlines())


def test_zero3_replicas_each_count_the_whole_model():
    """dp=2 under ZeRO-3: each rank is a replica; gathering parameters changes no FLOPs."""
    results = run_on_ranks(2, profiled_run, 1, 1, 3, None)
    check(results, replica_ranks=1)
    assert results[0]["forward"] == results[1]["forward"]
