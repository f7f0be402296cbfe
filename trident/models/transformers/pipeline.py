"""Pipeline stages of an unmodified `transformers` decoder-only causal LM (`trident.pipeline.from_hf`).

The model is split into the layers of an `AdoptedPipelineModule` (trident.pipeline.adopted),
reusing its own modules and weights:

    0      token embedding                   TiedLayerSpec("embed") when the head shares its weight
    (1)    what the base model does between   GPT-2: + wpe(positions), dropout; GPT-NeoX: emb_dropout
           the embedding and the first layer  (the family's `between_layer`)
    ...    decoder layers, one per layer      class named as the model's (LlamaDecoderLayer, GPT2Block, ...)
    ...    final norm                          (model.norm, transformer.ln_f, ...)
    last   output head                        TiedLayerSpec("embed", forward_fn=head) when tied

The layout comes from the model (`layout.decoder_layout`). Only hidden states travel between
stages: each decoder-layer wrapper computes the position ids, the causal mask (transformers' own
`create_causal_mask`, or the sliding-window one for the layers `config.layer_types` /
`config.sliding_window` name) and the rotary embeddings (the base model's `rotary_emb` module)
from the hidden states' shape, once per shape on a stage. The loss is the model's own
`loss_function` (causal LM cross-entropy: labels are the input ids, shifted inside, -100
ignored), so `train_batch` takes (input_ids, input_ids) micro-batches.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from trident.models.transformers.detect import name_of
from trident.models.transformers.layout import DecoderLayout
from trident.pipeline.adopted import AdoptedPipelineModule, ModelPart
from trident.pipeline.module import LayerSpec, TiedLayerSpec


class HFEmbedding(ModelPart):
    """The token embedding; with a tied head it also holds the head (the same weight)."""

    def __init__(self, embed: tuple[str, nn.Module], head: tuple[str, nn.Module] | None = None) -> None:
        super().__init__([("embed", *embed)] + ([("head", *head)] if head is not None else []))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if input_ids.is_floating_point():
            raise TypeError(f"the first pipeline stage takes token ids (an integer tensor), got {input_ids.dtype}")
        return self.embed(input_ids)


def tied_head(part: HFEmbedding, hidden: torch.Tensor) -> torch.Tensor:
    """The output head of a model whose head shares the embedding's weight (the tied layer's
    last use): the model's own head module."""
    return part.head(hidden)


