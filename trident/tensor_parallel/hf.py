"""Tensor-parallel plans for `transformers` models: the model's own, or a preset by model type.

`tensor_parallel.plan: "hf"` reads the plan transformers publishes with the model: the base
model's `config.base_model_tp_plan` (module pattern -> "colwise" / "rowwise" / ..., e.g.
`layers.*.self_attn.q_proj: colwise` for LLaMA, Qwen2, Mistral, Gemma) and the head's
`_tp_plan` (`lm_head: colwise_gather_output`). Their styles map to trident's layers:

    colwise, local_colwise                      Column()
    rowwise, local_rowwise, rowwise_rep          Row()
    colwise_rep, colwise_gather_output           Column(gather_output=True, pad_vocab=True)
    embedding_rowwise, vocab                     Vocab()
    replicated_with_grad_allreduce              SumGrad(): whole, gradients summed over tp (per-head norms)
    sequence_parallel, replicate, gather, local left as they are (replicated modules)

`"auto"` takes the model's plan when it has one, else trident's preset for
`config.model_type` (GPT-2 publishes none; its `Conv1D` layers are split in their own
transposed layout, the fused `c_attn` by heads).

With fewer key/value heads than tp ranks (grouped-query attention), the key and value
projections are kept whole on every rank and each rank uses the head its query heads share
(`KVHeads`, as Megatron replicates such heads). A tp-split attention computes only its local
heads; `localize_heads` fixes the attributes a transformers attention module reads its head
count from (GPT-2's `split_size`, the query heads per key/value head), and refuses, naming
the module, an attention whose head counts do not share out over tp.

`tensor_parallel.sequence_parallel` with these plans: the decoder layers and the final norm
are found from the model's layout (`trident.pipeline.hf`); norms, MLPs and the residual stream
run on sequence shards (column layers all-gather, row layers reduce-scatter), the sequence is
gathered whole in front of each attention module (transformers' attention takes its shapes
from its input) and after the final norm, and the norms' gradients are summed over tp.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from trident.tensor_parallel.layers import _TPModule, mark_sequence_parallel
from trident.tensor_parallel.mappings import SEQUENCE_DIM, _gather, _split, scatter_to_sequence_parallel_region
from trident.tensor_parallel.plan import PRESETS, Column, KVHeads, Row, Style, SumGrad, Vocab

HF_STYLES: dict[str, Style | None] = {
    "colwise": Column(), "local_colwise": Column(),
    "rowwise": Row(), "local_rowwise": Row(), "rowwise_rep": Row(),
    "colwise_rep": Column(gather_output=True, pad_vocab=True),
    "colwise_gather_output": Column(gather_output=True, pad_vocab=True),
    "embedding_rowwise": Vocab(), "vocab": Vocab(),
    "replicated_with_grad_allreduce": SumGrad(),
    "sequence_parallel": None, "replicate": None, "gather": None, "local": None,
}

PRESET_BY_MODEL_TYPE = {"gpt2": "gpt2", "llama": "llama"}


def is_transformers_model(model: nn.Module) -> bool:
    config = getattr(model, "config", None)
    return config is not None and hasattr(config, "model_type") and hasattr(config, "to_dict")


def find_transformers_model(model: nn.Module) -> nn.Module | None:
    """`model` itself if it is a transformers model, else the outermost one inside it (a user's
    wrapper that returns the loss), else None."""
    return next((m for m in model.modules() if is_transformers_model(m)), None)


def published_plan(model: nn.Module) -> dict[str, str]:
    """The plan transformers ships with `model` (base model's and head's), or {}."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def plan_for(model: nn.Module, which: str, tp: int = 1) -> dict[str, Style]:
    """The trident plan of a transformers model: its own (`which="hf"`), or by `"auto"`; with
    fewer key/value heads than `tp`, its key and value projections become `KVHeads`."""
    found = find_transformers_model(model)
    if found is None:
        raise ValueError(f"tensor_parallel.plan={which!r} reads a transformers model's own plan, but "
                         f"{type(model).__name__} is not (and holds no) transformers PreTrainedModel; give a "
                         f"preset or a {{module-name pattern: style}} plan")
    model = found
    model_type = model.config.model_type
    published = published_plan(model)
    if which == "auto" and not published:
        preset = PRESET_BY_MODEL_TYPE.get(model_type)
        if preset is None:
            raise ValueError(f"tensor_parallel.plan='auto': {type(model).__name__} (model_type {model_type!r}) "
                             f"publishes no tensor-parallel plan and trident has no preset for it (presets by "
                             f"model type: {sorted(PRESET_BY_MODEL_TYPE)}); give a {{module-name pattern: style}} "
                             f"plan")
        return _replicate_kv(dict(PRESETS[preset]), model, tp)
    if not published:
        raise ValueError(f"tensor_parallel.plan='hf': {type(model).__name__} (model_type {model_type!r}) publishes "
                         f"no tensor-parallel plan (config.base_model_tp_plan is empty); use plan 'auto' or a "
                         f"{{module-name pattern: style}} plan")
    plan: dict[str, Style] = {}
    for pattern, style in published.items():
        if style not in HF_STYLES:
            raise ValueError(f"{type(model).__name__}'s published plan gives {pattern!r} the style {style!r}, which "
                             f"trident does not know; known: {sorted(HF_STYLES)}. Give this model a "
                             f"{{module-name pattern: style}} plan instead")
        if HF_STYLES[style] is not None:
            plan[pattern] = HF_STYLES[style]
    return _replicate_kv(plan, model, tp)


