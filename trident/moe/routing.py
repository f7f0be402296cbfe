"""Top-k routing with capacity: which (token, choice) pairs an expert keeps, as pure tensor maths.

The router scores each token against every expert (`logits`, [N, E]); `gates` = softmax(logits).
Choice j of token n is its j-th best expert. Every expert has room for `capacity` assignments
per forward; when more arrive, the earliest in *priority order* win and the rest are dropped
(their contribution to the output is zero; the token's residual path carries it on):

    all first choices before all second choices (DeepSpeed's top-2 rule), and within one
    choice slot, tokens in global order: rank 0's tokens, then rank 1's, ...

"Global order" is what makes expert parallelism drop exactly the tokens one process would
drop. The token set of one forward is every data-parallel rank's micro-batch (the ranks of the
mesh's dense gradient group, dp x cp x ep, in group order), i.e. the micro-batch one process
would run when it holds the whole global batch. Each rank counts its choices per (slot, expert),
the counts are all-gathered (`Routing.counts`, [G, k, E], a few hundred bytes), and every rank
then knows, for every rank, how many of its assignments each expert keeps: the all-to-all
splits follow from the same table, so no second exchange is needed.

    capacity = max(ceil(G * N / E * capacity_factor * k), min_capacity)       (drop_tokens)
    capacity = infinity                                                        (dropless)

This is DeepSpeed's formula over the whole token set instead of one rank's share (DeepSpeed
computes ceil(N / E * cf * k) per rank, so each expert receives up to ep times that): with
one rank the two agree; with many, trident's expert never holds more than the one-process
capacity, and the same tokens are dropped whatever the layout.

Combine weights: with k = 1 the chosen expert's gate; with k >= 2 the kept choices' gates
renormalised to sum to 1 (DeepSpeed's top-2: dropped choices are left out of the sum).

Losses (both differentiable in the router weights, means over the token set):

    load balance  l_aux = E * sum_e me_e * ce_e,  me = mean gate per expert,
                                                  ce = share of tokens whose first choice is e
    router z-loss l_z = mean_n logsumexp(logits_n) ** 2                      (ST-MoE)

ce is counted over the whole token set (from the gathered counts), me over this rank's tokens:
the mean over ranks of E * sum(me_rank * ce) is exactly one process's l_aux, which is what
averaging gradients over the data-parallel ranks computes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

GATE_EPS = torch.finfo(torch.float32).eps  # the renormalising denominator's floor (DeepSpeed's)


def capacity(tokens: int, num_experts: int, k: int, capacity_factor: float, min_capacity: int) -> int:
    """Slots per expert for `tokens` tokens of the whole token set (see the module docstring)."""
    return max(math.ceil(tokens / num_experts * capacity_factor * k), min_capacity)


@dataclass
class Routing:
    """This rank's routing decision for one forward.

    `experts`, `tokens` and `weights` list the kept assignments, sorted by expert (stable: in
    priority order within an expert). `kept` [G, E] is every rank's kept assignments per expert
    (what the all-to-all splits are made of); `counts` [G, k, E] every rank's choices before
    dropping.
    """

    experts: torch.Tensor   # [A] long
    tokens: torch.Tensor    # [A] long, index into this rank's N tokens
    weights: torch.Tensor   # [A] float, differentiable in the gates
    kept: torch.Tensor      # [G, E] long
    counts: torch.Tensor    # [G, k, E] long
    capacity: int | None    # None: dropless
    l_aux: torch.Tensor
    l_z: torch.Tensor


def top_k(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(gates [N, E] = softmax, indices [N, k] of the k best experts, best first)."""
    gates = torch.softmax(logits, dim=-1)
    return gates, torch.topk(logits.detach(), k, dim=-1).indices


def choice_counts(indices: torch.Tensor, num_experts: int) -> torch.Tensor:
    """[k, E]: how many of this rank's tokens chose expert e as their j-th choice."""
    k = indices.shape[1]
    counts = torch.zeros(k, num_experts, dtype=torch.long, device=indices.device)
    return counts.scatter_add_(1, indices.t(), torch.ones_like(indices.t()))


def offsets(counts: torch.Tensor) -> torch.Tensor:
    """[G, k, E]: priority position of rank g's first slot-j assignment to expert e among all
    assignments to e (earlier slots of every rank first, then earlier ranks' slot j)."""
    per_slot = counts.sum(0)                                                     # [k, E]
    before_slot = per_slot.cumsum(0) - per_slot                                  # [k, E]
    before_rank = counts.cumsum(0) - counts                                      # [G, k, E]
    return before_slot.unsqueeze(0) + before_rank


def route(logits: torch.Tensor, gates: torch.Tensor, indices: torch.Tensor, counts: torch.Tensor, me: int,
          capacity_: int | None) -> Routing:
    """Keep, weigh and sort this rank's assignments, given every rank's `counts` and its own
    index `me` among them. `capacity_` None keeps everything (dropless)."""
    n, k = indices.shape
    num_experts = logits.shape[-1]
    start = offsets(counts)                                                      # [G, k, E]
    if capacity_ is None:
        kept = counts.sum(1)
        keep = torch.ones_like(indices, dtype=torch.bool)
    else:
        kept = (capacity_ - start).clamp(min=0).minimum(counts).sum(1)          # [G, E]
        one_hot = torch.nn.functional.one_hot(indices, num_experts)             # [N, k, E]
        before_me = (one_hot.cumsum(0) - one_hot)                                # earlier local tokens, same slot
        position = (before_me + start[me].unsqueeze(0)).mul(one_hot).sum(-1)     # [N, k]
        keep = position < capacity_
    chosen = gates.gather(1, indices) * keep                                     # [N, k]
    if k > 1:
        chosen = chosen / chosen.sum(1, keepdim=True).clamp(min=GATE_EPS)
    slot_major = keep.t().reshape(-1)                                            # priority order: slot, token
    experts = indices.t().reshape(-1)[slot_major]
    tokens = torch.arange(n, device=indices.device).repeat(k)[slot_major]
    weights = chosen.t().reshape(-1)[slot_major]
    order = torch.sort(experts, stable=True).indices
    total = counts.sum(0)[0].sum().clamp(min=1)                                  # tokens in the whole set
    ce = counts.sum(0)[0].to(gates.dtype) / total
    l_aux = num_experts * (gates.mean(0) * ce).sum()
    l_z = torch.logsumexp(logits, dim=-1).square().mean()
    return Routing(experts[order], tokens[order], weights[order], kept, counts, capacity_, l_aux, l_z)
