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


class PartitionCheckpoint:
    """`ZeroOptimizer`'s checkpoint side (a mixin): this rank's partition dict, written and read
    back (sub-group by sub-group from NVMe when the optimizer state lives there)."""

    def state_dict(self) -> dict:
        """This rank's partition: layouts, fp32 masters and the optimizer state over them
        (read back sub-group by sub-group from NVMe when offloaded there)."""
        if self.placement.device == "nvme":
            return self._swapped_state_dict()
        masters = {id(m): m.detach().clone() for pg in self.trained for m in pg.masters}
        return self._partition_dict(masters, self.optimizer.state_dict())

    def _partition_dict(self, masters: dict[int, torch.Tensor], optimizer: dict) -> dict:
        """The saved form: per group its layout, chunks and fp32 values (a frozen group's values
        are its shards, read here, so that checkpoints keep frozen parameters)."""
        def values(pg) -> list[torch.Tensor]:
            if pg.opt_group >= 0:
                return [masters[id(m)] for m in pg.masters]
            return [self._read_shard(pg, u, start, end).float().clone() for u, start, end in pg.chunks]
        return {
            "stage": self.stage, "dp_world_size": self.world, "dp_rank": self.rank,
            "groups": [{"opt_group": pg.opt_group, "tp_sharded": pg.tp_sharded, "names": pg.names, "rank": pg.comm.rank,
                        "layout": pg.layout.describe(), "chunks": [list(c) for c in pg.chunks],
                        "masters": values(pg)} for pg in self.groups],
            "optimizer": optimizer,
        }

    def _read_shard(self, pg, u: int, start: int, end: int) -> torch.Tensor:
        if self.param_store is not None:
            return self.param_store.read_range((self.groups.index(pg), u), start, end)
        return self._shard_of(pg, u)[start:end]

    def same_state_layout(self, saved: dict | None) -> bool:
        return saved is not None and same_partitioning(self.state_dict_skeleton(), saved)

    def state_dict_skeleton(self) -> dict:
        """The partition dict's structure (names, chunks), without copying any tensor."""
        return {"groups": [{"names": pg.names, "chunks": [list(c) for c in pg.chunks]} for pg in self.groups]}

    def fill_resharded_state(self, skeleton: dict, param_state, where: str) -> None:
        fill_partition_state(skeleton, param_state)

    def _swapped_state_dict(self) -> dict:
        optimizer = self.optimizer.state_dict()
        index = {id(p): i for i, p in enumerate(p for g in self.optimizer.param_groups for p in g["params"])}
        masters: dict[int, torch.Tensor] = {}
        for s, (pg, k, j) in enumerate(self.sub_groups):
            self.placement.fetch(s)
            for m in pg.masters[k:j]:
                masters[id(m)] = m.detach().clone()
                if m in self.optimizer.state:
                    optimizer["state"][index[id(m)]] = {
                        key: t.clone() if isinstance(t, torch.Tensor) else t
                        for key, t in self.optimizer.state[m].items()}
            self.placement.evict(s, dirty=False)
        return self._partition_dict(masters, optimizer)

    @torch.no_grad()
    def load_state_dict(self, state: dict, load_optimizer_states: bool = True) -> None:
        if state["dp_world_size"] != self.world or len(state["groups"]) != len(self.groups):
            raise ValueError(f"this ZeRO checkpoint partition was written by {state['dp_world_size']} "
                             f"data-parallel ranks with {len(state['groups'])} partition groups; this run has "
                             f"{self.world} ranks and {len(self.groups)} groups. Load it under the same layout, "
                             "or consolidate it (trident checkpoint consolidate) and load the weights")
        for pg, saved in zip(self.groups, state["groups"]):
            if saved["names"] != pg.names or [list(c) for c in pg.chunks] != saved["chunks"]:
                raise ValueError("this ZeRO checkpoint's partition does not match the model (different "
                                 "parameters, bucket sizes or sub_group_size); consolidate it and load the weights")
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])  # in memory until evicted below
        loaded = {id(m): dict(self.optimizer.state.get(m, {})) for pg in self.groups for m in pg.masters}
        saved_masters = {id(m): t for pg, saved in zip(self.groups, state["groups"])
                         for m, t in zip(pg.masters, saved["masters"])}
        for s, (pg, k, j) in enumerate(self.sub_groups):
            self.placement.fetch(s)
            for m in pg.masters[k:j]:
                m.copy_(saved_masters[id(m)])
                if load_optimizer_states:
                    self.optimizer.state[m].update(loaded[id(m)])
            self._write_shards(pg, k, j)
            self.placement.evict(s)
        for pg, saved in zip(self.groups, state["groups"]):
            if pg.opt_group < 0:  # frozen: the saved shards are the values
                for (u, start, _), value in zip(pg.chunks, saved["masters"]):
                    if self.param_store is not None:
                        self.param_store.write_range((self.groups.index(pg), u), start, value)
                    else:
                        self._shard_of(pg, u)[start:start + value.numel()].copy_(value)
        self._finish_update()
