"""Muon under ZeRO: Newton-Schulz on whole matrices while the optimizer state stays partitioned.

Each rank holds shards of every unit (trident.zero.partition) and, for Muon's param groups, the
momentum of its shards (in the optimizer's state of each fp32 master chunk, so checkpoints save
and reshard it like Adam's moments). Per step and per partition group whose optimizer param
group has `use_muon`:

1. momentum, elementwise on this rank's shards: U = G + momentum * B (or B);
2. each unit's U is all-gathered, so every rank sees each of its matrices whole;
3. each matrix has one *owner* rank (the matrices are dealt largest-cost first to the least
   loaded rank of the group, cost ~ n * m * min(n, m), the Newton-Schulz flops), which
   orthogonalizes it and writes the result into a zero buffer of the unit;
4. the buffers are reduce-scattered (summed: each element has one nonzero contribution, so
   the sum is exact), leaving every rank its shard of the update;
5. decoupled weight decay and the step, elementwise on the shards, as in one process.

A tensor-parallel slice is owned by the same dp rank on every tp rank (their layouts are the
same), so in step 3 the owners of a matrix's slices gather them over the tp group together,
and each keeps its slice of the orthogonalized whole.

Traffic per step: one all-gather and one reduce-scatter of each Muon unit in fp32
(`bytes_per_step`, what each rank sends and receives: 2 * 4 * padded * (world - 1) / world
bytes per unit with ring collectives).
"""

from __future__ import annotations

from typing import Callable

import torch

from trident.comm import collectives
from trident.optim.muon import apply_update, momentum_update, orthogonalize, orthogonalize_tp_slice, tp_spec


def muon_groups(optimizer: torch.optim.Optimizer, groups: list) -> list:
    """The trained partition groups whose optimizer param group Muon steps."""
    return [pg for pg in groups if pg.opt_group >= 0 and optimizer.param_groups[pg.opt_group].get("use_muon")]


def assign_owners(groups: list) -> dict[tuple[int, int], int]:
    """(partition group position, parameter index) -> owner rank in that group's dp group."""
    owners, loads = {}, {}
    work = [(g, s) for g, pg in enumerate(groups) for u in pg.layout.units for s in u.slots]
    work.sort(key=lambda gs: -_ns_cost(gs[1].shape))
    for g, slot in work:
        load = loads.setdefault(groups[g].comm.world, [0] * groups[g].comm.world)
        rank = min(range(len(load)), key=lambda r: load[r])
        load[rank] += _ns_cost(slot.shape)
        owners[(g, slot.index)] = rank
    return owners


def _ns_cost(shape: tuple[int, ...]) -> int:
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
        self.bytes_per_step = sum(2 * 4 * u.padded * (pg.comm.world - 1) // pg.comm.world
                                  for pg in groups for u in pg.layout.units)

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
            device = pg.masters[0].device
            u_shards = [torch.zeros(u.shard, dtype=torch.float32, device=device) for u in pg.layout.units]
            for s, (spg, k, j) in enumerate(sub_groups):
                if spg is not pg:
                    continue
                grads = step_grads(chunk_grads(s), grad_coef)
                for m, grad, (u, start, end) in zip(pg.masters[k:j], grads, pg.chunks[k:j]):
                    state = self.optimizer.state[m]
                    if not state:
                        state["momentum_buffer"] = torch.zeros_like(m)
                    u_shards[u][start:end] = momentum_update(grad, state["momentum_buffer"], group["momentum"],
                                                             group["nesterov"])
            updates = [self._orthogonalized_shard(g, pg, unit, u_shards[unit.index], group)
                       for unit in pg.layout.units]
            for m, (u, start, end) in zip(pg.masters, pg.chunks):
                apply_update(m, updates[u][start:end], group)
            write_shards(pg, 0, len(pg.masters))

    def _orthogonalized_shard(self, g: int, pg, unit, u_shard: torch.Tensor, group: dict) -> torch.Tensor:
        comm = pg.comm
        whole = torch.empty(unit.padded, dtype=u_shard.dtype, device=u_shard.device)
        collectives.all_gather(whole, u_shard, group=comm.group, logger=self.logger)
        out = torch.zeros_like(whole)
        for slot in unit.slots:
            if self.owners[(g, slot.index)] != comm.rank:
                continue
            piece = slice(slot.offset, slot.offset + slot.numel)
            spec = tp_spec(pg.params[slot.index])
            if spec is None:
                out[piece] = orthogonalize(whole[piece], slot.shape, group).reshape(-1)
            else:  # the same owner on every tp rank (same layout): they gather the slices together
                out[piece] = orthogonalize_tp_slice(whole[piece].view(slot.shape), spec, self.tp_group,
                                                    group).reshape(-1)
        shard = torch.empty_like(u_shard)
        collectives.reduce_scatter(shard, out, group=comm.group, logger=self.logger)
        return shard
