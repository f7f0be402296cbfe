"""OLMo (AllenAI's OLMo 1): LLaMA's layout with non-parametric LayerNorms and optional q/k/v clipping.

Read against the shared machinery (docs/models.md walks through this folder):
- layout: `OlmoModel.forward` runs `embed_tokens`, the `layers` (rotary embeddings computed once
  by `rotary_emb`) and `norm`, nothing else; the published pipeline plan names exactly these, so
  the shared pipeline wrappers compute what the model computes;
- tensor parallelism: the published plan splits q/k/v and the MLP by column, `o_proj` and
  `down_proj` by row, the head by vocabulary; `clip_qkv` clamps element by element, so it is
  the same on column shards; attention reads its heads from the projections' width;
- context parallelism: transformers' attention interface, as for every family;
- a config with a `pad_token_id` builds the embedding with a `padding_idx`, which the
  vocabulary-parallel embedding refuses under tp (for every family): set it to None to split it;
- sequence parallelism: refused by the shared check, since its norms hold no weights to find the
  final norm by (`sequence_parallel_layout`).
Nothing differs from `TransformersAdapter` but that the family is checked, so this is all.
"""

from __future__ import annotations

from trident.models.transformers import TransformersAdapter


class OlmoAdapter(TransformersAdapter):
    family = "olmo"
    model_types = ("olmo",)
