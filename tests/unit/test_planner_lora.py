"""The planner's LoRA arithmetic: frozen parameters cost parameter bytes only, adapters cost a
full model's bytes per parameter, and the adapter count is r (in + out) per adapted layer, split
over tp as trident.peft splits it. No processes: tests/distributed/test_planner_lora_measured.py
holds the same formulas against a real engine's memory_breakdown()."""

from __future__ import annotations

import json

import pytest

from trident.cli.plan import main
from trident.models.gpt import GPT, GPTConfig
from trident.peft import apply_lora
from trident.planner import (Layout, StateBytes, Workload, estimate, make_cluster, model_from_gpt_config,
                             model_preset, model_state_bytes, zero_state_table)
from trident.planner.memory import lora_layer_parameters, lora_parameters, rank_parameter_counts

MIXED = StateBytes(2, 2, 4, 8)  # bf16 weights and gradients, fp32 masters, Adam's two moments


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_frozen_parameters_cost_their_parameter_bytes_only(stage):
    psi, trainable, n = 7e9, 40e6, 8
    got = model_state_bytes(psi, stage, n, MIXED, trainable=trainable)
    assert got.parameters == pytest.approx(2 * psi / (n if stage == 3 else 1))  # frozen ones partitioned too
    assert got.gradients == pytest.approx(2 * trainable / (n if stage >= 2 else 1))
    assert got.optimizer_states == pytest.approx(12 * trainable / (n if stage >= 1 else 1))
    assert model_state_bytes(psi, stage, n, MIXED, trainable=psi) == model_state_bytes(psi, stage, n, MIXED)


def test_trainable_out_of_range_is_named():
    with pytest.raises(ValueError, match="trainable parameters must be between 0 and the 100 parameters, got 101"):
        model_state_bytes(100, 0, 1, MIXED, trainable=101)


def test_adapter_counts_match_peft_s_printouts_for_llama_7b():
    """peft's `print_trainable_parameters()` on LLaMA-7B (d 4096, d_ff 11008, 32 layers):
    r=8 on q_proj, v_proj gives 4,194,304; r=16 on every linear layer of the blocks 39,976,960."""
    llama = model_preset("llama-7b")
    assert lora_parameters(llama, 8, ("q", "v")) == 4_194_304
    assert lora_parameters(llama, 16, ("q", "k", "v", "o", "mlp")) == 39_976_960


def test_adapter_count_of_the_reference_gpt_equals_apply_lora_s():
    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layer=3, n_head=4, d_model=64)
    for r in (1, 8):
        model = apply_lora(GPT(cfg), r=r)  # default targets qkv, proj, fc: the planner's qkv, o, mlp
        real = sum(p.numel() for p in model.parameters() if p.requires_grad)
        assert lora_parameters(model_from_gpt_config(cfg), r) == real


def test_adapters_split_over_tp_as_their_base_layers():
    """Column-split layers keep A (r x in) whole and split B; row-split ones split A and keep B."""
    cfg = GPTConfig(vocab_size=512, seq_len=32, n_layer=2, n_head=4, d_model=64)
    spec, r, h = model_from_gpt_config(cfg), 4, 64
    per_layer = r * (h + 3 * h / 2) + r * (h / 2 + h) + r * (h + 4 * h / 2) + r * (4 * h / 2 + h)
    assert lora_layer_parameters(spec, r, tp=2) == per_layer
    assert lora_parameters(spec, r, tp=2, pp=2) == per_layer  # one layer on the busiest of two stages


def test_estimate_with_lora_prices_states_traffic_and_optimizer_for_the_adapters_only():
    model, cluster = model_preset("llama-7b"), make_cluster("a100-80gb", 8)
    layout = Layout(dp=8, zero_stage=2, micro_batch=1, activation_checkpointing="full")
    full = estimate(model, layout, cluster, Workload(2048, 32))
    lora = estimate(model, layout, cluster, Workload(2048, 32, lora_r=16))
    psi, trainable = rank_parameter_counts(model, layout, lora.workload)
    assert trainable == lora_parameters(model, 16) and psi == model.num_parameters() + trainable
    assert lora.memory.states.parameters == pytest.approx(2 * psi)
    assert lora.memory.states.gradients == pytest.approx(2 * trainable / 8)
    assert lora.memory.states.optimizer_states == pytest.approx(12 * trainable / 8)
    assert lora.memory.states.total == pytest.approx(2 * model.num_parameters(), rel=0.01)  # the frozen weights
    grads = {t.op: t.bytes_per_call for t in lora.traffic if t.what == "gradients"}
    assert grads == {"reduce_scatter": pytest.approx(2 * trainable)}
    assert lora.time.optimizer == pytest.approx(full.time.optimizer * trainable / model.num_parameters())
    assert "LoRA     r=16 on qkv,o,mlp: 35,782,656 trainable" in lora.format()


def test_state_table_takes_a_trainable_count():
    rows = zero_state_table(7e9, 8, 8, trainable=7e7)
    stage2 = next(r for r in rows if (r.stage, r.offload_optimizer) == (2, "none"))
    assert stage2.device_per_gpu == pytest.approx(2 * 7e9 + 14 * 7e7 / 8)


@pytest.mark.parametrize("kwargs,message", [
    (dict(lora_r=-1), "lora_r must be a non-negative integer"),
    (dict(lora_r=8, lora_targets=("qkv", "gate")), r"lora_targets \['qkv', 'gate'\]: each must be one of"),
    (dict(lora_r=8, lora_targets=("qkv", "q")), "name either it or q/k/v, not both"),
])
def test_bad_lora_workload_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Workload(2048, 32, **kwargs)


def test_plan_command_with_lora(tmp_path, capsys):
    assert main(["--model", "llama-7b", "--gpus", "8", "--lora-r", "16", "--lora-targets", "q,k,v,o,mlp",
                 "--top", "1"]) == 0
    assert "LoRA r=16 on q,k,v,o,mlp" in capsys.readouterr().out
    cfg = tmp_path / "lora.json"
    cfg.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
                               "zero_optimization": {"stage": 2}, "lora": {"r": 8}}))
    assert main(["--model", "llama-7b", "--gpus", "8", "--config", str(cfg), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["workload"]["lora_r"] == 8
    assert data["rank_parameters_trainable"] == lora_parameters(model_preset("llama-7b"), 8)
    assert main(["--params", "7e9", "--gpus", "8", "--lora-r", "8"]) == 2
    assert "--lora-r needs the model's shape" in capsys.readouterr().err
