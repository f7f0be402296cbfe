"""Tensor-parallel plans for `transformers` models: the model's own, or a preset by model type.

`tensor_parallel.plan: "hf"` reads the plan transformers publishes with the model: the base
model's `config.base_model_tp_plan` (module pattern -> "colwise" / "rowwise" / ..., e.g.
`layers.*.self_attn.q_proj: colwise` for LLaMA, Qwen2, Mistral, Gemma) and the head's
`_tp_plan` (`lm_head: colwise_gather_output`). Their styles map to trident's layers:

    colwise, local_colwise                      Column()
    rowwise, local_rowwise, rowwise_rep          Row()
    colwise_rep, colwise_gather_output           Column(gather_output=True, pad_vocab=True)
    embedding_rowwise, vocab                     Vocab()
    sequence_parallel, replicate, gather, ...    left as they are (norms, replicated modules)

`"auto"` takes the model's plan when it has one, else trident's preset for
`config.model_type` (GPT-2 publishes none; its `Conv1D` layers are split in their own
transposed layout, the fused `c_attn` by heads).

A tp-split attention computes only its local heads; `localize_heads` fixes the attributes a
transformers attention module reads its head count from (GPT-2's `split_size`, ...), and
refuses, naming the module, an attention whose head counts do not divide by tp.
"""

from __future__ import annotations

from torch import nn

from trident.tensor_parallel.plan import PRESETS, Column, Row, Style, Vocab

HF_STYLES: dict[str, Style | None] = {
    "colwise": Column(), "local_colwise": Column(),
    "rowwise": Row(), "local_rowwise": Row(), "rowwise_rep": Row(),
    "colwise_rep": Column(gather_output=True, pad_vocab=True),
    "colwise_gather_output": Column(gather_output=True, pad_vocab=True),
    "embedding_rowwise": Vocab(), "vocab": Vocab(),
    "sequence_parallel": None, "replicate": None, "replicated_with_grad_allreduce": None, "gather": None,
    "local": None, "local_packed_rowwise": None,
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


def plan_for(model: nn.Module, which: str) -> dict[str, Style]:
    """The trident plan of a transformers model: its own (`which="hf"`), or by `"auto"`."""
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
        return dict(PRESETS[preset])
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
    return plan


def localize_heads(model: nn.Module, tp: int) -> list[str]:
    """Make each tp-split attention module of a transformers model count its local heads;
    returns the names of the modules changed."""
    changed = []
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ("GPT2Attention", "GPT2SdpaAttention", "GPT2FlashAttention2"):
            for attr in ("num_heads", "embed_dim", "split_size"):
                _divide(module, name, attr, tp)
            changed.append(name)
        elif kind.endswith("Attention") and hasattr(module, "num_key_value_groups"):
            heads = getattr(module.config, "num_attention_heads", None)
            kv = getattr(module.config, "num_key_value_heads", None) or heads
            if heads is not None and (heads % tp or kv % tp):
                raise ValueError(f"{name} ({kind}): {heads} query heads and {kv} key/value heads must both divide by "
                                 f"tensor_parallel.size={tp} (attention is split by heads); choose a tp size that "
                                 f"divides both")
    return changed


def _divide(module: nn.Module, name: str, attr: str, tp: int) -> None:
    value = getattr(module, attr)
    if value % tp:
        raise ValueError(f"{name} ({type(module).__name__}).{attr} = {value} is not divisible by "
                         f"tensor_parallel.size={tp}; attention is split by heads, so choose a tp size that "
                         f"divides the number of heads")
    setattr(module, attr, value // tp)
