"""Tensor-parallel plans for `transformers` models: the model's own, or its family's preset.

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

`"auto"` takes the model's plan when it has one, else the preset its family names for
`config.model_type` (GPT-2 publishes none; its `Conv1D` layers are split in their own
transposed layout, the fused `c_attn` by heads).

With fewer key/value heads than tp ranks (grouped-query attention), the key and value
projections are kept whole on every rank and each rank uses the head its query heads share
(`KVHeads`, as Megatron replicates such heads). A tp-split attention computes only its local
heads; `localize_heads` fixes the attribute a transformers attention module reads its head
count from (the query heads per key/value head; GPT-2's family fixes its own), and refuses,
naming the module, an attention whose head counts do not share out over tp.

`tensor_parallel.sequence_parallel` with these plans: `sequence_parallel_layout` finds the
decoder layers, their attention modules and the final norm from the model's layout, for
`trident.tensor_parallel.sequence`.
"""

from __future__ import annotations

from typing import Mapping

from torch import nn

from trident.models.transformers.detect import find_causal_lm, name_of
from trident.models.transformers.layout import DecoderLayout, decoder_layout
from trident.tensor_parallel.plan import PRESETS
from trident.tensor_parallel.sequence import SequenceParallelLayout
from trident.tensor_parallel.styles import Column, KVHeads, Row, Style, SumGrad, Vocab

HF_STYLES: dict[str, Style | None] = {
    "colwise": Column(), "local_colwise": Column(),
    "rowwise": Row(), "local_rowwise": Row(), "rowwise_rep": Row(),
    "colwise_rep": Column(gather_output=True, pad_vocab=True),
    "colwise_gather_output": Column(gather_output=True, pad_vocab=True),
    "embedding_rowwise": Vocab(), "vocab": Vocab(),
    "replicated_with_grad_allreduce": SumGrad(),
    "sequence_parallel": None, "replicate": None, "gather": None, "local": None,
}

KV_PROJECTIONS = ("k_proj", "v_proj")


def published_plan(model: nn.Module) -> dict[str, str]:
    """The plan transformers ships with `model` (base model's and head's), or {}."""
    config = getattr(model, "config", None)
    plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    plan.update(getattr(model, "_tp_plan", None) or {})
    return plan


def plan_for(model: nn.Module, which: str, tp: int, presets: Mapping[str, str],
             published: Mapping[str, str] | None = None) -> dict[str, Style]:
    """The trident plan of transformers model `model`: its own (`which="hf"`), or by `"auto"`
    (its own, else the preset `presets` names for its model type); with fewer key/value heads
    than `tp`, its key and value projections become `KVHeads`. `published`: the model's plan
    as its family reads it (default `published_plan(model)`)."""
    model_type = model.config.model_type
    published = published_plan(model) if published is None else published
    if which == "auto" and not published:
        preset = presets.get(model_type)
        if preset is None:
            raise ValueError(f"tensor_parallel.plan='auto': {type(model).__name__} (model_type {model_type!r}) "
                             f"publishes no tensor-parallel plan and trident has no preset for it (presets: "
                             f"{sorted(PRESETS)}); give a {{module-name pattern: style}} plan")
        return replicate_kv(dict(PRESETS[preset]), model, tp)
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
    return replicate_kv(plan, model, tp)


def replicate_kv(plan: dict[str, Style], model: nn.Module, tp: int) -> dict[str, Style]:
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


def localize_heads(model: nn.Module, tp: int, dry_run: bool = False) -> list[str]:
    """Make each tp-split attention module that counts its query heads per key/value head
    (`num_key_value_groups`: LLaMA-like attention) count its local ones; returns the names of the
    modules changed (`dry_run`: only check that they can be)."""
    changed = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if not (kind.endswith("Attention") and hasattr(module, "num_key_value_groups")):
            continue
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


def divide_attribute(module: nn.Module, name: str, attr: str, tp: int, dry_run: bool) -> None:
    """`module.attr //= tp` (a head count, or a width made of heads), refused when tp does not divide it."""
    value = getattr(module, attr)
    if value % tp or (attr == "num_heads" and value < tp):
        raise ValueError(f"{name} ({type(module).__name__}).{attr} = {value} is not divisible by "
                         f"tensor_parallel.size={tp}; attention is split by heads, so choose a tp size that "
                         f"divides the number of heads")
    if not dry_run:
        setattr(module, attr, value // tp)


def sequence_parallel_layout(model: nn.Module, known: DecoderLayout | None = None) -> SequenceParallelLayout:
    """The layout of the causal LM in `model` (its pipeline plan, else its family's `known` one,
    names the decoder layers and the final norm), or an error saying why it cannot be found."""
    lm = find_causal_lm(model)
    if lm is None:
        raise ValueError(f"tensor_parallel.sequence_parallel with plan 'hf' / 'auto': {type(model).__name__} holds no "
                         f"transformers causal LM")
    layout = decoder_layout(lm, known)
    base = name_of(model, lm.base_model)
    path = (lambda n: f"{base}.{n}" if base else n)
    layers = tuple(f"{path(layout.layers)}.{i}" for i in range(len(getattr(lm.base_model, layout.layers))))
    attentions = []
    for layer in layers:
        block = model.get_submodule(layer)
        found = [n for n, m in block.named_children() if type(m).__name__.endswith("Attention")]
        if len(found) != 1:
            raise ValueError(f"tensor_parallel.sequence_parallel: {layer} ({type(block).__name__}) has "
                             f"{len(found) or 'no'} attention modules {found or ''}; sequence parallelism needs "
                             f"exactly one")
        attentions.append(f"{layer}.{found[0]}")
    norms = tuple(path(n) for n in layout.after if any(True for _ in getattr(lm.base_model, n).parameters()))
    if not norms:
        raise ValueError(f"tensor_parallel.sequence_parallel: {type(lm).__name__} has no final norm after its "
                         f"decoder layers ({list(layout.after)}), where the sequence would be gathered again; set "
                         f"sequence_parallel to false")
    return SequenceParallelLayout(layers, tuple(attentions), norms)
