"""The planner's LoRA model states against a real LoRA engine's `memory_breakdown()`, on 2 ranks.

As test_planner_measured.py, with the config's `lora` section: the reference GPT frozen (its
parameter bytes only, partitioned under ZeRO-3), adapters on qkv, attn.proj, mlp.fc and
mlp.proj (the planner's default targets qkv, o, mlp) with gradients, fp32 masters (bf16) and
AdamW moments. The adapter count is the planner's `lora_parameters`, never read from the
model. 5% is the issue's bar; when this was written every kind agreed to the byte under dp,
and under tp 2 the adapters' gradients and optimizer states did too (A or B whole, the other
split, as each base layer is) while parameters were 2.9% above the prediction: the planner
divides the whole base model by tp, but LayerNorms, the position table and row-split layers'
biases stay whole on every rank, a large share of a model this small.
"""

from __future__ import annotations

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.planner import model_from_gpt_config, model_state_bytes, trident_state_bytes
from trident.planner.memory import lora_parameters
from trident.testing.distributed import cached_mesh, run_on_ranks

GPT_SHAPE = GPTConfig(vocab_size=64, seq_len=16, n_layer=2, n_head=2, d_model=32)
R = 4


def breakdown_after_one_step(stage: int, precision: str, tp: int) -> dict[str, int]:
    mesh = cached_mesh(tp=tp)
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "bf16": {"enabled": precision == "bf16"},
              "lora": {"r": R, "alpha": 8.0, "target_modules": ["qkv", "proj", "fc"]},
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
              "tensor_parallel": {"size": tp}}
    engine, *_ = trident.initialize(model=GPT(GPT_SHAPE), config=config, mesh=mesh)
    g = torch.Generator().manual_seed(mesh.dp_rank)
    idx = torch.randint(0, GPT_SHAPE.vocab_size, (2, GPT_SHAPE.seq_len), generator=g)
    engine.backward(engine(idx, idx))
    engine.step()
    return dict(engine.memory_breakdown())


def check(measured: dict, predicted: dict, kinds, what: str) -> None:
    for kind in kinds:
        assert measured[kind] == pytest.approx(predicted[kind], rel=0.05), (
            f"{what}: {kind} measured {measured[kind]:,} bytes, predicted {predicted[kind]:,.0f}")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_predicted_lora_model_states_match_memory_breakdown(stage, precision):
    spec = model_from_gpt_config(GPT_SHAPE)
    adapters = lora_parameters(spec, R)
    predicted = model_state_bytes(spec.num_parameters() + adapters, stage, 2,
                                  trident_state_bytes(stage, precision, "adamw"), trainable=adapters).as_dict()
    for rank, measured in enumerate(run_on_ranks(2, breakdown_after_one_step, stage, precision, 1)):
        assert set(measured) == set(predicted), f"rank {rank}: keys {sorted(measured)}"
        check(measured, predicted, predicted, f"rank {rank}, dp2 ZeRO-{stage}, {precision}")


@pytest.mark.parametrize("stage", [0, 1])
def test_predicted_lora_adapters_per_tp_rank(stage):
    spec = model_from_gpt_config(GPT_SHAPE)
    adapters = lora_parameters(spec, R, tp=2)
    predicted = model_state_bytes(spec.num_parameters() / 2 + adapters, stage, 1,
                                  trident_state_bytes(stage, "fp32", "adamw"), trainable=adapters).as_dict()
    for rank, measured in enumerate(run_on_ranks(2, breakdown_after_one_step, stage, "fp32", 2)):
        check(measured, predicted, predicted, f"rank {rank}, tp2 ZeRO-{stage}")
