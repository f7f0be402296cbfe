"""Pipeline parallelism for unmodified `transformers` decoder-only models.

    pipe = trident.pipeline.from_hf(model, num_stages=2, partition_method="type:DecoderLayer")

splits a causal LM (LLaMA, Mistral, Qwen2/3, GPT-NeoX, GPT-2) into the layers of a
`PipelineModule`, reusing the model's own modules and weights:

    0      token embedding                   TiedLayerSpec("embed") when the head shares its weight
    (1)    what the base model does between   GPT-2: + wpe(positions), dropout; GPT-NeoX: emb_dropout
           the embedding and the first layer
    ...    decoder layers, one per layer      class named as the model's (LlamaDecoderLayer, GPT2Block, ...)
    ...    final norm                          (model.norm, transformer.ln_f, ...)
    last   output head                        TiedLayerSpec("embed", forward_fn=head) when tied

The layout comes from `config.base_model_pp_plan` (embedding(s), the decoder `ModuleList`, the
final norm, in order), or for GPT-2 (which publishes none) from its known module names. Only
hidden states travel between stages: each decoder-layer wrapper computes the position ids, the
causal mask (transformers' own `create_causal_mask`, or the sliding-window one for the layers
`config.layer_types` / `config.sliding_window` name) and the rotary embeddings (the base model's
`rotary_emb` module) from the hidden states' shape, once per shape on a stage. The loss is the
model's own `loss_function` (causal LM cross-entropy: labels are the input ids, shifted inside,
-100 ignored), so `train_batch` takes (input_ids, input_ids) micro-batches.

Parameter names map back to the model's state-dict names (`hf_names`, `hf_state_dict`,
`hf_shard_specs`, `load_hf_state_dict`), and a stage keeps the model's `config` and tensor-parallel
plan, so `trident.tensor_parallel.parallelize(stage, "hf", mesh)` matches the model's own module
names on each stage (patterns that match other stages' modules only are not errors there).

`from_hf` takes the model's modules over: the stage's layers are the model's module objects, and
(by default) modules on other stages are moved to the meta device to free their memory, so build
each stage from its own copy of the model (every rank builds the same model from the same seed).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch
from torch import nn

from trident.pipeline.module import LayerSpec, PipelineModule, TiedLayerSpec, _params_to_buffers

VERIFIED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gpt_neox", "gpt2")
"""Model types whose base model does nothing between the modules its pp plan names but what the
wrappers here do (GPT-2: the position table and dropout). Others (e.g. Gemma, which scales the
embeddings) need `trust_layout=True` after checking."""

_GPT2_LAYOUT = {"gpt2": (("wte",), ("wpe", "drop"), "h", ("ln_f",))}  # models without a pp plan


# -- the layers -----------------------------------------------------------------------------------

class HFPart(nn.Module):
    """Some of a transformers model's own modules, under role names; `hf_paths` maps each child's
    name to the module's name in the model (for state-dict names and tensor-parallel plans)."""

    def __init__(self, parts: Sequence[tuple[str, str, nn.Module]]) -> None:
        super().__init__()
        self.hf_paths: dict[str, str] = {}
        for child, path, module in parts:
            self.add_module(child, module)
            self.hf_paths[child] = path


class HFEmbedding(HFPart):
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


class HFSequence(HFPart):
    """Modules applied one after the other (a final norm; GPT-NeoX's embedding dropout)."""

    def __init__(self, parts: Sequence[tuple[str, nn.Module]]) -> None:
        super().__init__([(path.rpartition(".")[2], path, module) for path, module in parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for module in self.children():
            x = module(x)
        return x


class HFHead(HFPart):
    """An output head of its own (untied)."""

    def __init__(self, head: tuple[str, nn.Module]) -> None:
        super().__init__([("head", *head)])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)


class GPT2Positions(HFPart):
    """GPT-2's step between the token embedding and the first block: + wpe(positions), dropout."""

    def __init__(self, wpe: tuple[str, nn.Module], drop: tuple[str, nn.Module]) -> None:
        super().__init__([("wpe", *wpe), ("drop", *drop)])

    def forward(self, inputs_embeds: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device).unsqueeze(0)
        return self.drop(inputs_embeds + self.wpe(positions).to(inputs_embeds.device))


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


class HFDecoderLayer(HFPart):
    """One of the model's decoder layers (and, when it has one, the base model's rotary module),
    called as the base model calls it. `from_hf` names a subclass after the model's layer class
    (LlamaDecoderLayer, GPT2Block, GPTNeoXLayer), which "type:REGEX" partitions match."""

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


def _layer_class(name: str) -> type:
    """A subclass of HFDecoderLayer named `name` (the model's decoder-layer class)."""
    if name not in _LAYER_CLASSES:
        _LAYER_CLASSES[name] = type(name, (HFDecoderLayer,), {"__module__": __name__,
                                                             "__qualname__": name})
    return _LAYER_CLASSES[name]


class CausalLMLoss:
    """The model's own causal LM loss: `loss_function(logits, labels, vocab_size)` shifts the
    labels inside (labels are the input ids) and ignores -100."""

    def __init__(self, loss_function: Callable, vocab_size: int) -> None:
        self.loss_function, self.vocab_size = loss_function, vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits=logits, labels=labels, vocab_size=self.vocab_size)


