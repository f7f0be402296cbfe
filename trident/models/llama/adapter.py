"""LLaMA and the models laid out like it: Mistral, Qwen2, Qwen3.

They publish their pipeline plan (`embed_tokens`, `layers`, `norm`) and their tensor-parallel
plan (Qwen3 adds its per-head q/k norms, whose gradients are summed over tp); grouped-query
attention with fewer key/value heads than tp ranks replicates the key/value heads (the shared
`TransformersAdapter` does both). What this family adds: the preset "llama", by LLaMA's module
names, which `tensor_parallel.plan: "auto"` takes for a LLaMA that publishes no plan.
"""

from __future__ import annotations

from trident.models.transformers import TransformersAdapter
from trident.tensor_parallel.styles import Column, Row, Vocab

LLAMA_PLAN = {
    "embed_tokens": Vocab(),
    "self_attn.q_proj": Column(),
    "self_attn.k_proj": Column(),  # key/value heads must share out over tp too (or tp be a multiple of them)
    "self_attn.v_proj": Column(),
    "self_attn.o_proj": Row(),
    "mlp.gate_proj": Column(),
    "mlp.up_proj": Column(),
    "mlp.down_proj": Row(),
    "lm_head": Column(gather_output=True, pad_vocab=True),
}
"""The preset "llama": LLaMA's module names (HF LlamaForCausalLM)."""


class LlamaAdapter(TransformersAdapter):
    family = "llama"
    model_types = ("llama", "mistral", "qwen2", "qwen3")
    presets = {"llama": "llama"}
