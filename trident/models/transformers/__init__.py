"""What every `transformers` model family shares: finding the model, its decoder layout, its
pipeline stages, tensor-parallel plans, context-parallel attention, export records, and
`TransformersAdapter`, the `ModelAdapter` the family folders (`llama/`, `gpt2/`, `gpt_neox/`,
`mixtral/`) subclass. Nothing here imports `transformers` until a model needs it."""

from trident.models.transformers.adapter import TransformersAdapter, register_family, verified_model_types
from trident.models.transformers.detect import find_causal_lm, find_pretrained, find_transformers_model
from trident.models.transformers.layout import DecoderLayout, decoder_layout
from trident.models.transformers.pipeline import HFDecoderLayer, TransformersStage

__all__ = ["DecoderLayout", "HFDecoderLayer", "TransformersAdapter", "TransformersStage", "decoder_layout",
           "find_causal_lm", "find_pretrained", "find_transformers_model", "register_family", "verified_model_types"]
