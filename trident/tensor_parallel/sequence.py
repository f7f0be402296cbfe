"""Sequence parallelism for a model written without trident, cut where its adapter says.

`tensor_parallel.sequence_parallel` with plan "hf" / "auto": the model's `ModelAdapter`
(trident.parallel.adapter) gives a `SequenceParallelLayout`: its decoder layers, the attention
module of each and the final norm(s). The plan's layers inside the decoder layers take and give
sequence shards (`uses_shards`: column layers all-gather, row layers reduce-scatter); norms,
MLPs and the residual stream run on shards; `enable_sequence_parallel` cuts the sequence in front
of the first decoder layer, gathers it whole in front of each attention module (a transformers
attention takes its shapes from its input) and after the final norm, and sums the norms'
gradients over tp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trident.tensor_parallel.layers import _TPModule, mark_sequence_parallel
from trident.tensor_parallel.mappings import SEQUENCE_DIM, _gather, _split, scatter_to_sequence_parallel_region
from trident.tensor_parallel.styles import Row, Style


@dataclass(frozen=True)
class SequenceParallelLayout:
    """Where sequence parallelism cuts a model (names from the root module, as its adapter gives
    them): the decoder layers (their norms, MLPs and residual stream run on sequence shards), the
    attention module of each (which needs the whole sequence: transformers' attention takes its
    shapes from its input), and the final norm(s), after which the sequence is whole again
    (the base model reshapes its output by the input's shape, e.g. GPT-2)."""

    layers: tuple[str, ...]
    attentions: tuple[str, ...]
    final_norms: tuple[str, ...]

    def uses_shards(self, name: str, style: Style) -> bool:
        """Whether the tp layer `name` takes / gives sequence shards: every layer in a decoder
        layer outside attention, and attention's row-parallel output projection."""
        if any(_under(name, a) for a in self.attentions):
            return isinstance(style, Row)
        return any(_under(name, layer) for layer in self.layers)


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class _GatherSequenceSplitGrad(torch.autograd.Function):
    """Sequence shards -> the whole sequence (in front of attention, after the final norm).
    Backward: this rank's chunk of the gradient (the column-parallel layers after it have
    already summed it over tp)."""

    @staticmethod
    def forward(ctx, x, group, logger):
        ctx.group = group
        return _gather(x.contiguous(), SEQUENCE_DIM, group, logger)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, SEQUENCE_DIM, ctx.group), None, None


def enable_sequence_parallel(model: nn.Module, layout: SequenceParallelLayout, mesh, logger=None) -> None:
    """After the plan has split `model` with `layout.uses_shards`: cut the sequence in front of
    the first decoder layer, gather it in front of each attention, and sum the gradients of the
    norms (which now see shards) over tp. A decoder layer with other replicated weights outside
    attention is refused, naming them: where they are used is not known."""
    group, tp = mesh.tp_group, mesh.tp_size

    def cut(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        if hidden.shape[SEQUENCE_DIM] % tp:
            raise ValueError(f"sequence parallelism: {hidden.shape[SEQUENCE_DIM]} tokens are not divisible by "
                             f"tensor_parallel.size={tp}; pad or truncate the input to a multiple of {tp}")
        return _replace_hidden(args, kwargs, scatter_to_sequence_parallel_region(hidden, group, logger))

    def whole(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        return _replace_hidden(args, kwargs, _GatherSequenceSplitGrad.apply(hidden, group, logger))

    model.get_submodule(layout.layers[0]).register_forward_pre_hook(cut, with_kwargs=True)
    for name in layout.attentions:
        model.get_submodule(name).register_forward_pre_hook(whole, with_kwargs=True)
    for layer in layout.layers:
        for name, module in model.get_submodule(layer).named_modules(prefix=layer):
            if isinstance(module, _TPModule) or any(_under(name, a) for a in layout.attentions):
                continue
            own = list(module.parameters(recurse=False))
            if own and not _is_norm(module):
                raise ValueError(f"tensor_parallel.sequence_parallel: {name} ({type(module).__name__}) holds "
                                 f"replicated weights outside attention that are not a norm; trident does not know "
                                 f"whether it may run on sequence shards. Set sequence_parallel to false for this "
                                 f"model")
            for param in own:
                mark_sequence_parallel(param, mesh, logger)
    for name in layout.final_norms:
        for param in model.get_submodule(name).parameters():
            mark_sequence_parallel(param, mesh, logger)
    model.get_submodule(layout.final_norms[-1]).register_forward_hook(
        lambda module, args, output: _GatherSequenceSplitGrad.apply(output, group, logger))


def _is_norm(module: nn.Module) -> bool:
    return isinstance(module, (nn.LayerNorm, nn.RMSNorm)) or "Norm" in type(module).__name__


def _replace_hidden(args: tuple, kwargs: dict, hidden):
    if args:
        return (hidden, *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": hidden}
