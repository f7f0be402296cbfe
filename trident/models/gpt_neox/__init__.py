"""The GPT-NeoX family (Pythia, GPT-NeoX-20B): its adapter."""

from trident.models.gpt_neox.adapter import GPTNeoXAdapter
from trident.models.transformers import register_family

register_family(GPTNeoXAdapter)

__all__ = ["GPTNeoXAdapter"]
