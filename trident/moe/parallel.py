"""Applying expert parallelism to a model built with every expert, and telling expert
parameters apart.

A model is built whole on every rank (every MoE layer holding all E experts, drawn from the
seed), exactly as one process would build it; `apply_expert_parallel` then drops the experts
other ep ranks hold. That is the tensor-parallel recipe (full weight, then slice): seed-equal
means serial-equal, whatever the ep size.
"""

from __future__ import annotations

import torch
from torch import nn

from trident.comm.logger import CommsLogger
from trident.moe.dispatch import moe_all_to_all_bytes


def moe_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of every `trident.moe.MoE` in `model`."""
    from trident.moe.layer import MoE
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def apply_expert_parallel(model: nn.Module, mesh, logger: CommsLogger | None = None) -> nn.Module:
    """Keep this ep rank's experts in every MoE layer of `model` and route over `mesh`.

    With ep = 1 the layers keep every expert and only learn the mesh (capacity and the
    load-balancing statistics are then counted over every data-parallel rank's tokens)."""
    for _, layer in moe_layers(model):
        if layer.token_group is None:
            layer.shard(mesh, logger)
    return model


def is_expert(param: torch.Tensor) -> bool:
    """Whether `param` belongs to an expert (replicated over dp x cp only, split over ep)."""
    return bool(getattr(param, "expert_parallel", False))


def expert_stats(model: nn.Module) -> dict[str, dict]:
    """Per MoE layer, its last forward's load over the whole token set (`MoE.load_stats`):
    choices and kept assignments per expert, dropped share. Every rank gets the same numbers."""
    return {name: layer.load_stats() for name, layer in moe_layers(model)}


def moe_metrics(model: nn.Module) -> dict[str, float]:
    """Scalars for the monitor (nothing for a dense model): the dropped share of all choices and
    the busiest expert's load over the mean load, averaged over MoE layers (1.0 = balanced)."""
    stats = [s for s in expert_stats(model).values() if s]
    if not stats:
        return {}
    dropped = sum(s["dropped_share"] for s in stats) / len(stats)
    imbalance = sum(max(s["chosen"]) * len(s["chosen"]) / max(sum(s["chosen"]), 1) for s in stats) / len(stats)
    return {"moe_dropped_share": dropped, "moe_max_load": imbalance}


def moe_events(model: nn.Module, samples: int) -> list[tuple[str, float, int]]:
    """Monitor events of the last forward's routing: per MoE layer each expert's share of the
    choices and the dropped share (none for a dense model)."""
    events = []
    for name, s in expert_stats(model).items():
        if not s:
            continue
        total = max(sum(s["chosen"]), 1)
        events += [(f"Train/MoE/{name}/expert{e}_load", c / total, samples) for e, c in enumerate(s["chosen"])]
        events.append((f"Train/MoE/{name}/dropped_share", s["dropped_share"], samples))
    return events


def moe_summary(model: nn.Module) -> list[str]:
    """One log line per MoE layer: choices per expert and the dropped share."""
    return [f"{name or 'moe'}: expert load {s['chosen']}, dropped {100 * s['dropped_share']:.1f}%"
            for name, s in expert_stats(model).items() if s]


def describe_moe(model: nn.Module, mesh, tokens_per_micro_batch: int | None = None) -> str | None:
    """The start-up line of a model with MoE layers: experts per rank, expert bytes here, and
    the all-to-all bytes per layer and micro-batch (`moe_all_to_all_bytes`, which the planner
    uses too; None if dense)."""
    layers = moe_layers(model)
    if not layers:
        return None
    from trident.monitor.log import format_bytes

    first = layers[0][1]
    here = sum(p.numel() * p.element_size() for p in model.parameters() if is_expert(p))
    text = (f"MoE: {len(layers)} layer(s) x {first.num_experts} experts, top-{first.k}, "
            f"{len(first.experts)} per rank (ep {mesh.ep_size}); expert weights here {format_bytes(here)}; capacity "
            f"{'dropless' if not first.drop_tokens else f'factor {first.capacity_factor:g}, over all data-parallel ranks'}")
    if tokens_per_micro_batch and mesh.ep_size > 1:
        width = first.hidden_size * next(model.parameters()).element_size()
        sent = moe_all_to_all_bytes(tokens_per_micro_batch, width, first.k, mesh.ep_size, 1)
        text += f"; all-to-all out per layer and micro-batch {format_bytes(sent)} forward, as much backward"
    return text
