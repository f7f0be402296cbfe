"""The ZeRO optimizer wrapper: partitions, master weights, the sharded step and parameter sync.

`ZeroOptimizer` takes the user's optimizer (built over the model's parameters) and rebinds it
to this rank's partition. Parameters are split into *partition groups*, one per optimizer
param group and per kind of parameter (tensor-parallel shards and replicated ones are kept
apart, because their gradient norms are summed over different groups). Each partition group
has a `ShardedLayout` (trident.zero.partition) and:

- stage 1-2: the model's parameters become views of one flat, N-padded parameter buffer in
  the compute dtype; stage 3 keeps only this rank's shards (trident.zero.stage3 gathers them);
- gradients: whole and local until the window's end (stage 1, trident.zero.stage1) or
  reduce-scattered during backward into a partition (stages 2-3, trident.zero.stage2);
- master weights: this rank's shards in fp32 (views of the parameters themselves in fp32
  training), cut into chunks of at most `sub_group_size` elements. The optimizer steps one
  sub-group at a time, so fp32 gradient temporaries never exceed `sub_group_size` elements.

After the step, stages 1-2 all-gather the updated shards so every rank has whole parameters
again (in groups of about `allgather_bucket_size` elements); stage 3 does not.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from trident.comm import collectives
from trident.comm.logger import CommsLogger
from trident.zero.partition import ShardedLayout, bucketed_groups, layout_from_groups, round_robin_order
from trident.comm.buckets import GradScaling
from trident.zero.stage1 import FullGradients
from trident.zero.stage2 import ShardedGradients
from trident.zero.stage3 import Stage3Coordinator, build_partition, module_units


@dataclass
class PartitionGroup:
    """Parameters of one optimizer param group and one kind (tp-sharded or not)."""

    opt_group: int
    tp_sharded: bool
    params: list[torch.nn.Parameter]
    names: list[str]
    layout: ShardedLayout
    norm_groups: tuple
    unit_starts: list[int] = field(default_factory=list)   # stage 1-2: unit offsets in `flat`
    flat: torch.Tensor | None = None                        # stage 1-2: whole parameters
    partition: torch.Tensor | None = None                   # stage 3: this rank's shards
    grads: FullGradients | ShardedGradients | None = None
    masters: list[torch.nn.Parameter] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (unit, start, end) in the shard


class ZeroOptimizer:
    """ZeRO stages 1-3 for one engine: the engine-facing side of the gradient and step path."""

    def __init__(self, stage: int, optimizer: torch.optim.Optimizer, named_params: dict[int, str], mesh,
                 zero_cfg, dtype: torch.dtype, predivide_factor: float, prescale: bool,
                 logger: CommsLogger | None, model: torch.nn.Module | None = None) -> None:
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("the optimizer passed to trident.initialize already has state; pass a fresh "
                             "optimizer (or its config) so ZeRO can partition its state")
        self.stage, self.optimizer, self.mesh, self.cfg = stage, optimizer, mesh, zero_cfg
        self.dtype, self.logger = dtype, logger
        self.group = mesh.dp_group
        self.world, self.rank = mesh.dp_size, mesh.dp_rank
        self.scaling = GradScaling(self.world, predivide_factor, prescale)
        self.groups: list[PartitionGroup] = []
        self.coordinator = None
        stage3_units = uses = None
        if stage == 3:
            stage3_units, uses = module_units(model)
        for g, param_group in enumerate(optimizer.param_groups):
            params = [p for p in param_group["params"] if p.requires_grad]
            for sharded in (False, True):
                mine = [p for p in params if bool(getattr(p, "tensor_model_parallel", False)) == sharded]
                if mine:
                    self.groups.append(self._make_group(g, sharded, mine, named_params, stage3_units))
        for g, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [m for pg in self.groups if pg.opt_group == g for m in pg.masters]
        self.param_to_group = {id(p): pg for pg in self.groups for p in pg.params}
        self.numel = sum(pg.layout.numel for pg in self.groups)
        for pg in self.groups:
            for p in pg.params:
                p._trident_zero = self  # lets zero.GatheredParameters find the partition
                for attr in ("_trident_shard", "_trident_shape", "_trident_group"):
                    if hasattr(p, attr):
                        delattr(p, attr)  # zero.Init's shards now live in the partition
        if stage == 3:
            self.coordinator = Stage3Coordinator(self, model, uses)

    # -- construction ----------------------------------------------------------------------

    def _make_group(self, g: int, sharded: bool, params: list, names: dict, stage3_units) -> PartitionGroup:
        norm_groups = (self.group,) + ((self.mesh.tp_group,) if sharded and self.mesh.tp_size > 1 else ())
        if self.stage == 3:
            index = {id(p): i for i, p in enumerate(params)}
            groups = [[(index[id(p)], tuple(getattr(p, "_trident_shape", p.shape))) for p in unit if id(p) in index]
                      for unit in stage3_units]
            layout = layout_from_groups([u for u in groups if u], self.world)
        else:
            shapes = [tuple(p.shape) for p in params]
            order = round_robin_order(len(params), self.world) if self.cfg.round_robin_gradients else None
            layout = layout_from_groups(bucketed_groups(shapes, self.cfg.reduce_bucket_size, order), self.world)
        pg = PartitionGroup(g, sharded, params, [names.get(id(p), "?") for p in params], layout, norm_groups)
        if self.stage < 3:
            self._flatten_params(pg)
        else:
            build_partition(pg, self.rank, self.world, self.dtype)
            self._make_masters(pg, [self._shard_of(pg, u.index) for u in pg.layout.units])
        self._make_grads(pg)
        return pg

    @torch.no_grad()
    def _flatten_params(self, pg: PartitionGroup) -> None:
        """Stage 1-2: move the parameters into one flat buffer; each becomes a view of it."""
        starts, total = [], 0
        for u in pg.layout.units:
            starts.append(total)
            total += u.padded
        pg.unit_starts = starts
        device = pg.params[0].device
        pg.flat = torch.zeros(total, dtype=self.dtype, device=device)
        for u in pg.layout.units:
            for s in u.slots:
                view = pg.flat[starts[u.index] + s.offset:starts[u.index] + s.offset + s.numel].view(s.shape)
                view.copy_(pg.params[s.index].data)
                pg.params[s.index].data = view
        self._make_masters(pg, [self._param_shard(pg, u.index) for u in pg.layout.units])

    def _param_shard(self, pg: PartitionGroup, u: int) -> torch.Tensor:
        lo, hi = pg.layout.units[u].shard_range(self.rank)
        return pg.flat[pg.unit_starts[u] + lo:pg.unit_starts[u] + hi]

    def _make_masters(self, pg: PartitionGroup, shards: list[torch.Tensor]) -> None:
        """fp32 master chunks of this rank's shards, at most `sub_group_size` elements each."""
        size = self.cfg.sub_group_size
        for u, shard in enumerate(shards):
            for start in range(0, max(shard.numel(), 1), size):
                end = min(start + size, shard.numel())
                piece = shard[start:end]
                data = piece if piece.dtype == torch.float32 else piece.detach().float().clone()
                pg.masters.append(torch.nn.Parameter(data))
                pg.chunks.append((u, start, end))

    def _make_grads(self, pg: PartitionGroup) -> None:
        overlap = self.cfg.overlap_comm
        if self.stage == 1:
            pg.grads = FullGradients(pg.params, pg.layout, pg.unit_starts, self.group, self.rank, self.dtype,
                                     overlap, self.cfg.reduce_scatter, self.scaling, self.logger)
            return
        if self.stage == 2:
            buckets = [[u.index] for u in pg.layout.units]
        else:
            buckets = [[u.index for u in units] for units in _group_units(pg.layout, self.cfg.reduce_bucket_size)]
        pg.grads = ShardedGradients(pg.params, pg.layout, buckets, self.group, self.dtype, overlap,
                                    self.cfg.contiguous_gradients, self.scaling, self.logger,
                                    on_unit_ready=functools.partial(self._unit_ready, pg),
                                    reduce_scatter=self.cfg.reduce_scatter, rank=self.rank)

    def _unit_ready(self, pg: PartitionGroup, u: int) -> None:
        if self.coordinator is not None:
            self.coordinator.unit_ready(self.groups.index(pg), u)

    # -- the engine-facing gradient path ----------------------------------------------------

    def start_backward(self, boundary: bool) -> None:
        for pg in self.groups:
            pg.grads.start_backward(boundary)

    def finish_backward(self) -> None:
        for pg in self.groups:
            pg.grads.finish_backward()
        if self.coordinator is not None:
            self.coordinator.end_backward()

    def zero_grad(self) -> None:
        for pg in self.groups:
            pg.grads.zero_grad()

    def _grad_of_chunk(self, pg: PartitionGroup, k: int, flat: torch.Tensor | None) -> torch.Tensor:
        u, start, end = pg.chunks[k]
        if self.stage == 1:
            return pg.grads.shard(u)[start:end]
        offset = pg.layout.units[u].partition_offset
        return flat[offset + start:offset + end]

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple]]:
        """(this rank's gradient shards, groups their norm is summed over), per partition group."""
        parts = []
        for pg in self.groups:
            if self.stage == 1:
                tensors = [pg.grads.shard(u.index) for u in pg.layout.units]
            else:
                tensors = [pg.grads.flat()]
            parts.append((tensors, pg.norm_groups))
        return parts

    def nonfinite_names(self) -> list[str]:
        """Parameters with a NaN or inf in the part of their gradient this rank holds."""
        bad = []
        for pg in self.groups:
            flat = pg.grads.flat() if self.stage > 1 else None
            for unit in pg.layout.units:
                lo, _ = unit.shard_range(self.rank)
                shard = pg.grads.shard(unit.index) if self.stage == 1 else \
                    flat[unit.partition_offset:unit.partition_offset + unit.shard]
                for slot, a, b in unit.pieces(self.rank):
                    piece = shard[slot.offset + a - lo:slot.offset + b - lo]
                    if not torch.isfinite(piece.float().sum()):
                        bad.append(pg.names[slot.index])
        return bad

    @torch.no_grad()
    def optimizer_step(self, grad_coef: float) -> None:
        """Step the partitions sub-group by sub-group, with gradients multiplied by `grad_coef`
        (1 / loss scale, times the clipping factor), then bring the parameters up to date."""
        size = self.cfg.sub_group_size
        for pg in self.groups:
            flat = pg.grads.flat() if self.stage > 1 else None
            k = 0
            while k < len(pg.masters):
                j, total = k, 0
                while j < len(pg.masters) and (j == k or total + pg.masters[j].numel() <= size):
                    total += pg.masters[j].numel()
                    j += 1
                for i in range(k, j):
                    g = self._grad_of_chunk(pg, i, flat)
                    g = g.float() if g.dtype != torch.float32 else g  # a temporary of one sub-group
                    if grad_coef != 1.0:
                        g.mul_(grad_coef)  # the gradient partition is rewritten next window anyway
                    pg.masters[i].grad = g
                self.optimizer.step()
                for i in range(k, j):
                    pg.masters[i].grad = None
                k = j
            self._sync_params(pg)
        if self.coordinator is not None:
            self.coordinator.refresh_persistent()

    def _sync_params(self, pg: PartitionGroup) -> None:
        """Write the updated masters back into the (16-bit) parameter shards and, for stages
        1-2, all-gather them so every rank holds whole parameters again."""
        for (u, start, end), m in zip(pg.chunks, pg.masters):
            target = self._shard_of(pg, u)[start:end]
            if target.data_ptr() != m.data_ptr():
                target.copy_(m)
        if self.stage < 3:
            self._all_gather_units(pg)

    def _shard_of(self, pg: PartitionGroup, u: int) -> torch.Tensor:
        if self.stage < 3:
            return self._param_shard(pg, u)
        unit = pg.layout.units[u]
        return pg.partition[unit.partition_offset:unit.partition_offset + unit.shard]

    def _all_gather_units(self, pg: PartitionGroup) -> None:
        if self.world == 1:
            return
        handles = []
        for units in _group_units(pg.layout, self.cfg.allgather_bucket_size, padded=True):
            if len(units) == 1:
                u = units[0]
                full = pg.flat[pg.unit_starts[u.index]:pg.unit_starts[u.index] + u.padded]
                mine = self._param_shard(pg, u.index).clone()
                handles.append((None, collectives.all_gather(full, mine, group=self.group, async_op=True,
                                                             logger=self.logger)))
            else:
                mine = torch.cat([self._param_shard(pg, u.index) for u in units])
                out = torch.empty(self.world, mine.numel(), dtype=mine.dtype, device=mine.device)
                handles.append(((units, out), collectives.all_gather(out, mine, group=self.group,
                                                                     async_op=True, logger=self.logger)))
        for spread, handle in handles:
            handle.wait()
            if spread is not None:
                units, out = spread
                col = 0
                for u in units:
                    start = pg.unit_starts[u.index]
                    pg.flat[start:start + u.padded].view(self.world, u.shard).copy_(out[:, col:col + u.shard])
                    col += u.shard

    def key_of(self, p: torch.nn.Parameter) -> tuple[int, int]:
        """(partition group position, unit index) of a parameter (stage 3 gathers by unit)."""
        pg = self.param_to_group[id(p)]
        index = next(i for i, q in enumerate(pg.params) if q is p)
        unit = pg.layout.unit_of()[index]
        return self.groups.index(pg), unit.index

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Reset the fp32 masters from the parameters' shards (after they were changed in place)."""
        for pg in self.groups:
            for (u, start, end), m in zip(pg.chunks, pg.masters):
                source = self._shard_of(pg, u)[start:end]
                if source.data_ptr() != m.data_ptr():
                    m.copy_(source)

    # -- accounting and state ----------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states (fp32 masters included) held here."""
        params = grads = states = 0
        for pg in self.groups:
            if pg.flat is not None:
                params += pg.flat.numel() * pg.flat.element_size()
            if pg.partition is not None:
                params += pg.partition.numel() * pg.partition.element_size()
                params += self.coordinator.live_numel_of(pg) * pg.partition.element_size()
            if isinstance(pg.grads, FullGradients):
                grads += pg.grads.buffer.numel() * pg.grads.buffer.element_size()
            else:
                grads += pg.grads.nbytes()
            for m in pg.masters:
                if self.dtype != torch.float32:  # fp32 masters are separate copies only then
                    states += m.numel() * 4
                for t in self.optimizer.state.get(m, {}).values():
                    if isinstance(t, torch.Tensor) and t.dim() > 0:
                        states += t.numel() * t.element_size()
        return {"parameters": params, "gradients": grads, "optimizer_states": states}

    def state_dict(self) -> dict:
        """This rank's partition: layouts, fp32 masters and the optimizer state over them."""
        return {
            "stage": self.stage, "dp_world_size": self.world, "dp_rank": self.rank,
            "groups": [{"opt_group": pg.opt_group, "tp_sharded": pg.tp_sharded, "names": pg.names,
                        "layout": pg.layout.describe(), "chunks": [list(c) for c in pg.chunks],
                        "masters": [m.detach().clone() for m in pg.masters]} for pg in self.groups],
            "optimizer": self.optimizer.state_dict(),
        }

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
            for m, t in zip(pg.masters, saved["masters"]):
                m.copy_(t)
            self._sync_params(pg)
        if self.coordinator is not None:
            self.coordinator.refresh_persistent()
        if load_optimizer_states:
            self.optimizer.load_state_dict(state["optimizer"])


def _group_units(layout: ShardedLayout, size: int, padded: bool = False) -> list[list]:
    """Consecutive units cut into groups of at most `size` elements (a larger unit alone)."""
    groups, current, total = [], [], 0
    for u in layout.units:
        n = u.padded if padded else u.numel
        if current and total + n > size:
            groups.append(current)
            current, total = [], 0
        current.append(u)
        total += n
    if current:
        groups.append(current)
    return groups
