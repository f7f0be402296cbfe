"""The GPT-2 family: its adapter (layout, positions layer, heads) and the tensor-parallel preset "gpt2"."""

from trident.models.gpt2.adapter import GPT2_PLAN, GPT2Adapter, GPT2Positions
from trident.models.transformers import register_family
from trident.tensor_parallel.plan import register_preset

register_preset("gpt2", GPT2_PLAN)
register_family(GPT2Adapter)

__all__ = ["GPT2_PLAN", "GPT2Adapter", "GPT2Positions"]
