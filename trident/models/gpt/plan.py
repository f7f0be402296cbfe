"""The reference GPT's tensor-parallel plan, written once for `GPT` and for `gpt_pipe`'s layers.

Vocabulary-parallel token table and head (the vocabulary padded to a multiple of tp, the pad
logits left out of the loss), attention split by heads (`qkv` by column: its output holds
whole heads, see `CausalSelfAttention`), the MLP column-then-row: two all-reduces forward and
two backward per block.
"""

from __future__ import annotations

from trident.tensor_parallel.plan import Column, Row, Vocab

BLOCK_PLAN = {"attn.qkv": Column(), "attn.proj": Row(), "mlp.fc": Column(), "mlp.proj": Row()}
"""A block's layers, by their names inside the block."""

MLP_PATTERNS = ("mlp.fc", "mlp.proj")
"""The dense MLP's patterns: left out when every block's MLP is a mixture of experts (the
experts stay whole on every tp rank)."""

PLAN = {"embed.wte": Vocab(), **BLOCK_PLAN, "lm_head": Column(pad_vocab=True)}
"""The whole model's layers, by their names in `GPT`."""
