"""Context parallelism for an unmodified `transformers` causal LM (LLaMA, Qwen2, Mistral, ...).

Three things change, none in the model's code:
  - its attention implementation becomes "trident_context_parallel", registered with
    transformers' `AttentionInterface`: q, k, v of the local chunks go through
    `trident.context_parallel.attention` (causal over global positions; the model's own
    padding-free causal mask is not needed);
  - a forward pre-hook cuts `input_ids` (and `position_ids`, default 0..T-1) to this rank's
    chunks, so RoPE sees global positions, and turns `labels` into already-shifted local
    targets (`shift_labels`: the token after each local position, -100 after the last), so
    transformers' loss does not shift across a chunk boundary;
  - a forward hook turns the local summed loss into the mean over every token of the
    sequence (`ContextParallel.global_mean`).
A padding `attention_mask` with zeros is refused: packed or padded batches under cp use
document ids, which transformers' models do not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trident.context_parallel.attention import attention
from trident.context_parallel.layout import ContextParallel
from trident.models.transformers.detect import find_causal_lm

IMPLEMENTATION = "trident_context_parallel"


def _attention(module: nn.Module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers' attention-function contract: q [B, H, T, D], k, v [B, H_kv, T, D] in,
    ([B, T, H, D], no weights) out."""
    if dropout:
        raise ValueError(f"{type(module).__name__}: attention dropout {dropout} has no context-parallel form; set "
                         f"the model's attention dropout to 0")
    out = attention(query, key, value, causal=True, cp=module.trident_context_parallel, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers import AttentionInterface
    AttentionInterface.register(IMPLEMENTATION, _attention)
    try:  # the mask of the attention it replaces: none needed (causal is applied here)
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
        ALL_MASK_ATTENTION_FUNCTIONS.register(IMPLEMENTATION, lambda *args, **kwargs: None)
    except (ImportError, AttributeError):
        pass


def parallelize_transformers(model: nn.Module, cp: ContextParallel) -> None:
    """Make the causal LM inside `model` run on this cp rank's chunks (see the module docstring)."""
    lm = find_causal_lm(model)
    if lm is None:
        raise ValueError(f"{type(model).__name__} holds no transformers causal LM")
    heads = [m for m in lm.modules() if hasattr(m, "num_key_value_groups") or type(m).__name__.endswith("Attention")]
    if not heads:
        raise ValueError(f"{type(lm).__name__}: no attention modules found for context parallelism")
    for name in ("attention_dropout", "attn_pdrop"):
        if getattr(lm.config, name, 0.0):
            raise ValueError(f"{type(lm).__name__}: config.{name}={getattr(lm.config, name)} under context "
                             f"parallelism; ring and Ulysses attention have no dropout, so set it to 0")
    _register()
    for module in heads:
        module.trident_context_parallel = cp
    lm.config._attn_implementation = IMPLEMENTATION
    if not getattr(lm, "_trident_cp_hooks", False):
        lm.register_forward_pre_hook(_shard_inputs, with_kwargs=True)
        lm.register_forward_hook(_global_loss, with_kwargs=True)
        lm._trident_cp_hooks = True
    lm.trident_context_parallel = cp


def _shard_inputs(lm: nn.Module, args: tuple, kwargs: dict):
    cp: ContextParallel = lm.trident_context_parallel
    if args:  # positional input_ids (and attention_mask, position_ids, ... by name only)
        kwargs = {"input_ids": args[0], **kwargs}
        args = ()
    ids = kwargs.get("input_ids")
    if ids is None:
        raise ValueError(f"{type(lm).__name__} under context parallelism needs input_ids (whole sequences)")
    mask = kwargs.pop("attention_mask", None)
    if mask is not None and not bool(mask.all()):
        raise ValueError("an attention_mask with padding under context parallelism is not supported; pass whole "
                         "sequences without padding (or pack documents with the reference GPT's doc_ids)")
    t = ids.shape[1]
    cp.check_length(t)
    positions = kwargs.get("position_ids")
    positions = torch.arange(t, device=ids.device).expand_as(ids) if positions is None else positions
    kwargs["input_ids"], kwargs["position_ids"] = cp.shard(ids), cp.shard(positions)
    labels = kwargs.get("labels")
    if labels is not None:
        shifted = F.pad(labels, (0, 1), value=-100)[..., 1:]
        local = cp.shard(shifted)
        kwargs.update(labels=local, shift_labels=local, num_items_in_batch=1)  # the loss is the local sum
    return args, kwargs


def _global_loss(lm: nn.Module, args: tuple, kwargs: dict, output):
    loss = getattr(output, "loss", None)
    if loss is None:
        return output
    count = (kwargs["shift_labels"] != -100).sum()
    output.loss = lm.trident_context_parallel.global_mean(loss, count)
    return output
