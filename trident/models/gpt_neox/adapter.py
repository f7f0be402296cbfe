"""GPT-NeoX: a fused `query_key_value` projection interleaved per head, an embedding dropout.

It publishes both plans: the pipeline plan names `embed_in`, `emb_dropout` (run between the
embedding and the first layer, as the shared wrappers do for any module listed there),
`layers` and `final_layer_norm`; the tensor-parallel plan splits `query_key_value` by column,
which keeps whole heads together because its output is laid out head by head. Nothing here
differs from the shared `TransformersAdapter` but that it is a family trident has checked.
"""

from __future__ import annotations

from trident.models.transformers import TransformersAdapter


class GPTNeoXAdapter(TransformersAdapter):
    family = "gpt_neox"
    model_types = ("gpt_neox",)
