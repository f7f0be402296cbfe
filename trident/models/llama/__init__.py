"""The LLaMA family (LLaMA, Mistral, Qwen2, Qwen3): its adapter and the tensor-parallel preset "llama"."""

from trident.models.llama.adapter import LLAMA_PLAN, LlamaAdapter
from trident.models.transformers import register_family
from trident.tensor_parallel.plan import register_preset

register_preset("llama", LLAMA_PLAN)
register_family(LlamaAdapter)

__all__ = ["LLAMA_PLAN", "LlamaAdapter"]
