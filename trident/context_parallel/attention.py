"""`trident.context_parallel.attention`: softmax attention over a sequence split across cp ranks.

The one function a model's attention calls (trident's GPT does; a user's own attention opts in
the same way). Inputs are this rank's shard in SDPA's layout, q [B, H, T_local, D] and k, v
[B, H_kv, T_local, D] (H_kv may divide H: grouped-query attention), with the cp layout's token
order (`ContextParallel.shard`). The method decides how the other ranks' tokens are reached:

    ring      keys and values travel around the cp ring (`ring.RingPlan`)
    ulysses   all-to-all to head shards, attention over the whole sequence, all-to-all back
    hybrid    Ulysses inside groups of `ulysses_size` ranks, the ring across the groups

Which `ContextParallel` applies: the `cp=` argument, else the one bound to the model that is
running in this thread (`bind`, done by `trident.initialize`: the model holds its handle, its
forward makes it current), else none: then, and at cp = 1, this is plain causal attention, so
the same model code runs with and without cp.
"""

from __future__ import annotations

import math
import weakref
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from trident.comm import collectives
from trident.context_parallel.layout import ContextParallel, document_mask
from trident.context_parallel.ring import RingAttention, RingPlan
from trident.context_parallel.ulysses import gather_docs, natural_order, to_heads, to_sequence

