"""ZeRO's checkpoint state format: a rank's partition dict, and filling it from whole tensors.

`ZeroOptimizer.state_dict()` holds, per partition group, its `ShardedLayout`, the parameter
names, the (unit, start, end) chunks that are stepped as separate optimizer parameters, and
their fp32 masters; the optimizer state is keyed by optimizer index. Resharding a checkpoint
(trident.checkpointing.reshard) hands whole tensors per parameter name; `fill_partition_state`
cuts this rank's shards out of them.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from trident.optim.state import own_state
from trident.zero.partition import ShardedLayout


def chunk_indices(part: dict) -> list[list[int]]:
    """For each partition group of a ZeRO partition dict, the optimizer index of each master
    chunk: ZeroOptimizer lists, per optimizer param group, the chunks of its partition groups
    in order, and torch numbers parameters across param groups in that order."""
    param_groups = part["optimizer"]["param_groups"]
    out: list[list[int]] = [[] for _ in part["groups"]]
    for g, pgroup in enumerate(param_groups):
        order = iter(pgroup["params"])
        for gi, group in enumerate(part["groups"]):
            if group["opt_group"] == g:
                out[gi] = [next(order) for _ in group["masters"]]
    return out


def same_partitioning(mine: dict, saved: dict) -> bool:
    """Two partition dicts cut the same parameters into the same chunks."""
    def cut(part: dict) -> list:
        return [(g["names"], [list(c) for c in g["chunks"]]) for g in part.get("groups", [])]
    return cut(mine) == cut(saved)


def fill_partition_state(skeleton: dict, param_state: Callable[[str], Any]) -> None:
    """Fill a fresh partition dict (masters and optimizer state of this rank's shards) from
    `param_state(name)`: a ParamState with the whole master and per-element states."""
    states: dict[int, dict] = {}
    for group, indices in zip(skeleton["groups"], chunk_indices(skeleton)):
        rank = group.get("rank", skeleton["dp_rank"])  # expert groups partition over a group of their own
        layout = ShardedLayout.from_dict(group["layout"])
        named = {name: param_state(name) for name in group["names"]}
        keys = sorted({k for ps in named.values() for k in ps.per_element()})
        scalars = next(({k: v for k, v in ps.state.items() if k not in keys} for ps in named.values()), {})
        shards: dict[str, list[torch.Tensor]] = {key: [] for key in ["master", *keys]}
        for unit in layout.units:
            lo, hi = unit.shard_range(rank)
            flat = {key: torch.zeros(hi - lo) for key in shards}
            for slot, a, b in unit.pieces(rank):
                ps = named[group["names"][slot.index]]
                start = slot.offset + a - lo
                flat["master"][start:start + b - a] = ps.master.reshape(-1)[a:b]
                for key in keys:
                    flat[key][start:start + b - a] = ps.state[key].reshape(-1)[a:b]
            for key in shards:
                shards[key].append(flat[key])
        masters = []
        for k, (u, start, end) in enumerate(group["chunks"]):
            masters.append(shards["master"][u][start:end].clone())
            if group["opt_group"] >= 0:  # frozen groups (-1) carry values only
                states[indices[k]] = {**own_state(scalars), **{key: shards[key][u][start:end].clone()
                                                               for key in keys}}
        group["masters"] = masters
    skeleton["optimizer"]["state"] = states
