"""`PipelineModule`: a model written as a list of layers, of which each stage builds only its own.

    layers = [TiedLayerSpec("embed", nn.Embedding, vocab, d),       # stage 0
              LayerSpec(Block, cfg), LayerSpec(Block, cfg), ...,     # split by partition_method
              TiedLayerSpec("embed", nn.Embedding, vocab, d,         # last stage: same weights
                            forward_fn=lambda emb, x: x @ emb.weight.t())]
    model = PipelineModule(layers, num_stages=2, loss_fn=F.cross_entropy, partition_method="type:Block")

Each layer is called with one argument, the previous layer's output (a tensor or a tuple of
tensors); the first receives the micro-batch's inputs, and `loss_fn(output, labels)` runs on
the last stage. A `LayerSpec` is built only on the stage that owns it, so no rank ever holds
the whole model. A `TiedLayerSpec` is built once on every stage that holds a layer with its
key. The first of those stages owns the weights (they are its parameters, trained by its
optimizer); the others hold a copy as buffers, which the pipeline engine refreshes from the
owner after every step and whose gradient it adds to the owner's. So a tied weight has one
optimizer state and counts once in the gradient norm, as in the serial model.

With `virtual_stages` v > 1 the layers are split into stages x v parts and rank s holds parts
s, s + stages, ... (its chunks), for the interleaved schedule.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from trident.recompute import activation
from trident.pipeline.partition import layer_type_name, partition_layers


class LayerSpec:
    """A layer to build later, only on the stage that owns it: `LayerSpec(cls, *args, **kwargs)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not (isinstance(typename, type) and issubclass(typename, nn.Module)):
            raise TypeError(f"LayerSpec needs a torch.nn.Module subclass as its first argument, got {typename!r}")
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)

    def __repr__(self) -> str:
        return f"LayerSpec({self.typename.__name__})"


class TiedLayerSpec(LayerSpec):
    """A layer whose parameters are shared by every layer with the same `key`, on any stage.

    `forward_fn(module, x)`, when given, replaces `module(x)` for this use of the shared
    module (e.g. the output projection that reuses the input embedding's weight).
    """

    def __init__(self, key: str, typename: type, *module_args: Any,
                 forward_fn: Callable[[nn.Module, Any], Any] | None = None, **module_kwargs: Any) -> None:
        super().__init__(typename, *module_args, **module_kwargs)
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(f"TiedLayerSpec key must be a Python identifier (it names a submodule), got {key!r}")
        self.key = key
        self.forward_fn = forward_fn

    def __repr__(self) -> str:
        return f"TiedLayerSpec({self.key!r}, {self.typename.__name__})"


class PipelineModule(nn.Module):
    """The layers of one pipeline stage (all its chunks), and how the whole model is split.

    `stage_id` defaults to this process's stage under trident's mesh layout (pp outermost:
    stage = global rank // (world size / num_stages)); pass it to build a stage elsewhere.
    `activation_checkpoint_interval` k > 0 recomputes every run of k layers in backward
    instead of keeping their activations.
    """

    def __init__(self, layers: Sequence[Any], num_stages: int, loss_fn: Callable | None = None,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 virtual_stages: int = 1, stage_id: int | None = None) -> None:
        super().__init__()
        for name, value in (("num_stages", num_stages), ("virtual_stages", virtual_stages)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PipelineModule {name} must be a positive integer, got {value!r}")
        if activation_checkpoint_interval < 0:
            raise ValueError(f"activation_checkpoint_interval must be >= 0 (0 = off), got "
                             f"{activation_checkpoint_interval}")
        self.num_stages = num_stages
        self.virtual_stages = virtual_stages
        self.stage_id = _resolve_stage(stage_id, num_stages)
        self.loss_fn = loss_fn
        self.partition_method = partition_method
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self._specs = list(layers)
        names = [layer_type_name(layer) for layer in self._specs]
        self._param_counts = [_param_count(layer) for layer in self._specs]
        self.parts = partition_layers(partition_method, num_stages * virtual_stages, names, self._param_counts)
        self.tied_modules = nn.ModuleDict()
        self.tied_stages = self._find_tied_stages()
        self._copies: dict[str, list[str]] = {}  # tied key -> names of the weights held as buffers
        self._funcs: dict[int, Callable] = {}
        for chunk in range(virtual_stages):
            for idx in self.chunk_layers(chunk):
                self._funcs[idx] = self._build(idx)

    # -- layout ----------------------------------------------------------------------------

    @property
    def num_layers(self) -> int:
        return len(self._specs)

    def virtual_stage_layers(self, vstage: int) -> range:
        """Indices of the layers of virtual stage `vstage` (stage_id + chunk * num_stages)."""
        return range(self.parts[vstage], self.parts[vstage + 1])

    def chunk_layers(self, chunk: int) -> range:
        """Indices of the layers this stage runs as its chunk `chunk`."""
        return self.virtual_stage_layers(chunk * self.num_stages + self.stage_id)

    def is_first(self, chunk: int) -> bool:
        """True when the chunk is the model's first (it reads the micro-batch inputs)."""
        return chunk == 0 and self.stage_id == 0

    def is_last(self, chunk: int) -> bool:
        """True when the chunk is the model's last (it computes the loss)."""
        return chunk == self.virtual_stages - 1 and self.stage_id == self.num_stages - 1

    def owns(self, key: str) -> bool:
        """True when this stage owns the weights tied under `key` (the first stage holding them)."""
        return self.tied_stages[key][0] == self.stage_id

    def tied_tensors(self, key: str) -> list[torch.Tensor]:
        """The weights tied under `key` here: parameters on the owner, copies (buffers) elsewhere."""
        module = self.tied_modules[key]
        if self.owns(key):
            return list(module.parameters())
        return [module.get_buffer(name) for name in self._copies[key]]

    def _apply(self, fn: Callable, *args: Any, **kwargs: Any) -> "PipelineModule":
        """nn.Module._apply (under .to(), .half(), .cuda()) keeps parameter objects but replaces
        buffers by new tensors; give the tied copies' new tensors their tensor-parallel
        attributes back (trident.initialize casts the model to bf16/fp16 this way)."""
        marks = {name: {a: getattr(t, a) for a in _TP_ATTRS if hasattr(t, a)} for name, t in self.named_buffers()}
        out = super()._apply(fn, *args, **kwargs)
        for name, t in self.named_buffers():
            for attr, value in marks.get(name, {}).items():
                setattr(t, attr, value)
        return out

    def describe_partition(self) -> str:
        """One line per (virtual) stage: its layers, their classes and parameter count."""
        lines = [f"pipeline partition ({self.partition_method}) of {self.num_layers} layers over "
                 f"{self.num_stages} stage(s) x {self.virtual_stages} chunk(s); this is stage {self.stage_id}"]
        for vs in range(self.num_stages * self.virtual_stages):
            chunk, stage = divmod(vs, self.num_stages)
            idx = self.virtual_stage_layers(vs)
            kinds = Counter(layer_type_name(self._specs[i]) for i in idx)
            summary = ", ".join(k if n == 1 else f"{k} x{n}" for k, n in kinds.items())
            tied = {self._specs[i].key: self._param_counts[i] for i in idx if isinstance(self._specs[i], TiedLayerSpec)}
            params = sum(self._param_counts[i] for i in idx if not isinstance(self._specs[i], TiedLayerSpec))
            params += sum(tied.values())  # a tied module is held once per stage
            where = f"stage {stage}" + (f" chunk {chunk}" if self.virtual_stages > 1 else "")
            lines.append(f"  {where}: layers {idx.start}-{idx.stop - 1} ({summary}), {params:,} parameters")
        return "\n".join(lines)

    # -- running ---------------------------------------------------------------------------

    def run_chunk(self, chunk: int, x: Any) -> Any:
        """Run chunk `chunk`'s layers on `x` (recomputing runs of them in backward if asked).
        Checkpointing uses this module's own settings (its engine's), if it has any."""
        with activation.running(self):
            return self._run_chunk(chunk, x)

    def _run_chunk(self, chunk: int, x: Any) -> Any:
        funcs = [self._funcs[i] for i in self.chunk_layers(chunk)]
        k = self.activation_checkpoint_interval
        if k <= 0 or not torch.is_grad_enabled():
            return _run_layers(funcs, x)
        for start in range(0, len(funcs), k):  # trident's checkpoint: honours activation_checkpointing
            packed = isinstance(x, tuple)
            x = activation.checkpoint(_run_packed, funcs[start:start + k], packed, *(x if packed else (x,)))
        return x

    def forward(self, x: Any) -> Any:
        """The whole model's output (without the loss): only for a single-stage module."""
        if self.num_stages != 1:
            raise RuntimeError(f"this PipelineModule is split over {self.num_stages} stages and holds only "
                               f"stage {self.stage_id}'s layers; train it with engine.train_batch() and "
                               f"evaluate with engine.eval_batch()")
        for chunk in range(self.virtual_stages):
            x = self.run_chunk(chunk, x)
        return x

    # -- building --------------------------------------------------------------------------

    def _find_tied_stages(self) -> dict[str, list[int]]:
        stages: dict[str, set[int]] = {}
        for vs in range(self.num_stages * self.virtual_stages):
            for idx in self.virtual_stage_layers(vs):
                spec = self._specs[idx]
                if isinstance(spec, TiedLayerSpec):
                    stages.setdefault(spec.key, set()).add(vs % self.num_stages)
        return {key: sorted(s) for key, s in sorted(stages.items())}

    def _build(self, idx: int) -> Callable:
        layer = self._specs[idx]
        if isinstance(layer, TiedLayerSpec):
            if layer.key not in self.tied_modules:
                module = layer.build()
                if not self.owns(layer.key):
                    self._copies[layer.key] = _params_to_buffers(module)
                self.tied_modules[layer.key] = module
            module = self.tied_modules[layer.key]
            return functools.partial(layer.forward_fn, module) if layer.forward_fn is not None else module
        if isinstance(layer, LayerSpec):
            layer = layer.build()
        if isinstance(layer, nn.Module):
            self.add_module(str(idx), layer)
            return layer
        if callable(layer):
            return layer
        raise TypeError(f"pipeline layer {idx} is {type(layer).__name__}; layers must be LayerSpec, "
                        f"TiedLayerSpec, torch.nn.Module or callables")


_TP_ATTRS = ("tensor_model_parallel", "partition_dim", "partition_stride", "tp_spec")


def _params_to_buffers(module: nn.Module) -> list[str]:
    """Turn a tied copy's parameters into buffers (this stage reads them but does not train
    them); returns their names."""
    names = []
    copies: dict[int, torch.Tensor] = {}  # a weight two submodules share (embedding, tied head) stays one
    for prefix, sub in module.named_modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                del sub._parameters[name]
                if id(param) in copies:
                    sub.register_buffer(name, copies[id(param)])
                    continue
                copy = copies[id(param)] = param.detach()
                for attr in _TP_ATTRS:  # a tensor-parallel slice stays described as one
                    if hasattr(param, attr):
                        setattr(copy, attr, getattr(param, attr))
                sub.register_buffer(name, copy)
                names.append(f"{prefix}.{name}" if prefix else name)
    return names


def _run_layers(funcs: Sequence[Callable], x: Any) -> Any:
    for f in funcs:
        x = f(x)
    return x


def _run_packed(funcs: Sequence[Callable], packed: bool, *xs: Any) -> Any:
    """`_run_layers` with a tuple input spread over positional arguments (checkpoint keeps
    tensor arguments only)."""
    return _run_layers(funcs, tuple(xs) if packed else xs[0])


def _param_count(layer: Any) -> int:
    """Trainable parameters of a layer; specs are built on the meta device (no memory) to count."""
    if isinstance(layer, LayerSpec):
        with torch.device("meta"):
            layer = layer.build()
    if isinstance(layer, nn.Module):
        return sum(p.numel() for p in layer.parameters() if p.requires_grad)
    return 0


def _resolve_stage(stage_id: int | None, num_stages: int) -> int:
    if stage_id is not None:
        if isinstance(stage_id, bool) or not isinstance(stage_id, int) or not 0 <= stage_id < num_stages:
            raise ValueError(f"stage_id must be an integer in [0, {num_stages}), got {stage_id!r}")
        return stage_id
    if num_stages == 1:
        return 0
    if not dist.is_initialized():
        raise RuntimeError(f"PipelineModule over {num_stages} stages needs torch.distributed to find its "
                           f"stage: call trident.comm.init_distributed() first, or pass stage_id=")
    world = dist.get_world_size()
    if world % num_stages:
        raise ValueError(f"num_stages={num_stages} does not divide the world size {world}; launch a "
                         f"multiple of {num_stages} processes or change num_stages")
    return dist.get_rank() // (world // num_stages)