class HFSequence(ModelPart):
    """Modules applied one after the other (a final norm; GPT-NeoX's embedding dropout)."""

    def __init__(self, parts: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__([(path.rpartition(".")[2], path, module) for path, module in parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.children():
            x = module(x)
        return x


class HFHead(ModelPart):
    """An output head of its own (untied)."""

    def __init__(self, head: tuple[str, nn.Module]) -> None:
        super().__init__([("head", *head)])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


class LayerInputs:
    """What a decoder layer needs besides the hidden states, computed from their shape as the base
    model computes it; shared by a model's layer wrappers and kept for the last shape seen."""

    def __init__(self, config: Any, rotary: nn.Module | None) -> None:
        self.config = config
        self._rotary = [rotary]  # a list: not a submodule of this plain object's owners
        self._cache: dict[tuple, Any] = {}

    def mask_kind(self, index: int) -> str:
        types = getattr(self.config, "layer_types", None)
        if types:
            return types[index]
        return "sliding_attention" if getattr(self.config, "sliding_window", None) is not None else "full_attention"

    def position_ids(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._cached(("pos", hidden.shape[1], hidden.device),
                            lambda: torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0))

    def mask(self, hidden: torch.Tensor, kind: str) -> Any:
        def make() -> Any:
            from transformers import masking_utils
            fn = (masking_utils.create_sliding_window_causal_mask if kind == "sliding_attention"
                  else masking_utils.create_causal_mask)
            kwargs = {"config": self.config, "inputs_embeds": hidden, "attention_mask": None,
                      "position_ids": self.position_ids(hidden)}
            params = inspect.signature(fn).parameters
            kwargs["cache" if "cache" in params else "past_key_values"] = None
            if "cache_position" in params:  # transformers 4.x
                kwargs["cache_position"] = self.position_ids(hidden)[0]
            with torch.no_grad():
                return fn(**kwargs)
        return self._cached(("mask", kind, tuple(hidden.shape[:2]), hidden.dtype, hidden.device), make)

    def rotary(self, hidden: torch.Tensor) -> Any:
        rotary = self._rotary[0]
        if rotary is None:
            return None
        def make() -> Any:
            with torch.no_grad():
                return rotary(hidden, self.position_ids(hidden))
        return self._cached(("rope", hidden.shape[1], hidden.dtype, hidden.device), make)

    def _cached(self, key: tuple, make: Callable[[], Any]) -> Any:
        if key not in self._cache:
            if len(self._cache) > 16:
                self._cache.clear()
            self._cache[key] = make()
        return self._cache[key]


class HFDecoderLayer(ModelPart):
    """One of the model's decoder layers (and, when it has one, the base model's rotary module),
    called as the base model calls it. `split_causal_lm` names a subclass after the model's layer
    class (LlamaDecoderLayer, GPT2Block, GPTNeoXLayer), which "type:REGEX" partitions match."""

    def __init__(self, layer: tuple[str, nn.Module], index: int, inputs: LayerInputs,
                 rotary: tuple[str, nn.Module] | None = None) -> None:
        super().__init__([("layer", *layer)] + ([("rotary_emb", *rotary)] if rotary is not None else []))
        self.index = index
        self.inputs = inputs
        self.kind = inputs.mask_kind(index)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        kwargs: dict[str, Any] = {"attention_mask": self.inputs.mask(hidden, self.kind),
                                  "position_ids": self.inputs.position_ids(hidden)}
        if "rotary_emb" in self._modules:
            kwargs["position_embeddings"] = self.inputs.rotary(hidden)
        out = self.layer(hidden, **kwargs)
        return out[0] if isinstance(out, tuple) else out


_LAYER_CLASSES: dict[str, type] = {}


def layer_class(name: str) -> type:
    """A subclass of HFDecoderLayer named `name` (the model's decoder-layer class)."""
    if name not in _LAYER_CLASSES:
        _LAYER_CLASSES[name] = type(name, (HFDecoderLayer,), {"__module__": __name__, "__qualname__": name})
    return _LAYER_CLASSES[name]


class CausalLMLoss:
    """The model's own causal LM loss: `loss_function(logits, labels, vocab_size)` shifts the
    labels inside (labels are the input ids) and ignores -100."""

    def __init__(self, loss_function: Callable, vocab_size: int) -> None:
        self.loss_function, self.vocab_size = loss_function, vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)

    def loss_tokens(self, labels: torch.Tensor) -> torch.Tensor:
        """The tokens the loss is a mean over: the shifted labels other than -100."""
        return causal_lm_tokens(labels)


def causal_lm_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many tokens a transformers causal LM's loss is a mean over: its loss shifts the
    labels by one inside (the last position predicts nothing) and ignores -100."""
    return (labels[..., 1:] != -100).sum()


class TransformersStage(AdoptedPipelineModule):
    """A stage of a transformers causal LM. It keeps the model's `config` and head plan
    (`_tp_plan`), so tensor-parallel plans "hf" / "auto" find them on the stage."""

    def __init__(self, layers: Sequence[Any], num_stages: int, *, model: nn.Module, **kwargs: Any) -> None:
        super().__init__(layers, num_stages, model=model, **kwargs)
        self._tp_plan = dict(getattr(model, "_tp_plan", None) or {})

    def decoder_layers(self) -> list[tuple[str, nn.Module]]:
        """(name, the model's own layer) of each decoder-layer wrapper held here: the layer is what
        is compiled (the wrapper's mask and position cache stays eager)."""
        return [(f"{name}.layer", child.layer) for name, child in self.named_children()
                if isinstance(child, HFDecoderLayer)]


def sequence_between(parts: list[tuple[str, nn.Module]]) -> LayerSpec:
    """The layer for the base model's modules between the embedding and the first decoder layer,
    applied one after the other (GPT-NeoX's embedding dropout)."""
    return LayerSpec(HFSequence, parts)


def split_causal_lm(lm: nn.Module, layout: DecoderLayout, num_stages: int, *,
                    between: Callable[[list[tuple[str, nn.Module]]], LayerSpec] = sequence_between,
                    release: bool = True, **options: Any) -> TransformersStage:
    """This rank's stage of causal LM `lm` laid out as `layout` (see the module docstring);
    `options` as for PipelineModule (partition_method, virtual_stages, stage_id, ...)."""
    config, cls = lm.config, type(lm).__name__
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"from_hf({cls}): only decoder-only models are supported (this one has cross-attention)")
    base = lm.base_model
    prefix = name_of(lm, base) if base is not lm else ""
    path = (lambda name: f"{prefix}.{name}" if prefix else name)
    decoder = getattr(base, layout.layers)
    if len(decoder) == 0:
        raise ValueError(f"from_hf({cls}): no decoder layers found ({path(layout.layers)} is empty)")
    head = lm.get_output_embeddings()
    embed = getattr(base, layout.before[0])
    tied = getattr(head, "weight", None) is not None and head.weight is getattr(embed, "weight", None)
    embed_arg, head_arg = (path(layout.before[0]), embed), (name_of(lm, head), head)
    specs: list[Any] = [TiedLayerSpec("embed", HFEmbedding, embed_arg, head_arg) if tied
                        else LayerSpec(HFEmbedding, embed_arg)]
    if layout.before[1:]:
        specs.append(between([(path(k), getattr(base, k)) for k in layout.before[1:]]))
    rotary = getattr(base, "rotary_emb", None)
    rotary_arg = (path("rotary_emb"), rotary) if isinstance(rotary, nn.Module) else None
    inputs = LayerInputs(config, rotary if rotary_arg is not None else None)
    kind = layer_class(type(decoder[0]).__name__)
    first_decoder = len(specs)
    specs += [LayerSpec(kind, (path(f"{layout.layers}.{i}"), layer), i, inputs, rotary_arg)
              for i, layer in enumerate(decoder)]
    decoder_indices = range(first_decoder, len(specs))
    if layout.after:
        specs.append(LayerSpec(HFSequence, [(path(k), getattr(base, k)) for k in layout.after]))
    specs.append(TiedLayerSpec("embed", HFEmbedding, embed_arg, head_arg, forward_fn=tied_head) if tied
                 else LayerSpec(HFHead, head_arg))
    parts = num_stages * options.get("virtual_stages", 1)
    if isinstance(parts, int) and len(decoder) < parts:
        raise ValueError(f"from_hf({cls}): {len(decoder)} decoder layers ({path(layout.layers)}) cannot fill "
                         f"{num_stages} stage(s) x {options.get('virtual_stages', 1)} chunk(s): every stage needs "
                         f"at least one decoder layer; use fewer stages")
    loss = CausalLMLoss(lm.loss_function, config.vocab_size)
    return TransformersStage(specs, num_stages, model=lm, loss_fn=loss, decoder_indices=decoder_indices,
                             release=release, **options)
