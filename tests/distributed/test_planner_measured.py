"""Predicted model-state bytes per rank against the engine's own accounting, on 2 gloo ranks.

The planner's ZeRO formulas (trident.planner.memory) must describe what trident really holds:
after one optimizer step (Adam's moments exist from then on) `engine.memory_breakdown()` is
compared, kind by kind, with `model_state_bytes` for the reference GPT's parameter count.
fp32 master weights are counted as optimizer states, as the planner and ZeRO's paper count
them. 5% is the issue's bar; the only expected difference is ZeRO's padding of each bucket to
a multiple of the data-parallel size (at most one element per rank per bucket).
"""

from __future__ import annotations

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.planner import model_from_gpt_config, model_state_bytes, trident_state_bytes
from trident.testing.distributed import cached_mesh, run_on_ranks

GPT_SHAPE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)


def breakdown_after_one_step(stage: int, precision: str, cp: int = 1) -> dict[str, int]:
    mesh = cached_mesh(cp=cp)
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "bf16": {"enabled": precision == "bf16"},
              # every parameter partitioned: the formula has no persistent (replicated) share
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0}}
    if cp > 1:
        config["context_parallel"] = {"size": cp}
    engine, *_ = trident.initialize(model=GPT(GPT_SHAPE), config=config, mesh=mesh)
    g = torch.Generator().manual_seed(mesh.dp_rank)
    idx = torch.randint(0, GPT_SHAPE.vocab_size, (2, GPT_SHAPE.seq_len), generator=g)
    engine.backward(engine(idx, idx))
    engine.step()
    mem = dict(engine.memory_breakdown())
    mem["optimizer_states"] += mem.pop("master_weights", 0)
    return mem


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_predicted_model_states_match_memory_breakdown(stage, precision):
    psi = model_from_gpt_config(GPT_SHAPE).num_parameters()
    predicted = model_state_bytes(psi, stage, 2, trident_state_bytes(stage, precision, "adamw")).as_dict()
    for rank, measured in enumerate(run_on_ranks(2, breakdown_after_one_step, stage, precision)):
        assert set(measured) == set(predicted), f"rank {rank}: keys {sorted(measured)}"
        for kind, value in predicted.items():
            assert measured[kind] == pytest.approx(value, rel=0.05), (
                f"rank {rank}, stage {stage}, {precision}: {kind} measured {measured[kind]:,} bytes, "
                f"predicted {value:,.0f}")


@pytest.mark.parametrize("stage", [1, 3])
def test_predicted_model_states_under_context_parallelism(stage):
    """cp ranks hold the same weights: ZeRO partitions over dp x cp (here 1 x 2), as the planner says."""
    from trident.planner import Layout, Workload, make_cluster
    from trident.planner.memory import memory_estimate
    spec = model_from_gpt_config(GPT_SHAPE)
    predicted = memory_estimate(spec, Layout(dp=1, cp=2, zero_stage=stage),
                                Workload(GPT_SHAPE.seq_len, 2, "fp32", "adamw"), make_cluster("a100-80gb", 2),
                                trident_state_bytes(stage, "fp32", "adamw")).states.as_dict()
    for rank, measured in enumerate(run_on_ranks(2, breakdown_after_one_step, stage, "fp32", 2)):
        for kind, value in predicted.items():
            assert measured[kind] == pytest.approx(value, rel=0.05), (
                f"rank {rank}, stage {stage}, cp 2: {kind} measured {measured[kind]:,}, predicted {value:,.0f}")
