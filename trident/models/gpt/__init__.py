"""The reference GPT: the model every parallel layout is checked against (`model.py`), its
tensor-parallel plan (`plan.py`), its pipeline form (`pipe.py`, also `trident.models.gpt_pipe`)
and its `ModelAdapter` (`adapter.py`, registered here)."""

from trident.models.gpt.adapter import GPTAdapter
from trident.models.gpt.model import (GPT, GPT_PRESETS, MLP, PUBLISHED_VOCAB, Block, CausalSelfAttention, Embedding,
                                      GPTConfig, document_causal_mask)
from trident.parallel.adapter import register_adapter

register_adapter(GPTAdapter.family, GPTAdapter.find)

__all__ = ["GPT", "GPTAdapter", "GPTConfig", "GPT_PRESETS", "MLP", "PUBLISHED_VOCAB", "Block", "CausalSelfAttention",
           "Embedding", "document_causal_mask"]
