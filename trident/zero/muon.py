"""Muon under ZeRO: Newton-Schulz on whole matrices while the optimizer state stays partitioned.

Each rank holds shards of every unit (trident.zero.partition) and, for Muon's param groups, the
momentum of its shards (in the optimizer's state of each fp32 master chunk, so checkpoints save
and reshard it like Adam's moments). Per step and per partition group whose optimizer param
group has `use_muon`:

1. momentum, elementwise on this rank's shards: U = G + momentum * B (or B);
2. each unit (a gradient bucket under stages 1-2, a module under stage 3: whole matrices,
   split evenly over the ranks) has one *owner* rank; the units are dealt largest cost first
   to the least loaded rank of the group (cost ~ n * m * min(n, m) per matrix, the
   Newton-Schulz flops). Every unit's U shards are gathered to its owner, all gathers in
   flight at once;
3. each rank orthogonalizes the matrices of the units it owns -- the ranks at the same time,
   so Newton-Schulz costs each about a world-th of one process's -- and every unit's shards
   are scattered back from its owner, again all at once;
4. decoupled weight decay and the step, elementwise on the shards, as in one process.

A tensor-parallel slice's unit is owned by the same dp rank on every tp rank (their layouts
are the same), so in step 3 those owners gather the slices over the tp group together, and
each keeps its slice of the orthogonalized whole.

Traffic per step (`bytes_per_step`): each unit's world - 1 foreign fp32 shards into its owner
and back, 2 * 4 * shard * (world - 1) bytes per unit over the group, about 8 / world bytes
per Muon parameter per rank: a world-th of what an all-gather and a reduce-scatter of every
unit would move.
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from trident.comm import collectives
from trident.optim.muon import (apply_updates, is_stacked, momentum_updates, orthogonalize, orthogonalize_tp_slice,
                                tp_spec)


def muon_groups(optimizer: torch.optim.Optimizer, groups: list) -> list:
    """The trained partition groups whose optimizer param group Muon steps."""
    return [pg for pg in groups if pg.opt_group >= 0 and optimizer.param_groups[pg.opt_group].get("use_muon")]


def assign_owners(groups: list) -> dict[tuple[int, int], int]:
    """(partition group position, unit index) -> owner rank in that group's dp group: units
    dealt largest Newton-Schulz cost first to the least loaded rank."""
    owners, loads = {}, {}
    work = [(g, u, sum(_ns_cost(s.shape, is_stacked(pg.params[s.index])) for s in u.slots))
            for g, pg in enumerate(groups) for u in pg.layout.units]
    work.sort(key=lambda guc: -guc[2])
    for g, unit, cost in work:
        load = loads.setdefault(groups[g].comm.world, [0] * groups[g].comm.world)
        rank = min(range(len(load)), key=lambda r: load[r])
        load[rank] += cost
        owners[(g, unit.index)] = rank
    return owners


def _ns_cost(shape: tuple[int, ...], stacked: bool = False) -> int:
    """Newton-Schulz's work on a tensor, up to a constant: n m min(n, m) per matrix."""
    if stacked:
        return shape[0] * _ns_cost(tuple(shape[1:]))
    n = shape[0]
    m = 1
    for d in shape[1:]:
        m *= d
    return n * m * min(n, m)