def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = True,
              doc_ids: torch.Tensor | None = None, *, cp: ContextParallel | None = None,
              scale: float | None = None) -> torch.Tensor:
    """Attention of this rank's queries over the keys of the whole (cp-split) sequence.

    q [B, H, T_local, D], k and v [B, H_kv, T_local, D]; `doc_ids` [B, T_local]: document ids
    of packed sequences (attention stays inside a document). `scale` defaults to 1/sqrt(D).
    Returns [B, H, T_local, D] in q's dtype.
    """
    cp = cp if cp is not None else current()
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    if q.dim() != 4 or k.shape != v.shape or k.shape[:1] + k.shape[2:] != q.shape[:1] + q.shape[2:] \
            or q.shape[1] % k.shape[1]:
        raise ValueError(f"context_parallel.attention needs q [B, H, T, D] and k, v [B, H_kv, T, D] with H_kv "
                         f"dividing H, got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if cp is None or cp.size == 1:
        return _local_attention(q, k, v, causal, doc_ids, scale)
    if cp.method == "ring":
        plan = _ring_plan(cp, [cp.chunks_of(r) for r in range(cp.size)], q.shape[2] // 2, causal,
                          doc_ids, cp.ring_group, cp.size, cp.rank, scale, key=doc_ids)
        return RingAttention.apply(q, k, v, plan)
    u = cp.ulysses_size
    for name, t in (("query", q), ("key/value", k)):
        if t.shape[1] % u:
            raise ValueError(f"Ulysses context parallelism splits heads over {u} ranks, but the {name} tensor "
                             f"has {t.shape[1]} heads on this rank; choose context_parallel.size (or "
                             f"ulysses_size) dividing the heads, or method 'ring'")
    group_rank = cp.rank % u
    members = range(cp.rank - group_rank, cp.rank - group_rank + u)
    chunks = [c for m in members for c in cp.chunks_of(m)]
    q, k, v = (to_heads(t, cp.ulysses_group, u, cp.logger) for t in (q, k, v))
    docs = (gathered_docs(cp, doc_ids, "ulysses", lambda: gather_docs(doc_ids, cp.ulysses_group, u, cp.logger))
            if doc_ids is not None else None)
    chunk_len = q.shape[2] // len(chunks)
    if cp.method == "ulysses":
        order = natural_order(chunks, chunk_len, q.device)
        inverse = torch.argsort(order)
        q, k, v = (t.index_select(2, order) for t in (q, k, v))
        docs = docs.index_select(1, order) if docs is not None else None
        y = _local_attention(q, k, v, causal, docs, scale).index_select(2, inverse)
    else:
        rings = cp.size // u
        sets = [tuple(c for m in range(g * u, (g + 1) * u) for c in cp.chunks_of(m)) for g in range(rings)]
        plan = _ring_plan(cp, sets, chunk_len, causal, docs, cp.ring_group, rings, cp.rank // u, scale,
                          key=doc_ids)
        y = RingAttention.apply(q, k, v, plan)
    return to_sequence(y, cp.ulysses_group, u, cp.logger)


def gathered_docs(cp: ContextParallel, doc_ids: torch.Tensor, phase: str, gather: Callable):
    """`gather()`, once per forward rather than once per layer: every attention layer of a
    forward gets the same `doc_ids` tensor, so the ids gathered for the first layer serve the
    rest (and the recomputation of checkpointed layers). Keyed by that tensor's identity and
    version, so new ids (the next batch) or ids changed in place are gathered again. All ranks
    of a group pass their ids alike, so they hit or miss together and the collectives match."""
    hit = cp.doc_cache.get(phase)
    if hit is not None and hit[0]() is doc_ids and hit[1] == doc_ids._version:
        return hit[2]
    value = gather()
    cp.doc_cache[phase] = (weakref.ref(doc_ids), doc_ids._version, value)
    return value


def _ring_plan(cp, chunk_sets, chunk_len, causal, doc_ids, group, size, rank, scale, key=None) -> RingPlan:
    docs = None
    if doc_ids is not None:  # every ring rank's document ids (a few bytes per token)
        def gather() -> list[torch.Tensor]:
            pieces = [torch.empty_like(doc_ids) for _ in range(size)]
            collectives.all_gather_list(pieces, doc_ids.contiguous(), group=group, logger=cp.logger)
            return pieces
        docs = gathered_docs(cp, key, "ring", gather)
    return RingPlan(group, size, rank, chunk_sets, chunk_len, causal, docs, scale, cp.logger, cp.stats)


def _local_attention(q, k, v, causal, doc_ids, scale):
    """Attention over the keys held here (cp = 1, or Ulysses' whole sequence in position order)."""
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if doc_ids is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    t = q.shape[2]
    positions = torch.arange(t, device=q.device)
    mask = document_mask(positions, positions, causal, doc_ids, doc_ids)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


# -- which handle applies -------------------------------------------------------------------------

# The handle of the model running now, in this thread or task. A model holds its handle itself
# (`model.context_parallel`, set by `bind`); its forward makes it the running one and restores the
# previous one after, so two models with different cp settings in one process (one inside the
# other's forward, or in two threads) each see their own.
_RUNNING: ContextVar[ContextParallel | None] = ContextVar("trident_context_parallel", default=None)


def current() -> ContextParallel | None:
    """The ContextParallel of the model running now (bound by `bind`, or `using`), or None."""
    return _RUNNING.get()


@contextmanager
def using(cp: ContextParallel | None):
    """Make `cp` the handle `attention`, `shard_batch` and friends use inside the block."""
    token = _RUNNING.set(cp)
    try:
        yield cp
    finally:
        _RUNNING.reset(token)


def bind(model: nn.Module, cp: ContextParallel | None) -> None:
    """Give `model` its handle (`model.context_parallel`; None: it runs without cp again): while
    it runs its forward, `cp` is the current handle. Activation checkpointing's recompute happens
    in the backward, outside the forward: models that recompute attention keep their handle
    themselves and pass it as `attention(..., cp=)` (GPT does)."""
    model.context_parallel = cp
    if hasattr(model, "_context_parallel_tokens"):
        return
    model._context_parallel_tokens = []  # one per forward of this model running now
    model.register_forward_pre_hook(_enter)
    model.register_forward_hook(_leave, always_call=True)


def _enter(module: nn.Module, args) -> None:
    module._context_parallel_tokens.append(_RUNNING.set(module.context_parallel))


def _leave(module: nn.Module, args, output) -> None:
    if module._context_parallel_tokens:  # empty if an earlier pre-hook raised before _enter ran
        _RUNNING.reset(module._context_parallel_tokens.pop())
