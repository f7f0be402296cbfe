"""Where a transformers causal LM keeps its decoder layers: the layout every parallel form reads.

A base model (`model.base_model`: `LlamaModel`, `GPT2Model`, ...) holds, in order, the modules
before its decoder layers (the token embedding first), the `ModuleList` of layers, and the
modules after them (the final norm). transformers publishes this as `config.base_model_pp_plan`;
a family whose models publish none gives its layout itself (GPT-2: `trident.models.gpt2`).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class DecoderLayout:
    """Names in the base model: the modules before the decoder layers (the token embedding
    first), the layer list, the modules after it (the final norm)."""

    before: tuple[str, ...]
    layers: str
    after: tuple[str, ...]


def decoder_layout(lm: nn.Module, known: DecoderLayout | None = None) -> DecoderLayout:
    """The layout of causal LM `lm`: from its pipeline plan, else `known` (its family's), else
    an error saying why it cannot be found."""
    config, cls = lm.config, type(lm).__name__
    base = lm.base_model
    pp_plan = getattr(config, "base_model_pp_plan", None)
    if pp_plan:
        keys = list(pp_plan)
        missing = [k for k in keys if not hasattr(base, k)]
        if missing:
            raise ValueError(f"from_hf({cls}): config.base_model_pp_plan names {missing}, which "
                             f"{type(base).__name__} does not have")
        lists = [k for k in keys if isinstance(getattr(base, k), nn.ModuleList)]
        if not lists:
            raise ValueError(f"from_hf({cls}): no decoder layers found: none of the modules config.base_model_pp_plan "
                             f"names ({keys}) is an nn.ModuleList of layers in {type(base).__name__}")
        at = keys.index(lists[0])
        return DecoderLayout(tuple(keys[:at]), lists[0], tuple(keys[at + 1:]))
    if known is not None:
        return known
    raise ValueError(f"from_hf({cls}): no decoder layers found: model_type {config.model_type!r} publishes no "
                     f"pipeline plan (config.base_model_pp_plan) and no family of trident.models gives a layout "
                     f"for it (docs/models.md: a family folder can)")
