"""ZeRO-3's units and partitions: which parameters are gathered together, and each rank's shards.

A unit is the parameters one module owns directly (a parameter shared by two modules, such as
tied embeddings, belongs to the first in `named_modules()` order). `build_partition` cuts every
unit's flat buffer into this rank's shard, on the device, in (pinned) host memory, or handed to
an NVMe store one unit at a time.
"""

from __future__ import annotations

import torch


def module_units(model: torch.nn.Module, alone=frozenset()) -> tuple[list[list[torch.nn.Parameter]], dict]:
    """Units of the model: each module's directly owned parameters, a shared parameter going to
    its first owner; the modules in `alone` give each parameter a unit of its own (a weight
    gathered in float8, trident.zero.fp8_gather, apart from its bias). Returns the units and,
    per module, the parameters it uses directly."""
    seen: set[int] = set()
    units, uses = [], {}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if own:
            uses[module] = own
        fresh = [p for p in own if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        if fresh and module in alone:
            units.extend([p] for p in fresh)
        elif fresh:
            units.append(fresh)
    return units, uses


@torch.no_grad()
def build_partition(pg, rank: int, world: int, dtype: torch.dtype, gi: int, zero_cfg, store=None):
    """Yield this rank's shard of every unit, built from whole parameters (or from the shards
    `trident.zero.Init` left on them), one unit at a time. The shards are views of
    `pg.partition` (on the device, or in host memory with `offload_param.device` cpu); with an
    NVMe `store` each shard is a temporary handed to the store, and `pg.partition` stays None."""
    from trident.zero.init import full_data
    from trident.zero.offload import host_partition

    layout = pg.layout
    device = pg.params[0].device
    if store is None:
        pg.partition = host_partition(layout.partition_numel, dtype, device, zero_cfg)
    for unit in layout.units:
        lo, hi = unit.shard_range(rank)
        if store is None:
            target = pg.partition[unit.partition_offset:unit.partition_offset + unit.shard]
        else:
            target = torch.zeros(unit.shard, dtype=dtype)
        # Every parameter of the unit, on every rank: gathering zero.Init shards is collective.
        whole = {s.index: full_data(pg.params[s.index]).reshape(-1) for s in unit.slots}
        for slot, a, b in unit.pieces(rank):
            start = slot.offset + a - lo
            target[start:start + (b - a)].copy_(whole[slot.index][a:b])
        del whole
        if store is not None:
            store.create((gi, unit.index), target)
        yield target
