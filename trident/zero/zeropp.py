"""ZeRO++ for stage 3: what each switch needs, and the node groups built from the mesh.

- `zero_quantized_weights` (qwZ): parameter all-gathers send int8 blocks plus scales
  (`trident.compression.quantize.WEIGHTS`); `zero_quantized_nontrainable_weights` does the same
  for frozen parameters, whose shards are also stored rounded to those int8 values.
- `zero_hpz_partition_size` (hpZ): every rank also keeps a secondary shard of each unit, 1/H of
  it, partitioned over the H ranks of its node; backward gathers from those, inside the node.
- `zero_quantized_gradients` (qgZ): `trident.compression.hierarchical.HierarchicalReduceScatter`.

A *node* is a block of consecutive data-parallel ranks. Its size is the hpZ size when that is
above 1, else the number of ranks sharing this host (every rank reports its host name once).
Groups come from `ParallelMesh.subgroup` along the dp axis, so they exist per pipeline stage
and tensor-parallel rank, and nothing lives in module globals.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch.distributed as dist

from trident.comm import collectives
from trident.compression.hierarchical import HierarchicalReduceScatter
from trident.compression.quantize import WEIGHTS, BlockQuantizer

_KEYS = ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
         "zero_hpz_partition_size")


@dataclass
class ZeroPlusPlus:
    """The ZeRO++ switches of one ZeroOptimizer, resolved against its data-parallel group."""

    weights: BlockQuantizer | None           # qwZ for trained parameters
    frozen_weights: BlockQuantizer | None    # qwZ for frozen ones (zero_quantized_nontrainable_weights)
    hpz: int                                 # ranks per secondary partition; 1 = off
    node_group: dist.ProcessGroup | None     # this rank's hpZ group (its node)
    node_rank: int                           # position in it
    gradients: HierarchicalReduceScatter | None

    def quantizer_for(self, frozen: bool) -> BlockQuantizer | None:
        return self.frozen_weights if frozen else self.weights


def switched_on(cfg) -> list[str]:
    """The ZeRO++ keys of `cfg` (a ZeroConfig) that are on."""
    return [k for k in _KEYS if getattr(cfg, k) is True or (type(getattr(cfg, k)) is int and getattr(cfg, k) > 1)]


def build(cfg, mesh, world: int, rank: int, logger) -> ZeroPlusPlus | None:
    """The resolved switches, or None when every one is off (stage 3 then runs unchanged).
    Collective over the mesh when hpZ or qgZ is on (group creation)."""
    on = switched_on(cfg)
    if not on:
        return None
    if mesh.cp_size > 1 or mesh.ep_size > 1:
        raise ValueError(f"zero_optimization.{on[0]} needs context_parallel.size = expert_parallel.size = 1 "
                         f"(got cp={mesh.cp_size}, ep={mesh.ep_size}): ZeRO++ nodes are blocks of the dp axis")
    hpz = max(cfg.zero_hpz_partition_size, 1)
    if world % hpz:
        raise ValueError(f"zero_optimization.zero_hpz_partition_size = {hpz} does not divide the data-parallel size "
                         f"{world}; the secondary partition splits each node's copy over hpz ranks: choose a "
                         f"divisor of {world} (the ranks per node), or 1 to switch it off")
    node_group = _node_groups(mesh, world, hpz)[0] if hpz > 1 else None
    gradients = None
    if cfg.zero_quantized_gradients and world > 1:
        local = hpz if hpz > 1 else _ranks_per_host(mesh, world)
        intra, inter = _node_groups(mesh, world, local)
        gradients = HierarchicalReduceScatter(intra, inter, local, world // local, logger)
    return ZeroPlusPlus(weights=WEIGHTS if cfg.zero_quantized_weights else None,
                        frozen_weights=WEIGHTS if cfg.zero_quantized_nontrainable_weights else None,
                        hpz=hpz, node_group=node_group, node_rank=rank % hpz, gradients=gradients)


def plan_units(zeropp: ZeroPlusPlus | None, units: dict, persistent: set) -> tuple[dict, set]:
    """Per stage-3 unit key: its qwZ quantizer (trained or frozen weights, when switched on), and whether it
    keeps a secondary shard (hpZ). Persistent units are gathered only after the step, exactly
    and from the whole group; expert units stay on their own group."""
    if zeropp is None:
        return {}, set()
    quantizer, hpz = {}, set()
    for key, (pg, _) in units.items():
        if key in persistent or pg.expert:
            continue
        q = zeropp.quantizer_for(pg.opt_group < 0)
        if q is not None:
            quantizer[key] = q
        if zeropp.hpz > 1:
            hpz.add(key)
    return quantizer, hpz


def _node_groups(mesh, world: int, local: int) -> tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]:
    """(this rank's node: `local` consecutive dp ranks, the ranks at its local index on every
    node); None for a group of one. Collective on first use of each size."""
    nodes = world // local
    intra = inter = None
    if local > 1:
        for k in range(nodes):
            group = mesh.subgroup("dp", range(k * local, (k + 1) * local), tag=f"zeropp_node{local}")
            intra = group if group is not None else intra
    if nodes > 1:
        for j in range(local):
            group = mesh.subgroup("dp", range(j, world, local), tag=f"zeropp_cross{local}")
            inter = group if group is not None else inter
    return intra, inter


def _ranks_per_host(mesh, world: int) -> int:
    """Data-parallel ranks per host, from every rank's host name; hosts must hold equal blocks
    of consecutive dp ranks (torchrun's numbering)."""
    hosts: list = [None] * world
    collectives.all_gather_object(hosts, socket.gethostname(), group=mesh.dp_group)
    local = hosts.count(hosts[0])
    blocks = [hosts[i:i + local] for i in range(0, world, local)]
    if world % local or any(len(set(b)) != 1 for b in blocks) or len({b[0] for b in blocks}) != len(blocks):
        raise ValueError(f"zero_optimization.zero_quantized_gradients needs each host to hold the same number of "
                         f"consecutive data-parallel ranks, got hosts {hosts}; set zero_hpz_partition_size to the "
                         f"ranks per node to name the nodes")
    return local