# -- the pipeline module --------------------------------------------------------------------------

class HFPipelineModule(PipelineModule):
    """A stage of a transformers causal LM split by `from_hf` (see the module docstring).

    `config` and `_tp_plan` are the model's, so tensor-parallel plans "hf" / "auto" find them.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int, *, model: nn.Module, loss_fn: Callable,
                 decoder_indices: Sequence[int], release: bool = True, **kwargs: Any) -> None:
        super().__init__(layers, num_stages, loss_fn=loss_fn, **kwargs)
        self.config = model.config
        self.hf_class = type(model).__name__
        self._tp_plan = dict(getattr(model, "_tp_plan", None) or {})
        self._hf_module_names = [name for name, _ in model.named_modules() if name]
        self._check_stages(decoder_indices)
        if release:
            self._release_other_stages()

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> "HFPipelineModule":
        """`.to()` replaces each module's buffers separately: a tied copy held by two modules (the
        embedding and the head) is made one tensor again."""
        first: dict[int, tuple[nn.Module, str]] = {}
        shared = []
        for sub in self.modules():
            for name, buf in sub._buffers.items():
                if buf is not None:
                    if id(buf) in first:
                        shared.append((sub, name, *first[id(buf)]))
                    else:
                        first[id(buf)] = (sub, name)
        out = super()._apply(fn, *args, **kwargs)
        for sub, name, src, src_name in shared:
            sub._buffers[name] = src._buffers[src_name]
        return out

    # -- names ------------------------------------------------------------------------------

    def hf_key(self, name: str) -> str | None:
        """The model's name for this stage's module / parameter / buffer `name` (None for wrappers)."""
        parts = name.split(".")
        if parts[0] == "tied_modules" and len(parts) > 1:
            wrapper, rest = self.tied_modules[parts[1]] if parts[1] in self.tied_modules else None, parts[2:]
        else:
            wrapper, rest = self._modules.get(parts[0]), parts[1:]
        if not isinstance(wrapper, HFPart) or not rest or rest[0] not in wrapper.hf_paths:
            return None
        return ".".join(p for p in (wrapper.hf_paths[rest[0]], *rest[1:]) if p)

    def plan_module_names(self) -> tuple[dict[str, str], list[str]]:
        """For `trident.tensor_parallel.apply_plan`: this stage's module names -> the model's ("" for
        the wrappers), and every module name of the whole model (a pattern may match other stages)."""
        rename = {name: self.hf_key(name) or "" for name, _ in self.named_modules()}
        return rename, self._hf_module_names

    def after_tensor_parallel(self) -> None:
        """After `apply_plan` replaced modules of a tied layer this stage holds as a copy: the new
        layers' parameters become buffers again (the copy is not trained here; see PipelineModule)."""
        for key, module in self.tied_modules.items():
            if self.owns(key):
                continue
            keep = set(self._copies.get(key, ())) | set(_params_to_buffers(module))
            names, seen = [], set()
            for prefix, sub in module.named_modules():  # the owner's parameters() order, shared ones once
                for name, buf in sub._buffers.items():
                    full = f"{prefix}.{name}" if prefix else name
                    if full in keep and buf is not None and id(buf) not in seen:
                        seen.add(id(buf))
                        names.append(full)
            self._copies[key] = names

    # -- checks and memory ------------------------------------------------------------------

    def _check_stages(self, decoder_indices: Sequence[int]) -> None:
        decoders = set(decoder_indices)
        for vs in range(self.num_stages * self.virtual_stages):
            layers = self.virtual_stage_layers(vs)
            if not decoders.intersection(layers):
                chunk, stage = divmod(vs, self.num_stages)
                where = f"stage {stage}" + (f" chunk {chunk}" if self.virtual_stages > 1 else "")
                raise ValueError(f"from_hf({self.hf_class}): partition_method {self.partition_method!r} leaves "
                                 f"{where} without a decoder layer (it holds layers {layers.start}-{layers.stop - 1} "
                                 f"of {self.num_layers}, {len(decoders)} of them decoder layers); use fewer "
                                 f"stages, or a partition such as \"type:{self._decoder_class_name()}\"\n"
                                 f"{self.describe_partition()}")

    def _decoder_class_name(self) -> str:
        return next((s.typename.__name__ for s in self._specs if isinstance(s, LayerSpec)
                     and issubclass(s.typename, HFDecoderLayer)), "DecoderLayer")

    def _release_other_stages(self) -> None:
        """Move the model's modules that only other stages use to the meta device (frees them)."""
        held = {id(t) for t in (*self.parameters(), *self.buffers())}
        held_modules = {id(m) for m in self.modules()}
        for idx, spec in enumerate(self._specs):
            if idx in self._funcs or not isinstance(spec, LayerSpec):
                continue
            args = [*spec.module_args, *spec.module_kwargs.values()]
            pairs = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])]
            for pair in pairs:
                module = pair[1] if isinstance(pair, tuple) and len(pair) == 2 else None
                if not isinstance(module, nn.Module) or id(module) in held_modules:
                    continue
                if any(id(t) in held for t in (*module.parameters(), *module.buffers())):
                    continue
                module.to("meta")