KV_PROJECTIONS = ("k_proj", "v_proj")


def _replicate_kv(plan: dict[str, Style], model: nn.Module, tp: int) -> dict[str, Style]:
    """Grouped-query attention with fewer key/value heads than tp ranks: the key and value
    projections are kept whole and each rank uses its query heads' shared head (Megatron's way).
    tp must then be a multiple of the key/value heads."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None)
    if not heads or not kv or kv % tp == 0 or tp % kv:
        return plan
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return {p: KVHeads(head_dim) if p.rsplit(".", 1)[-1] in KV_PROJECTIONS and isinstance(s, Column) else s
            for p, s in plan.items()}


def check_heads(model: nn.Module, tp: int) -> None:
    """Before any layer is split: every attention module's heads must share out over tp."""
    localize_heads(model, tp, dry_run=True)


def localize_heads(model: nn.Module, tp: int, dry_run: bool = False) -> list[str]:
    """Make each tp-split attention module of a transformers model count its local heads;
    returns the names of the modules changed (`dry_run`: only check that they can be)."""
    changed = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ("GPT2Attention", "GPT2SdpaAttention", "GPT2FlashAttention2"):
            for attr in ("num_heads", "embed_dim", "split_size"):
                _divide(module, name, attr, tp, dry_run)
            changed.append(name)
        elif kind.endswith("Attention") and hasattr(module, "num_key_value_groups"):
            heads = getattr(module.config, "num_attention_heads", None)
            kv = getattr(module.config, "num_key_value_heads", None) or heads
            if heads is None:
                continue
            if heads % tp or (kv % tp and tp % kv):
                raise ValueError(f"{name} ({kind}): {heads} query heads over tensor_parallel.size={tp} need tp to "
                                 f"divide them, and {kv} key/value heads need tp to divide them or be a multiple of "
                                 f"them (then each is replicated); choose such a tp size")
            if kv % tp and not dry_run:  # each rank holds one replicated key/value head for its query heads
                module.num_key_value_groups = heads // tp
                changed.append(name)
    return changed


def _divide(module: nn.Module, name: str, attr: str, tp: int, dry_run: bool) -> None:
    value = getattr(module, attr)
    if value % tp or (attr == "num_heads" and value < tp):
        raise ValueError(f"{name} ({type(module).__name__}).{attr} = {value} is not divisible by "
                         f"tensor_parallel.size={tp}; attention is split by heads, so choose a tp size that "
                         f"divides the number of heads")
    if not dry_run:
        setattr(module, attr, value // tp)


# -- sequence parallelism ------------------------------------------------------------------------


@dataclass(frozen=True)
class SequenceParallelLayout:
    """Where sequence parallelism cuts a transformers causal LM (names from the root module):
    the decoder layers (their norms, MLPs and residual stream run on sequence shards), the
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


def sequence_parallel_layout(model: nn.Module) -> SequenceParallelLayout:
    """The layout of the causal LM in `model` (its pipeline plan names the decoder layers and
    the final norm; GPT-2's is known), or an error saying why it cannot be found."""
    from trident.pipeline.hf import _layout, _name_of, find_causal_lm
    lm = find_causal_lm(model)
    if lm is None:
        raise ValueError(f"tensor_parallel.sequence_parallel with plan 'hf' / 'auto': {type(model).__name__} holds no "
                         f"transformers causal LM")
    _, layers_key, after = _layout(lm)
    base = _name_of(model, lm.base_model)
    path = (lambda n: f"{base}.{n}" if base else n)
    layers = tuple(f"{path(layers_key)}.{i}" for i in range(len(getattr(lm.base_model, layers_key))))
    attentions = []
    for layer in layers:
        block = model.get_submodule(layer)
        found = [n for n, m in block.named_children() if type(m).__name__.endswith("Attention")]
        if len(found) != 1:
            raise ValueError(f"tensor_parallel.sequence_parallel: {layer} ({type(block).__name__}) has "
                             f"{len(found) or 'no'} attention modules {found or ''}; sequence parallelism needs "
                             f"exactly one")
        attentions.append(f"{layer}.{found[0]}")
    norms = tuple(path(n) for n in after if any(True for _ in getattr(lm.base_model, n).parameters()))
    if not norms:
        raise ValueError(f"tensor_parallel.sequence_parallel: {type(lm).__name__} has no final norm after its "
                         f"decoder layers ({after}), where the sequence would be gathered again; set "
                         f"sequence_parallel to false")
    return SequenceParallelLayout(layers, tuple(attentions), norms)


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
