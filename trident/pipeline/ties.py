"""Weights tied across pipeline stages (`TiedLayerSpec`): which ranks share them, over which group.

A key held by stages S = [s0, s1, ...] gets one process group per pipeline, i.e. per
coordinate on the other axes (dp, cp, ep, tp): the ranks of that pipeline at the stages in S,
group rank k on stage S[k]. The owner (s0, group rank 0) holds the weights as parameters and
the other stages hold copies as buffers (`PipelineModule`). Over this group the copies' fp32
gradient sums travel to the owner after the schedule and the owner's updated weights are
broadcast back after the step (`trident.engine.pipeline_engine`).

The groups come from the mesh (`ParallelMesh.subgroup`), which creates them collectively in the
same order on every rank and caches them, so building a second engine on the same mesh creates
no new groups.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.parallel.mesh import ParallelMesh
from trident.pipeline.module import PipelineModule


@dataclass
class TiedWeights:
    """The weights shared under one key on this rank, and the group of the stages holding them."""

    key: str
    tensors: list[torch.Tensor]  # parameters on the owner, buffer copies elsewhere
    sums: list[torch.Tensor]  # fp32: a copy's accumulated gradient; on the owner, the copies' total
    group: dist.ProcessGroup
    owner: bool


def tie_weights(module: PipelineModule, mesh: ParallelMesh) -> list[TiedWeights]:
    """This rank's tied weights, one entry per key its stage holds (keys on one stage only need none).

    Collective over every rank of the mesh: first every key's groups are created (by every
    rank, also those not holding the key), then the owner's weights are broadcast so every
    copy starts equal; each copy of a trainable weight then requires grad and accumulates its
    gradient in fp32 (a frozen one is left out: it has no gradient to reduce).
    """
    shared = {key: stages for key, stages in module.tied_stages.items() if len(stages) > 1}
    groups = {key: mesh.subgroup("pp", stages, tag=f"tied:{key}") for key, stages in shared.items()}
    ties = []
    for key, group in groups.items():
        if group is None:  # this stage does not hold the key
            continue
        owner = module.owns(key)
        tensors = module.tied_tensors(key)
        sums = [torch.zeros(w.shape, dtype=torch.float32, device=w.device) for w in tensors]
        with torch.no_grad():
            for w in tensors:
                collectives.broadcast(w.data, src=0, group=group)
            # a frozen tied weight (e.g. the embedding under LoRA) needs no gradient path: the
            # owner, which holds the parameter, tells the copies
            trainable = torch.tensor([float(owner and all(w.requires_grad for w in tensors))],
                                     device=tensors[0].device)
            collectives.broadcast(trainable, src=0, group=group)
        if not trainable.item():
            continue
        if not owner:
            for w, total in zip(tensors, sums):
                w.requires_grad_(True)
                w.register_post_accumulate_grad_hook(functools.partial(_accumulate, total))
        ties.append(TiedWeights(key, tensors, sums, group, owner=owner))
    return ties


def _accumulate(total: torch.Tensor, copy: torch.Tensor) -> None:
    """Move a tied copy's fresh gradient into its fp32 sum."""
    total.add_(copy.grad)
    copy.grad = None
