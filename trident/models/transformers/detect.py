"""Finding the transformers model inside a trident model, without importing `transformers`.

A user hands trident a transformers model, or a module of their own holding one (e.g. a
wrapper returning the loss), or a pipeline stage split from one. These functions look for it
by what it has (duck typing) or, where only a real `PreTrainedModel` will do, through
`sys.modules`: nothing here imports transformers.
"""

from __future__ import annotations

import sys

from torch import nn


def is_transformers_model(model: nn.Module) -> bool:
    """A module with a transformers config (a `PreTrainedModel`, or a pipeline stage keeping one)."""
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "model_type") and hasattr(config, "to_dict")


def find_transformers_model(model: nn.Module) -> nn.Module | None:
    """`model` itself if it is a transformers model, else the outermost one inside it (a user's
    wrapper that returns the loss), else None."""
    return next((m for m in model.modules() if is_transformers_model(m)), None)


def is_causal_lm(model: nn.Module) -> bool:
    """A transformers model with an output head (duck-typed: transformers need not be imported)."""
    config = getattr(model, "config", None)
    get_head = getattr(model, "get_output_embeddings", None)
    return (config is not None and hasattr(config, "model_type") and callable(get_head)
            and isinstance(get_head(), nn.Module))


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """`model` if it is a transformers causal LM, else the outermost one inside it, else None."""
    return next((m for m in model.modules() if is_causal_lm(m)), None)


def find_pretrained(module: nn.Module) -> tuple[str, nn.Module] | None:
    """(name, module) of the outermost transformers PreTrainedModel inside `module` (itself
    included), or None. transformers is only looked at if it is already imported."""
    pretrained = getattr(sys.modules.get("transformers"), "PreTrainedModel", None)
    if pretrained is None:
        return None
    for name, sub in module.named_modules():  # pre-order: the outermost first
        if isinstance(sub, pretrained):
            return name, sub
    return None


def name_of(model: nn.Module, target: nn.Module) -> str:
    """The name of submodule `target` in `model` ("" for `model` itself)."""
    return next(name for name, m in model.named_modules() if m is target)
