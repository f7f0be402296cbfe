"""The `fp8` start-up report names the matmul modules torchao leaves in 16 bits: `transformers`'
Conv1D (GPT-2) and experts stacked in 3-D tensors (Mixtral), not only the filtered linear layers."""

from __future__ import annotations

import torch
import transformers

import trident
from tests.parity.test_tp_hf import make, tokens
from trident.config import load_config
from trident.precision.fp8 import apply_fp8, unconverted_matmuls
from trident.testing.distributed import cached_mesh, run_on_ranks


def gpt2_report():
    cfg = {"train_micro_batch_size_per_gpu": 4, "steps_per_print": 0,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}}, "fp8": {"enabled": True, "emulate": True}}
    engine, *_ = trident.initialize(model=make("gpt2"), config=cfg, mesh=cached_mesh())
    engine.backward(engine(tokens()[:4]))
    engine.step()
    return engine.fp8_report


def test_gpt2_conv1d_layers_are_reported_as_kept():
    (report,) = run_on_ranks(1, gpt2_report)
    assert report.converted == ["lm.lm_head"]
    conv1d = {n for n, why in report.kept.items() if why.startswith("Conv1D, not an nn.Linear")}
    assert conv1d == {f"lm.transformer.h.{i}.{m}" for i in range(2)
                      for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")}
    assert "kept in the compute dtype: lm.transformer.h.*.attn.c_attn (x2)" in report.describe()


def test_stacked_experts_and_router_are_reported_as_kept():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    model = transformers.MixtralForCausalLM(cfg)
    report = apply_fp8(model, load_config({"fp8": {"enabled": True, "emulate": True}}).fp8, torch.device("cpu"))
    kept = unconverted_matmuls(model, set(report.converted))
    assert set(kept) == {"model.layers.0.mlp.experts", "model.layers.0.mlp.gate"}
    assert kept["model.layers.0.mlp.experts"].startswith("MixtralExperts, not an nn.Linear")
    assert "model.embed_tokens" not in kept and "model.layers.0.self_attn.q_proj" in report.converted
