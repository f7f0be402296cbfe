"""The `fp8` start-up report names the matmul modules torchao leaves in 16 bits (Mixtral's
stacked experts and its router), not only the filtered linear layers."""

from __future__ import annotations

import torch
import transformers

from trident.config import load_config
from trident.precision.fp8 import apply_fp8, unconverted_matmuls


def test_stacked_experts_and_router_are_reported_as_kept():
    cfg = transformers.MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=1, num_local_experts=2)
    model = transformers.MixtralForCausalLM(cfg)
    report = apply_fp8(model, load_config({"fp8": {"enabled": True, "emulate": True}}).fp8, torch.device("cpu"))
    kept = unconverted_matmuls(model, set(report.converted))
    assert set(kept) == {"model.layers.0.mlp.experts", "model.layers.0.mlp.gate"}
    assert kept["model.layers.0.mlp.experts"].startswith("MixtralExperts, not an nn.Linear")
    assert "model.embed_tokens" not in kept and "model.layers.0.self_attn.q_proj" in report.converted
