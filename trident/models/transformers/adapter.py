"""`TransformersAdapter`: the `ModelAdapter` every transformers family shares.

A family folder (`trident.models.llama`, `gpt2`, ...) subclasses it, says which
`config.model_type`s it covers and overrides what its models do differently (a layout for
models that publish no pipeline plan, a tensor-parallel preset, head counts to localize), then
registers the subclass with `register_family`. Any other transformers model gets this class
itself as the fallback: tensor parallelism by its published plan, context parallelism through
transformers' attention interface, and a pipeline split only with `trust_layout=True` (its base
model may compute more between its modules than the wrappers here do).

The adapter is bound to `root`, the module trident was given: a transformers model, a wrapper
holding one (a module returning the loss), or a pipeline stage split from one
(`TransformersStage`, which keeps the model's config).
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import nn

import trident.models.transformers.context_parallel as context_parallel
import trident.models.transformers.export as export
import trident.models.transformers.tensor_parallel as tensor_parallel
from trident.models.transformers.detect import find_causal_lm, find_pretrained, find_transformers_model, name_of
from trident.models.transformers.layout import DecoderLayout, decoder_layout
from trident.models.transformers.pipeline import TransformersStage, causal_lm_tokens, sequence_between, split_causal_lm
from trident.monitor.log import logger
from trident.parallel.adapter import register_adapter
from trident.pipeline.adopted import hf_names
from trident.pipeline.module import LayerSpec

_FAMILIES: list[type["TransformersAdapter"]] = []


class TransformersAdapter:
    """The adapter of the outermost transformers model inside `root` (see the module docstring)."""

    family = "transformers"
    model_types: tuple[str, ...] = ()
    """The `config.model_type`s this family covers (checked: their base models compute nothing
    between the modules the layout names but what the pipeline wrappers do); () = any (the fallback)."""
    layout: DecoderLayout | None = None
    """The layout of models that publish no pipeline plan (`config.base_model_pp_plan`)."""
    presets: Mapping[str, str] = {}
    """model_type -> the trident.tensor_parallel preset plan "auto" takes when the model publishes none."""

    def __init__(self, root: nn.Module, model: nn.Module) -> None:
        self.root, self.model = root, model
        self.lm = find_causal_lm(root)

    @classmethod
    def find(cls, root: nn.Module) -> "TransformersAdapter | None":
        model = find_transformers_model(root)
        if model is None or (cls.model_types and model.config.model_type not in cls.model_types):
            return None
        return cls(root, model)

    # -- layers ---------------------------------------------------------------------------------

    def decoder_layout(self) -> DecoderLayout:
        if self.lm is None:
            raise ValueError(f"{type(self.root).__name__} holds no transformers causal LM")
        return decoder_layout(self.lm, self.layout)

    def decoder_layers(self) -> list[tuple[str, nn.Module]]:
        if isinstance(self.model, TransformersStage):
            return self.model.decoder_layers()
        try:
            layers = getattr(self.lm.base_model, self.decoder_layout().layers)
        except ValueError:
            return []
        prefix = name_of(self.root, layers)
        return [(f"{prefix}.{i}", layer) for i, layer in enumerate(layers)]

    def embedding_and_head(self) -> tuple[str, str]:
        layout = self.decoder_layout()  # raises when there is no causal LM
        embed = getattr(self.lm.base_model, layout.before[0])
        return name_of(self.root, embed), name_of(self.root, self.lm.get_output_embeddings())

    # -- tensor parallelism -----------------------------------------------------------------------

    def published_plan(self) -> dict[str, str]:
        """The model's own plan as this family reads it."""
        return tensor_parallel.published_plan(self.model)

    def tensor_parallel_plan(self, which: str, tp: int) -> dict[str, Any]:
        return tensor_parallel.plan_for(self.model, which, tp, self.presets, self.published_plan())

    def check_tensor_parallel(self, tp: int) -> None:
        self.localize_heads(tp, dry_run=True)

    def localize_tensor_parallel(self, tp: int) -> None:
        self.localize_heads(tp)

    def localize_heads(self, tp: int, dry_run: bool = False) -> list[str]:
        """Make each tp-split attention module count its local heads; the names of those changed."""
        return tensor_parallel.localize_heads(self.root, tp, dry_run)

    def sequence_parallel_layout(self) -> Any:
        return tensor_parallel.sequence_parallel_layout(self.root, self.layout)

    # -- context parallelism ----------------------------------------------------------------------

    def parallelize_context(self, cp: Any) -> bool:
        if self.lm is None:
            return False
        context_parallel.parallelize_transformers(self.root, cp)
        return True

    # -- pipeline ---------------------------------------------------------------------------------

    def between_layer(self, parts: list[tuple[str, nn.Module]]) -> LayerSpec:
        """The pipeline layer for the base model's modules between the embedding and the first
        decoder layer (GPT-NeoX's embedding dropout; GPT-2's family adds the positions)."""
        return sequence_between(parts)

    def split_pipeline(self, num_stages: int, *, trust_layout: bool = False, release: bool = True,
                       **options: Any) -> nn.Module | None:
        if self.lm is None:
            return None
        model_type, cls = self.lm.config.model_type, type(self.lm).__name__
        if not self.model_types and not trust_layout:
            raise ValueError(f"from_hf({cls}): model_type {model_type!r} is not one trident has checked (its base "
                             f"model may compute more than its modules between them, e.g. scale the embeddings); "
                             f"verified: {list(verified_model_types())}. Pass trust_layout=True after checking its "
                             f"forward()")
        return split_causal_lm(self.lm, self.decoder_layout(), num_stages, between=self.between_layer,
                               release=release, **options)

    # -- names and export ---------------------------------------------------------------------------

    def state_dict_names(self) -> dict[str, str]:
        if isinstance(self.model, TransformersStage):
            return hf_names(self.model)
        prefix = name_of(self.root, self.model)
        prefix = f"{prefix}." if prefix else ""
        return {k: k[len(prefix):] for k in self.root.state_dict() if k.startswith(prefix)}

    def export_root(self) -> tuple[str, nn.Module] | None:
        return None if isinstance(self.model, TransformersStage) else find_pretrained(self.root)

    def export_record(self) -> dict | None:
        try:
            if isinstance(self.model, TransformersStage):
                return export.stage_record(self.model, self._split_whole)
            return export.model_record(self.root)
        except Exception as err:  # never fail a checkpoint over it: export-hf then asks for --config
            logger.warning("checkpoint manifest: could not record the transformers config (%s); `trident checkpoint "
                        "export-hf` will need --config", err)
            return None

    def loss_tokens(self, args: tuple, kwargs: dict) -> Any:
        labels = kwargs.get("labels")
        if self.lm is None or self.root is not self.lm or labels is None:
            return None  # a wrapper's arguments are its own; no labels, no loss
        if kwargs.get("num_items_in_batch") is not None:
            return None  # the loss is already a sum over the window's global count (transformers' Trainer)
        return causal_lm_tokens(labels)

    def _split_whole(self, skeleton: nn.Module) -> TransformersStage:
        return type(self)(skeleton, skeleton).split_pipeline(1, stage_id=0, release=False, trust_layout=True)


def register_family(cls: type[TransformersAdapter]) -> type[TransformersAdapter]:
    """Register a transformers family's adapter (a class decorator for the family's subclass)."""
    _FAMILIES.append(cls)
    register_adapter(cls.family, cls.find)
    return cls


def verified_model_types() -> tuple[str, ...]:
    """Every model type a registered family covers."""
    return tuple(t for cls in _FAMILIES for t in cls.model_types)


register_adapter(TransformersAdapter.family, TransformersAdapter.find, fallback=True)