# -- building ---------------------------------------------------------------------------------------

def is_causal_lm(model: nn.Module) -> bool:
    """A transformers model with an output head (duck-typed: transformers need not be imported)."""
    config = getattr(model, "config", None)
    get_head = getattr(model, "get_output_embeddings", None)
    return (config is not None and hasattr(config, "model_type") and callable(get_head)
            and isinstance(get_head(), nn.Module))


def find_causal_lm(model: nn.Module) -> nn.Module | None:
    """`model` if it is a transformers causal LM, else the outermost one inside it, else None."""
    return next((m for m in model.modules() if is_causal_lm(m)), None)


def _name_of(model: nn.Module, target: nn.Module) -> str:
    return next(name for name, m in model.named_modules() if m is target)


def _layout(model: nn.Module) -> tuple[list[str], str, list[str]]:
    """(names of the base model's modules before the decoder layers, of the layer list, after it)."""
    config, cls = model.config, type(model).__name__
    base = model.base_model
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
        return keys[:at], lists[0], keys[at + 1:]
    if config.model_type in _GPT2_LAYOUT:
        embed, extra, layers, post = _GPT2_LAYOUT[config.model_type]
        return [*embed, *extra], layers, list(post)
    raise ValueError(f"from_hf({cls}): no decoder layers found: model_type {config.model_type!r} publishes no "
                     f"pipeline plan (config.base_model_pp_plan) and trident knows no layout for it (known without "
                     f"a plan: {sorted(_GPT2_LAYOUT)})")