class ShardedMuon:
    """Muon's step for the Muon partition groups of one ZeroOptimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer, groups: list, logger=None, tp_group=None) -> None:
        self.optimizer, self.groups, self.logger, self.tp_group = optimizer, groups, logger, tp_group
        self.owners = assign_owners(groups)
        self.bytes_per_step = sum(2 * 4 * u.shard * (pg.comm.world - 1) for pg in groups for u in pg.layout.units)
        """fp32 bytes gathered to and scattered from the owners, over all ranks (each unit's
        other world - 1 shards, both ways)."""
        self.seconds = {"gather": 0.0, "newton_schulz": 0.0, "scatter": 0.0}
        """Host seconds of the last step's three phases (bench/muon.py compares them with the
        planner on CPU ranks; on a GPU they time the launches, not the kernels)."""

    def owns(self, pg) -> bool:
        return any(pg is g for g in self.groups)

    @torch.no_grad()
    def step(self, sub_groups: list, chunk_grads: Callable[[int], list[torch.Tensor]],
             step_grads: Callable[[list, float], list[torch.Tensor]], grad_coef: float,
             write_shards: Callable) -> None:
        """Step every Muon partition group; `chunk_grads(s)`: sub-group s's gradient chunks,
        `step_grads`: them in fp32 times the coefficient, `write_shards(pg, k, j)`: masters to
        the parameter shards."""
        for g, pg in enumerate(self.groups):
            group = self.optimizer.param_groups[pg.opt_group]
            device = pg.masters[0].device  # the momentum's: the host's under ZeRO-Offload
            u_flat = torch.zeros(pg.layout.partition_numel, dtype=torch.float32, device=device)
            compute = device
            for s, (spg, k, j) in enumerate(sub_groups):
                if spg is not pg:
                    continue
                chunks = chunk_grads(s)
                compute = chunks[0].device  # the gradients' (the model's) device: gathers and Newton-Schulz there
                masters = pg.masters[k:j]
                for m in masters:
                    if not self.optimizer.state[m]:
                        self.optimizer.state[m]["momentum_buffer"] = torch.zeros_like(m)
                momentum_updates(step_grads(chunks, grad_coef),
                                 [self.optimizer.state[m]["momentum_buffer"] for m in masters],
                                 self._pieces(pg, u_flat, k, j), group["momentum"], group["nesterov"])
            if g == 0:
                self.seconds = dict.fromkeys(self.seconds, 0.0)
            if compute != device:  # offloaded: momentum and the step on the host, the matrices on the device
                u_flat = u_flat.to(compute, non_blocking=True)
            updates = self._orthogonalized_shards(g, pg, u_flat, group)
            if compute != device:
                updates = updates.to(device)
            apply_updates(pg.masters, self._pieces(pg, updates, 0, len(pg.masters)), group)
            write_shards(pg, 0, len(pg.masters))

    @staticmethod
    def _pieces(pg, flat: torch.Tensor, k: int, j: int) -> list[torch.Tensor]:
        """Views of `flat` (laid out as the partition: each unit's shard at its offset) under
        master chunks k..j-1."""
        units = pg.layout.units
        return [flat[units[u].partition_offset + start:units[u].partition_offset + end]
                for u, start, end in pg.chunks[k:j]]

    def _orthogonalized_shards(self, g: int, pg, u_flat: torch.Tensor, group: dict) -> torch.Tensor:
        """This rank's shard of every unit's update, laid out as `u_flat` (as the partition):
        each unit's shards gathered to its owner (all gathers issued before any is waited on),
        the owners orthogonalizing their units side by side, the shards scattered back (all at
        once again)."""
        comm, units = pg.comm, pg.layout.units
        u_shards = [u_flat[unit.partition_offset:unit.partition_offset + unit.shard] for unit in units]
        owners = [self.owners[(g, unit.index)] for unit in units]
        wholes: dict[int, torch.Tensor] = {}
        handles = []
        start = time.perf_counter()
        for unit, owner in zip(units, owners):
            parts = None
            if comm.rank == owner:
                wholes[unit.index] = torch.empty(unit.padded, dtype=torch.float32, device=u_shards[0].device)
                parts = list(wholes[unit.index].split(unit.shard))
            handles.append(collectives.gather(u_shards[unit.index], parts, owner, group=comm.group, async_op=True,
                                              logger=self.logger))
        for handle in handles:
            handle.wait()
        gathered = time.perf_counter()
        outs = {i: self._orthogonalized(pg, units[i], whole, group) for i, whole in wholes.items()}
        orthogonalized = time.perf_counter()
        out_flat = torch.empty_like(u_flat)
        shards = [out_flat[unit.partition_offset:unit.partition_offset + unit.shard] for unit in units]
        handles = [collectives.scatter(shards[unit.index], list(outs[unit.index].split(unit.shard))
                                       if unit.index in outs else None, owner, group=comm.group, async_op=True,
                                       logger=self.logger)
                   for unit, owner in zip(units, owners)]
        for handle in handles:
            handle.wait()
        done = time.perf_counter()
        for phase, seconds in (("gather", gathered - start), ("newton_schulz", orthogonalized - gathered),
                               ("scatter", done - orthogonalized)):
            self.seconds[phase] += seconds
        return out_flat

    def _orthogonalized(self, pg, unit, whole: torch.Tensor, group: dict) -> torch.Tensor:
        """A unit's update, made whole on its owner: each matrix orthogonalized (a tp slice
        together with the owners of its other slices, the same dp rank on every tp rank)."""
        out = torch.zeros_like(whole)
        for slot in unit.slots:
            piece = slice(slot.offset, slot.offset + slot.numel)
            param = pg.params[slot.index]
            spec, stacked = tp_spec(param), is_stacked(param)
            if spec is None:
                out[piece] = orthogonalize(whole[piece], slot.shape, group, stacked).reshape(-1)
            else:
                out[piece] = orthogonalize_tp_slice(whole[piece].view(slot.shape), spec, self.tp_group, group,
                                                    stacked).reshape(-1)
        return out
