"""A `PipelineModule` made of a model's own modules: a model built whole, split into stages.

    pipe = trident.pipeline.from_hf(model, num_stages=2, partition_method="type:DecoderLayer")

`from_hf` asks the model's `ModelAdapter` (trident.parallel.adapter) for this rank's stage; a
family that splits built models (the transformers families of `trident.models`) answers with
an `AdoptedPipelineModule` whose layers are `ModelPart`s: wrappers holding the model's module
objects under role names, each remembering the module's name in the model. That is what the
rest of this file needs to be generic:

- names: `source_key` maps a stage's state-dict key to the model's (`hf_names`,
  `hf_state_dict`, `hf_shard_specs`, `load_hf_state_dict` under their public names);
- tensor parallelism: `plan_module_names` lets `apply_plan` match the model's own names on every
  stage (a pattern may match only other stages' modules), `after_tensor_parallel` keeps a tied
  copy held as buffers after its modules were replaced;
- memory: modules only other stages use move to the meta device (`release`), so build each
  stage from its own copy of the model (every rank builds the same model from the same seed).
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from trident.parallel.adapter import adapter_for
from trident.pipeline.module import LayerSpec, PipelineModule, _params_to_buffers
from trident.tensor_parallel.split import shard_specs


class ModelPart(nn.Module):
    """Some of a model's own modules, under role names; `source_paths` maps each child's name to
    the module's name in the model (for state-dict names and tensor-parallel plans)."""

    def __init__(self, parts: Sequence[tuple[str, str, nn.Module]]) -> None:
        super().__init__()
        self.source_paths: dict[str, str] = {}
        for child, path, module in parts:
            self.add_module(child, module)
            self.source_paths[child] = path


class AdoptedPipelineModule(PipelineModule):
    """A stage of a model split by its family's adapter (see the module docstring). `config` is
    the model's (a family's adapter reads it again on the stage); `decoder_indices` are the
    layers that are decoder layers, of which every stage must hold one."""

    def __init__(self, layers: Sequence[Any], num_stages: int, *, model: nn.Module, loss_fn: Callable,
                 decoder_indices: Sequence[int], release: bool = True, **kwargs: Any) -> None:
        super().__init__(layers, num_stages, loss_fn=loss_fn, **kwargs)
        self.config = getattr(model, "config", None)
        self.source_class = type(model).__name__
        self._source_module_names = [name for name, _ in model.named_modules() if name]
        self._check_stages(decoder_indices)
        if release:
            self._release_other_stages()

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> "AdoptedPipelineModule":
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

    def source_key(self, name: str) -> str | None:
        """The model's name for this stage's module / parameter / buffer `name` (None for wrappers)."""
        parts = name.split(".")
        if parts[0] == "tied_modules" and len(parts) > 1:
            wrapper, rest = self.tied_modules[parts[1]] if parts[1] in self.tied_modules else None, parts[2:]
        else:
            wrapper, rest = self._modules.get(parts[0]), parts[1:]
        if not isinstance(wrapper, ModelPart) or not rest or rest[0] not in wrapper.source_paths:
            return None
        return ".".join(p for p in (wrapper.source_paths[rest[0]], *rest[1:]) if p)

    def plan_module_names(self) -> tuple[dict[str, str], list[str]]:
        """For `trident.tensor_parallel.apply_plan`: this stage's module names -> the model's ("" for
        the wrappers), and every module name of the whole model (a pattern may match other stages)."""
        rename = {name: self.source_key(name) or "" for name, _ in self.named_modules()}
        return rename, self._source_module_names

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
                kind = self._specs[min(decoders)].typename.__name__
                raise ValueError(f"from_hf({self.source_class}): partition_method {self.partition_method!r} leaves "
                                 f"{where} without a decoder layer (it holds layers {layers.start}-{layers.stop - 1} "
                                 f"of {self.num_layers}, {len(decoders)} of them decoder layers); use fewer "
                                 f"stages, or a partition such as \"type:{kind}\"\n"
                                 f"{self.describe_partition()}")

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