def from_hf(model: nn.Module, num_stages: int, partition_method: str = "parameters", virtual_stages: int = 1,
            activation_checkpoint_interval: int = 0, stage_id: int | None = None, *,
            trust_layout: bool = False, release: bool = True) -> HFPipelineModule:
    """Split a transformers decoder-only causal LM into a `PipelineModule` (see the module docstring).

    `model` is the causal LM (e.g. `LlamaForCausalLM`), or a module holding one (its other code is
    not used). `partition_method` as for PipelineModule; "type:DecoderLayer" (LLaMA-like),
    "type:GPT2Block" or "type:GPTNeoXLayer" balance the decoder layers. `trust_layout=True` accepts
    a model type outside VERIFIED_MODEL_TYPES. `release=False` keeps other stages' modules in memory.
    """
    lm = find_causal_lm(model)
    if lm is None:
        raise ValueError(f"from_hf: {type(model).__name__} is not (and holds no) transformers causal LM with an "
                         f"output head (get_output_embeddings()); give e.g. a LlamaForCausalLM")
    model = lm
    config, cls = model.config, type(model).__name__
    if config.model_type not in VERIFIED_MODEL_TYPES and not trust_layout:
        raise ValueError(f"from_hf({cls}): model_type {config.model_type!r} is not one trident has checked (its base "
                         f"model may compute more than its modules between them, e.g. scale the embeddings); "
                         f"verified: {list(VERIFIED_MODEL_TYPES)}. Pass trust_layout=True after checking its "
                         f"forward()")
    if getattr(config, "is_encoder_decoder", False) or getattr(config, "add_cross_attention", False):
        raise ValueError(f"from_hf({cls}): only decoder-only models are supported (this one has cross-attention)")
    base = model.base_model
    prefix = _name_of(model, base) if base is not model else ""
    path = (lambda name: f"{prefix}.{name}" if prefix else name)
    before, layers_key, after = _layout(model)
    decoder = getattr(base, layers_key)
    if len(decoder) == 0:
        raise ValueError(f"from_hf({cls}): no decoder layers found ({path(layers_key)} is empty)")
    head = model.get_output_embeddings()
    head_name = _name_of(model, head)
    embed = getattr(base, before[0])
    tied = getattr(head, "weight", None) is not None and head.weight is getattr(embed, "weight", None)

    specs: list[Any] = []
    embed_arg, head_arg = (path(before[0]), embed), (head_name, head)
    if tied:
        specs.append(TiedLayerSpec("embed", HFEmbedding, embed_arg, head_arg))
    else:
        specs.append(LayerSpec(HFEmbedding, embed_arg))
    extra = before[1:]
    if extra:
        modules = [(path(k), getattr(base, k)) for k in extra]
        if config.model_type in _GPT2_LAYOUT:
            specs.append(LayerSpec(GPT2Positions, *modules))
        else:
            specs.append(LayerSpec(HFSequence, modules))
    rotary = getattr(base, "rotary_emb", None)
    rotary_arg = (path("rotary_emb"), rotary) if isinstance(rotary, nn.Module) else None
    inputs = LayerInputs(config, rotary if rotary_arg is not None else None)
    layer_cls = _layer_class(type(decoder[0]).__name__)
    first_decoder = len(specs)
    for i, layer in enumerate(decoder):
        specs.append(LayerSpec(layer_cls, (path(f"{layers_key}.{i}"), layer), i, inputs, rotary_arg))
    decoder_indices = range(first_decoder, len(specs))
    if after:
        specs.append(LayerSpec(HFSequence, [(path(k), getattr(base, k)) for k in after]))
    if tied:
        specs.append(TiedLayerSpec("embed", HFEmbedding, embed_arg, head_arg, forward_fn=tied_head))
    else:
        specs.append(LayerSpec(HFHead, head_arg))
    parts = num_stages * virtual_stages
    if isinstance(parts, int) and len(decoder) < parts:
        raise ValueError(f"from_hf({cls}): {len(decoder)} decoder layers ({path(layers_key)}) cannot fill "
                         f"{num_stages} stage(s) x {virtual_stages} chunk(s): every stage needs at least one "
                         f"decoder layer; use fewer stages")
    loss = CausalLMLoss(model.loss_function, config.vocab_size)
    return HFPipelineModule(specs, num_stages, model=model, loss_fn=loss, decoder_indices=decoder_indices,
                            release=release, partition_method=partition_method, virtual_stages=virtual_stages,
                            activation_checkpoint_interval=activation_checkpoint_interval, stage_id=stage_id)


# -- names and weights --------------------------------------------------------------------------------

def hf_names(pipe: HFPipelineModule) -> dict[str, str]:
    """This stage's state-dict key -> the model's state-dict key (a tied weight appears under both
    of the model's names: the embedding's and the head's)."""
    return {k: pipe.hf_key(k) for k in pipe.state_dict() if pipe.hf_key(k) is not None}


def hf_state_dict(pipe: HFPipelineModule) -> dict[str, torch.Tensor]:
    """This stage's weights under the model's state-dict names (tp slices as they are)."""
    names = hf_names(pipe)
    return {names[k]: v for k, v in pipe.state_dict().items() if k in names}


def hf_shard_specs(pipe: HFPipelineModule) -> dict:
    """This stage's tensor-parallel ShardSpecs under the model's names (for merge_state_dicts)."""
    from trident.tensor_parallel import shard_specs
    names = hf_names(pipe)
    return {names[k]: spec for k, spec in shard_specs(pipe).items() if k in names}


def load_hf_state_dict(pipe: HFPipelineModule, state: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsplit) model state dict into this stage (tp-split tensors take their slice)."""
    own = pipe.state_dict(keep_vars=True)
    names = hf_names(pipe)
    missing = sorted(names[k] for k in own if k in names and names[k] not in state)
    if missing:
        raise KeyError(f"load_hf_state_dict: the state dict lacks {missing[:5]} (this stage of {pipe.hf_class})")
    with torch.no_grad():
        for k, t in own.items():
            if k not in names:
                continue
            full = state[names[k]]
            spec = getattr(t, "tp_spec", None) if getattr(t, "tensor_model_parallel", False) else None
            if spec is not None and spec.tp_size > 1:
                full = spec.shard(full, _tp_rank_of(pipe, t))
            t.copy_(full)


def _tp_rank_of(pipe: nn.Module, t: torch.Tensor) -> int:
    for module in pipe.modules():
        if hasattr(module, "tp_rank") and any(x is t for x in (*module.parameters(recurse=False),
                                                                *module.buffers(recurse=False))):
            return module.tp_rank
    raise ValueError("a tensor-parallel tensor of the pipeline is held by no tensor-parallel layer")
