"""The planner's MoE formulas: total vs active parameters, expert bytes per rank, all-to-all
volume, and MFU over active FLOPs."""

from __future__ import annotations

import pytest

from trident.models.gpt import GPT, GPTConfig
from trident.planner import Layout, Workload, estimate, make_cluster, model_from_gpt_config
from trident.planner.comm import expert_parallel_traffic, moe_all_to_all_bytes
from trident.planner.memory import StateBytes, moe_state_bytes, rank_expert_parameters, rank_parameters

CFG = dict(vocab_size=97, seq_len=16, n_layer=4, n_head=2, d_model=32, bias=True)
MOE = dict(num_experts=8, k=2, every_n_layers=2)


def test_total_and_active_parameters_count_the_built_model():
    model = GPT(GPTConfig(**CFG, moe=MOE))
    spec = model_from_gpt_config(model.config)
    assert spec.num_parameters() == model.num_parameters()
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert spec.expert_parameters() == experts
    per_expert = experts // (2 * 8)
    assert spec.active_parameters() == model.num_parameters() - 2 * (8 - 2) * per_expert


def test_active_flops_not_total():
    dense = model_from_gpt_config(GPTConfig(**CFG))
    moe = model_from_gpt_config(GPTConfig(**CFG, moe=MOE))
    mlp = 2 * 2 * 32 * 128  # fc + proj matmuls per token, 2 FLOPs per multiply-add
    # two MoE layers, each k = 2 experts (one more MLP than dense) and the d_model x E router
    assert moe.forward_flops_per_token(16)[0] - dense.forward_flops_per_token(16)[0] == 2 * (mlp + 2 * 32 * 8)


def test_expert_bytes_per_rank_are_experts_over_ep():
    spec = model_from_gpt_config(GPTConfig(**CFG, moe=MOE))
    for ep in (1, 2, 4, 8):
        assert rank_expert_parameters(spec, 1, ep) == spec.expert_parameters() / ep
        dense = spec.num_parameters() - spec.expert_parameters()
        assert rank_parameters(spec, 1, 1, ep) == dense + spec.expert_parameters() / ep
    state = StateBytes(4, 4, 0, 8)
    s = moe_state_bytes(spec, Layout(dp=2, ep=4, zero_stage=2), state)
    dense = spec.num_parameters() - spec.expert_parameters()
    experts = spec.expert_parameters() / 4
    assert s.parameters == 4 * (dense + experts)
    assert s.gradients == pytest.approx(4 * (dense / 8 + experts / 2))
    assert s.optimizer_states == pytest.approx(8 * (dense / 8 + experts / 2))


def test_all_to_all_volume():
    assert moe_all_to_all_bytes(1024, 64, 2, 4, 2) == 2 * 1024 * 64 * 2 * 2 * 3 / 4
    assert moe_all_to_all_bytes(1024, 64, 2, 1, 2) == 0
    spec = model_from_gpt_config(GPTConfig(**CFG, moe=MOE))
    w = Workload(seq_len=16, global_batch=16, precision="fp32")
    (t,) = expert_parallel_traffic(spec, Layout(dp=1, ep=2, micro_batch=8), w, make_cluster("a100-80gb", 2))
    assert t.calls == 4 * 2 and t.bytes_per_call == 8 * 16 * 2 * 32 * 4


def test_estimate_reports_active_parameters_and_ep_layout():
    spec = model_from_gpt_config(GPTConfig(**CFG, moe=MOE))
    est = estimate(spec, Layout(dp=1, ep=2, micro_batch=8), make_cluster("a100-80gb", 2),
                   Workload(seq_len=16, global_batch=16, precision="fp32"))
    d = est.to_dict()
    assert d["active_parameters"] < d["parameters"] and not est.problems