# -- splitting ----------------------------------------------------------------------------------------

def from_hf(model: nn.Module, num_stages: int, partition_method: str = "parameters", virtual_stages: int = 1,
            activation_checkpoint_interval: int = 0, stage_id: int | None = None, *,
            trust_layout: bool = False, release: bool = True) -> PipelineModule:
    """Split a built model into this rank's `PipelineModule` stage, reusing its modules and weights
    (a transformers decoder-only causal LM: LLaMA, Mistral, Qwen2/3, GPT-NeoX, GPT-2, Mixtral).

    `model` is the causal LM (e.g. `LlamaForCausalLM`), or a module holding one (its other code is
    not used). `partition_method` as for PipelineModule; "type:DecoderLayer" (LLaMA-like),
    "type:GPT2Block" or "type:GPTNeoXLayer" balance the decoder layers. `trust_layout=True` accepts
    a transformers model type no family of `trident.models` covers. `release=False` keeps other
    stages' modules in memory. The loss is the model's own; micro-batches are (input_ids, input_ids).
    """
    adapter = adapter_for(model)
    stage = adapter.split_pipeline(num_stages, partition_method=partition_method, virtual_stages=virtual_stages,
                                   activation_checkpoint_interval=activation_checkpoint_interval,
                                   stage_id=stage_id, trust_layout=trust_layout, release=release) \
        if adapter is not None else None
    if stage is None:
        raise ValueError(f"from_hf: {type(model).__name__} is not (and holds no) transformers causal LM with an "
                         f"output head (get_output_embeddings()); give e.g. a LlamaForCausalLM")
    return stage


# -- names and weights --------------------------------------------------------------------------------

def hf_names(pipe: AdoptedPipelineModule) -> dict[str, str]:
    """This stage's state-dict key -> the model's state-dict key (a tied weight appears under both
    of the model's names: the embedding's and the head's)."""
    return {k: pipe.source_key(k) for k in pipe.state_dict() if pipe.source_key(k) is not None}


def hf_state_dict(pipe: AdoptedPipelineModule) -> dict[str, torch.Tensor]:
    """This stage's weights under the model's state-dict names (tp slices as they are)."""
    names = hf_names(pipe)
    return {names[k]: v for k, v in pipe.state_dict().items() if k in names}


def hf_shard_specs(pipe: AdoptedPipelineModule) -> dict:
    """This stage's tensor-parallel ShardSpecs under the model's names (for merge_state_dicts)."""
    names = hf_names(pipe)
    return {names[k]: spec for k, spec in shard_specs(pipe).items() if k in names}


def load_hf_state_dict(pipe: AdoptedPipelineModule, state: dict[str, torch.Tensor]) -> None:
    """Copy a full (unsplit) model state dict into this stage (tp-split tensors take their slice)."""
    own = pipe.state_dict(keep_vars=True)
    names = hf_names(pipe)
    missing = sorted(names[k] for k in own if k in names and names[k] not in state)
    if missing:
        raise KeyError(f"load_hf_state_dict: the state dict lacks {missing[:5]} (this stage of {pipe.source_class})")
    with torch.no_grad():
        for k, t in own.items():
            if k in names:
                t.copy_(local_part(pipe, t, state[names[k]]))


def local_part(pipe: nn.Module, t: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """What `pipe`'s tensor `t` holds of the whole tensor `full`: its tensor-parallel slice when the
    layer holding it is split over tp, else `full` itself."""
    spec = getattr(t, "tp_spec", None) if getattr(t, "tensor_model_parallel", False) else None
    if spec is None or spec.tp_size == 1:
        return full
    for module in pipe.modules():
        if hasattr(module, "tp_rank") and any(x is t for x in (*module.parameters(recurse=False),
                                                                *module.buffers(recurse=False))):
            return spec.shard(full, module.tp_rank)
    raise ValueError("a tensor-parallel tensor of the pipeline is held by no tensor-parallel layer")
