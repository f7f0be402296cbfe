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

`offload_optimizer` (trident.zero.offload) decides where the masters and optimizer states
live: with the parameters, in host memory (the step on the CPU), or in one NVMe swap file per
sub-group, read in (and the next one read ahead) around that sub-group's step. Offloaded
masters are always separate fp32 copies, also in fp32 training. Stage 3's `offload_param`
keeps the parameter partition in host memory (cpu) or in one swap file per unit (nvme,
`param_store`, trident.zero.nvme.ParamSwapper): the step then writes the updated shards into
the files. `placement_bytes()` says where the model states are; `close()` removes swap files
(also done at exit).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from trident.comm.logger import CommsLogger
from trident.moe.parallel import is_expert
from trident.parallel.mesh import DENSE_GRADIENT_AXES, EXPERT_GRADIENT_AXES, gradient_group
from trident.optim.step import LocalStep
from trident.zero.partition import ShardedLayout, bucketed_groups, group_units, layout_from_groups, round_robin_order
from trident.zero.param_sync import all_gather_params
from trident.comm.buckets import GradScaling
from trident.zero.stage1 import FullGradients
from trident.zero.stage2 import ShardedGradients
from trident.zero.offload import make_param_store, make_placement
from trident.zero.stage3 import Stage3Coordinator
from trident.zero.units import build_partition, module_units
from trident.zero.state import PartitionCheckpoint
from trident.zero.muon import ShardedMuon, muon_groups
import trident.zero.zeropp as zeropp


@dataclass
class ReductionGroup:
    """The ranks a partition group is sharded and reduced over, and its averaging."""

    group: dist.ProcessGroup
    world: int
    rank: int
    scaling: GradScaling


@dataclass
class PartitionGroup:
    """Parameters of one optimizer param group and one kind (tp-sharded or not). Under stage 3
    frozen parameters form groups of their own (opt_group -1): partitioned and gathered like the
    others, with no gradients and no masters; their chunks cover whole unit shards so that
    checkpoints carry their values."""

    opt_group: int
    tp_sharded: bool
    params: list[torch.nn.Parameter]
    names: list[str]
    layout: ShardedLayout
    norm_groups: tuple
    comm: ReductionGroup | None = None                      # dense: the dp group; experts: their own
    expert: bool = False
    unit_starts: list[int] = field(default_factory=list)   # stage 1-2: unit offsets in `flat`
    flat: torch.Tensor | None = None                        # stage 1-2: whole parameters
    partition: torch.Tensor | None = None                   # stage 3: this rank's shards
    grads: FullGradients | ShardedGradients | None = None
    masters: list[torch.nn.Parameter] = field(default_factory=list)
    chunks: list[tuple[int, int, int]] = field(default_factory=list)  # (unit, start, end) in the shard


class ZeroOptimizer(PartitionCheckpoint, LocalStep):
    """ZeRO stages 1-3 for one engine: the engine-facing side of the gradient and step path
    (a `trident.engine.strategy.GradientStrategy`)."""

    per_rank_state = True  # each dp rank writes its own partition
    averaged_gradients = False  # gradients live in partitioned buffers, not on the parameters

    def __init__(self, stage: int, optimizer: torch.optim.Optimizer, named_params: dict[int, str], mesh,
                 zero_cfg, dtype: torch.dtype, predivide_factor: float, prescale: bool,
                 logger: CommsLogger | None, model: torch.nn.Module | None = None, aio=None,
                 frozen: list[torch.nn.Parameter] = (), comm_dtype: torch.dtype | None = None, fp8_modules=()) -> None:
        if any(len(s) for s in optimizer.state.values()):
            raise ValueError("the optimizer passed to trident.initialize already has state; pass a fresh "
                             "optimizer (or its config) so ZeRO can partition its state")
        self.stage, self.optimizer, self.mesh, self.cfg = stage, optimizer, mesh, zero_cfg
        self.zero_stage, self.partitions_parameters = stage, stage == 3
        self.dtype, self.logger = dtype, logger
        self.comm_dtype = comm_dtype or dtype  # `communication_data_type` of the gradient reductions
        # requires_grad=False: no gradient, no optimizer state, no traffic. Stages 1-2 keep them whole
        # on every rank (counted in full as parameters); stage 3 partitions them like the others.
        self.frozen = list(frozen) if stage < 3 else []
        # ZeRO partitions over the ranks that replicate the parameters (dp, and cp / ep once they
        # exist): the mesh's gradient group, which is the dp group itself while cp = ep = 1.
        # Expert weights (trident.moe) are partitioned over their own group, dp x cp, and form
        # partition groups of their own (as frozen parameters do under stage 3); every group
        # averages over all data-parallel ranks, dp x cp x ep.
        trained = [p for g in optimizer.param_groups for p in g["params"]]
        self.group = gradient_group(mesh, [p for p in trained if not is_expert(p)])
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        average_over = mesh.topology.size(DENSE_GRADIENT_AXES)
        self.scaling = GradScaling(average_over, predivide_factor, prescale)
        self.comms = {False: ReductionGroup(self.group, self.world, self.rank, self.scaling)}
        if any(is_expert(p) for p in trained):
            group = mesh.group(*EXPERT_GRADIENT_AXES)
            self.comms[True] = ReductionGroup(group, dist.get_world_size(group), dist.get_rank(group), self.scaling)
        self.zeropp = zeropp.build(zero_cfg, mesh, self.world, self.rank, logger) if stage == 3 else None
        self.groups: list[PartitionGroup] = []
        self.sub_groups: list[tuple[PartitionGroup, int, int]] = []  # (group, first chunk, end chunk)
        self.coordinator = None
        self._grad_views: dict[int, tuple] = {}   # sub-group -> (gradient buffer, its chunk views)
        self._shard_views: dict[int, list] = {}   # sub-group -> its parameter shard views
        aio = aio if aio is not None else _default_aio()
        global_rank = dist.get_rank() if dist.is_initialized() else 0
        estimate = _partition_estimate(optimizer, self.world)
        self.placement = make_placement(zero_cfg, aio, optimizer, global_rank, estimate)
        self.param_store = make_param_store(zero_cfg, aio, dtype, global_rank, estimate) if stage == 3 else None
        stage3_units = uses = None
        if stage == 3:  # fp8_modules (fp8.all_gather): Float8Linear layers whose weights gather as float8
            stage3_units, uses = module_units(model, alone=frozenset(fp8_modules))
        for g, param_group in enumerate(optimizer.param_groups):
            params = [p for p in param_group["params"] if p.requires_grad]
            for sharded in (False, True):
                for expert in (False, True):
                    mine = [p for p in params if bool(getattr(p, "tensor_model_parallel", False)) == sharded
                            and is_expert(p) == expert]
                    if mine:
                        self.groups.append(self._make_group(g, sharded, mine, named_params, stage3_units, expert))
        self.trained = list(self.groups)  # the groups with gradients and masters
        frozen = list({id(p): p for p in frozen}.values())
        for sharded in (False, True) if stage == 3 else ():
            mine = [p for p in frozen if bool(getattr(p, "tensor_model_parallel", False)) == sharded]
            if mine:
                self.groups.append(self._make_group(-1, sharded, mine, named_params, stage3_units))
        for g, param_group in enumerate(optimizer.param_groups):
            param_group["params"] = [m for pg in self.groups if pg.opt_group == g for m in pg.masters]
        self.param_to_group = {id(p): pg for pg in self.groups for p in pg.params}
        self.numel = sum(pg.layout.numel for pg in self.trained)
        for pg in self.groups:
            for p in pg.params:
                p._trident_zero = self  # lets zero.GatheredParameters find the partition
                for attr in ("_trident_shard", "_trident_shape", "_trident_group"):
                    if hasattr(p, attr):
                        delattr(p, attr)  # zero.Init's shards now live in the partition
        if stage == 3:
            self.coordinator = Stage3Coordinator(self, model, uses, fp8_modules)
        mine = muon_groups(optimizer, self.trained)  # Newton-Schulz on whole matrices (trident.zero.muon)
        self.muon = ShardedMuon(optimizer, mine, logger, mesh.tp_group if mesh.tp_size > 1 else None) if mine else None

    # -- construction ----------------------------------------------------------------------

    def _is_muon(self, g: int) -> bool:
        """Whether optimizer param group `g` is one Muon steps (its matrices need owners)."""
        return g >= 0 and bool(self.optimizer.param_groups[g].get("use_muon"))

    def _make_group(self, g: int, sharded: bool, params: list, names: dict, stage3_units,
                    expert: bool = False) -> PartitionGroup:
        comm = self.comms[expert]
        norm_groups = (comm.group,) + ((self.mesh.tp_group,) if sharded and self.mesh.tp_size > 1 else ())
        if expert and self.mesh.ep_size > 1:
            norm_groups += (self.mesh.ep_group,)  # ep ranks hold other experts
        if self.stage == 3:
            index = {id(p): i for i, p in enumerate(params)}
            groups = [[(index[id(p)], tuple(getattr(p, "_trident_shape", p.shape))) for p in unit if id(p) in index]
                      for unit in stage3_units]
            layout = layout_from_groups([u for u in groups if u], comm.world)
        else:
            shapes = [tuple(p.shape) for p in params]
            order = round_robin_order(len(params), comm.world) if self.cfg.round_robin_gradients else None
            # Muon's matrices a unit each: owners are dealt per matrix (trident.zero.muon), and
            # stage 2 reduces them in buckets of reduce_bucket_size all the same (`_make_grads`)
            bucket = 1 if self._is_muon(g) else self.cfg.reduce_bucket_size
            layout = layout_from_groups(bucketed_groups(shapes, bucket, order), comm.world)
        pg = PartitionGroup(g, sharded, params, [names.get(id(p), "?") for p in params], layout, norm_groups,
                            comm, expert)
        if self.stage < 3:
            self._flatten_params(pg)
        else:
            shards = build_partition(pg, comm.rank, comm.world, self.dtype, len(self.groups), self.cfg,
                                     self.param_store)
            if g < 0:  # frozen: shards only
                shards = list(shards)
                if self.zeropp is not None and self.zeropp.frozen_weights is not None:
                    _round_to_int8(shards, self.zeropp.frozen_weights)
                pg.chunks = [(u.index, 0, shard.numel()) for u, shard in zip(pg.layout.units, shards)]
                return pg
            self._make_masters(pg, shards)
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
        lo, hi = pg.layout.units[u].shard_range(pg.comm.rank)
        return pg.flat[pg.unit_starts[u] + lo:pg.unit_starts[u] + hi]

    def _make_masters(self, pg: PartitionGroup, shards) -> None:
        """fp32 master chunks of this rank's shards, at most `sub_group_size` elements each,
        grouped into sub-groups of at most `sub_group_size` elements (a larger chunk alone),
        each handed to the placement as soon as it is complete."""
        size = self.cfg.sub_group_size
        first, total = 0, 0
        for u, shard in enumerate(shards):
            for start in range(0, max(shard.numel(), 1), size):
                end = min(start + size, shard.numel())
                if len(pg.masters) > first and total + (end - start) > size:
                    self._close_sub_group(pg, first)
                    first, total = len(pg.masters), 0
                pg.masters.append(torch.nn.Parameter(self.placement.make_master(shard[start:end])))
                pg.chunks.append((u, start, end))
                total += end - start
        if len(pg.masters) > first:
            self._close_sub_group(pg, first)

    def _close_sub_group(self, pg: PartitionGroup, first: int) -> None:
        self.sub_groups.append((pg, first, len(pg.masters)))
        self.placement.adopt(len(self.sub_groups) - 1, pg.masters[first:])

    def _make_grads(self, pg: PartitionGroup) -> None:
        overlap = self.cfg.overlap_comm
        if self.stage == 1:
            pg.grads = FullGradients(pg.params, pg.layout, pg.unit_starts, pg.comm.group, pg.comm.rank, self.dtype,
                                     overlap, self.cfg.reduce_scatter, pg.comm.scaling, self.logger, self.comm_dtype)
            return
        if self.stage == 2 and self._is_muon(pg.opt_group):  # a unit per matrix, in backward order
            buckets = [[u.index for u in units] for units in group_units(pg.layout, self.cfg.reduce_bucket_size)]
        elif self.stage == 2:
            buckets = [[u.index] for u in pg.layout.units]
        else:
            # Stage 3's units follow the modules' forward order; backward produces their gradients
            # in reverse, and buckets launch strictly in list order: list them last-module first,
            # or every bucket's staging buffer would wait for the first module's gradients.
            buckets = [[u.index for u in units]
                       for units in group_units(pg.layout, self.cfg.reduce_bucket_size)][::-1]
        pg.grads = ShardedGradients(pg.params, pg.layout, buckets, pg.comm.group, self.dtype, overlap,
                                    self.cfg.contiguous_gradients, pg.comm.scaling, self.logger,
                                    on_unit_ready=functools.partial(self._unit_ready, pg),
                                    reduce_scatter=self.cfg.reduce_scatter, rank=pg.comm.rank,
                                    comm_dtype=self.comm_dtype,
                                    reducer=self.zeropp.gradients if self.zeropp and not pg.expert else None)
        # ZeRO-Offload to host memory: copy each bucket down as it lands (a host fp32 copy of the
        # whole partition, as DeepSpeed keeps; NVMe offload keeps host memory to one sub-group)
        if self.placement.device == "cpu" and self.cfg.contiguous_gradients:
            pg.grads.on_reduced = self.placement.gradients.copy_down

    def _unit_ready(self, pg: PartitionGroup, u: int) -> None:
        if self.coordinator is not None:
            self.coordinator.unit_ready(self.groups.index(pg), u)

    # -- the engine-facing gradient path ----------------------------------------------------

    def start_backward(self, boundary: bool) -> None:
        for pg in self.trained:
            pg.grads.start_backward(boundary)

    def finish_backward(self) -> None:
        for pg in self.trained:
            pg.grads.finish_backward()
        if self.coordinator is not None:
            self.coordinator.end_backward()

    def zero_grad(self) -> None:
        for pg in self.trained:
            pg.grads.zero_grad()
        staging = getattr(self.placement, "gradients", None)
        if staging is not None:
            staging.window_done()

    def _grad_of_chunk(self, pg: PartitionGroup, k: int, flat: torch.Tensor | None) -> torch.Tensor:
        u, start, end = pg.chunks[k]
        if self.stage == 1:
            return pg.grads.shard(u)[start:end]
        offset = pg.layout.units[u].partition_offset
        return flat[offset + start:offset + end]

    def grad_parts(self) -> list[tuple[list[torch.Tensor], tuple]]:
        """(this rank's gradient shards, groups their norm is summed over), per partition group."""
        parts = []
        for pg in self.trained:
            if self.stage == 1:
                tensors = [pg.grads.shard(u.index) for u in pg.layout.units]
            else:
                tensors = [pg.grads.flat()]
            parts.append((tensors, pg.norm_groups))
        return parts

    def nonfinite_names(self) -> list[str]:
        """Parameters with a NaN or inf in the part of their gradient this rank holds."""
        bad = []
        for pg in self.trained:
            flat = pg.grads.flat() if self.stage > 1 else None
            for unit in pg.layout.units:
                lo, _ = unit.shard_range(pg.comm.rank)
                shard = pg.grads.shard(unit.index) if self.stage == 1 else \
                    flat[unit.partition_offset:unit.partition_offset + unit.shard]
                for slot, a, b in unit.pieces(pg.comm.rank):
                    piece = shard[slot.offset + a - lo:slot.offset + b - lo]
                    if not torch.isfinite(piece.float().sum()):
                        bad.append(pg.names[slot.index])
        return bad

    @torch.no_grad()
    def optimizer_step(self, grad_coef: float) -> None:
        """Step the partitions sub-group by sub-group, with gradients multiplied by `grad_coef`
        (1 / loss scale, times the clipping factor), then bring the parameters up to date."""
        for s, (pg, k, j) in enumerate(self.sub_groups):
            if self.muon is not None and self.muon.owns(pg):
                continue
            self.placement.fetch(s)
            self.placement.prefetch(s + 1)
            masters = pg.masters[k:j]
            for m, g in zip(masters, self.placement.step_grads(self._chunk_grads(s), grad_coef)):
                m.grad = g
            self.optimizer.step()
            for m in masters:
                m.grad = None
            self._write_shards(pg, k, j, s)
            self.placement.evict(s)
        if self.muon is not None:
            self.muon.step(self.sub_groups, self._chunk_grads, self.placement.step_grads, grad_coef, self._write_shards)
        self._finish_update()

    def _chunk_grads(self, s: int) -> list[torch.Tensor]:
        """Sub-group `s`'s gradient chunks: views of the gradient partition, made once and reused
        while the partition's buffer stays the same (it does, with `contiguous_gradients`)."""
        pg, k, j = self.sub_groups[s]
        flat = pg.grads.flat() if self.stage > 1 else pg.grads.buffer
        cached = self._grad_views.get(s)
        if cached is None or cached[0] is not flat:
            cached = self._grad_views[s] = (flat, [self._grad_of_chunk(pg, i, flat) for i in range(k, j)])
        return cached[1]

    def _finish_update(self) -> None:
        """After every sub-group was updated: offload writes finished, stages 1-2 re-gather the
        whole parameters, stage 3 refreshes its persistent (unpartitioned) ones."""
        self.placement.drain()
        for pg in self.groups:
            if self.stage < 3:
                all_gather_params(pg.flat, pg.unit_starts, pg.layout, pg.comm.rank, pg.comm.world, pg.comm.group,
                                  self.cfg.allgather_bucket_size, self.logger)
        if self.coordinator is not None:
            self.coordinator.refresh_persistent()

    def _write_shards(self, pg: PartitionGroup, k: int, j: int, s: int | None = None) -> None:
        """Copy masters k..j-1 (resident) into the (16-bit) parameter shards (or their swap files);
        `s`, the sub-group they make up, lets the shard views be made once."""
        if self.param_store is not None:
            for (u, start, end), m in zip(pg.chunks[k:j], pg.masters[k:j]):
                self.param_store.write_range((self.groups.index(pg), u), start, m)
            return
        targets = self._shard_views.get(s) if s is not None else None
        if targets is None:
            targets = [self._shard_of(pg, u)[start:end] for u, start, end in pg.chunks[k:j]]
            if s is not None:
                self._shard_views[s] = targets
        self.placement.copy_back(targets, pg.masters[k:j])

    def _shard_of(self, pg: PartitionGroup, u: int) -> torch.Tensor:
        if self.stage < 3:
            return self._param_shard(pg, u)
        unit = pg.layout.units[u]
        return pg.partition[unit.partition_offset:unit.partition_offset + unit.shard]

    def key_of(self, p: torch.nn.Parameter) -> tuple[int, int]:
        """(partition group position, unit index) of a parameter (stage 3 gathers by unit)."""
        pg = self.param_to_group[id(p)]
        index = next(i for i, q in enumerate(pg.params) if q is p)
        unit = pg.layout.unit_of()[index]
        return self.groups.index(pg), unit.index

    @torch.no_grad()
    def reload_masters(self) -> None:
        """Reset the fp32 masters from the parameters' shards (after they were changed in place)."""
        for s, (pg, k, j) in enumerate(self.sub_groups):
            self.placement.fetch(s)
            for (u, start, end), m in zip(pg.chunks[k:j], pg.masters[k:j]):
                if self.param_store is not None:
                    source = self.param_store.read_range((self.groups.index(pg), u), start, end)
                else:
                    source = self._shard_of(pg, u)[start:end]
                if source.data_ptr() != m.data_ptr():
                    m.copy_(source)
            self.placement.evict(s)
        self.placement.drain()

    # -- accounting and state ----------------------------------------------------------------

    def memory_breakdown(self) -> dict[str, int]:
        """Bytes of parameters, gradients and optimizer states (fp32 masters included) held here."""
        params = sum(p.numel() * p.element_size() for p in self.frozen)
        grads = states = 0
        for pg in self.groups:
            if pg.flat is not None:
                params += pg.flat.numel() * pg.flat.element_size()
            if self.stage == 3:
                if pg.partition is not None and self.cfg.offload_param.device == "none":
                    params += pg.partition.numel() * pg.partition.element_size()
                params += self.coordinator.live_numel_of(pg) * self.dtype.itemsize
                params += self.coordinator.secondary_numel_of(pg) * self.dtype.itemsize  # hpZ
            if pg.grads is None:  # frozen
                continue
            if isinstance(pg.grads, FullGradients):
                grads += pg.grads.buffer.numel() * pg.grads.buffer.element_size()
            else:
                grads += pg.grads.nbytes()
            # fp32 masters are separate copies only in 16-bit training (or when offloaded)
            states += self.placement.placement(pg.masters, self.dtype != torch.float32)["device"]
        return {"parameters": params, "gradients": grads, "optimizer_states": states}

    def frozen_bytes(self) -> int:
        """Frozen parameters held whole (stages 1-2) or as this rank's shards (stage 3, on the device)."""
        whole = sum(p.numel() * p.element_size() for p in self.frozen)
        on_device = self.cfg.offload_param.device == "none"
        return whole + sum(pg.partition.numel() * pg.partition.element_size() for pg in self.groups
                           if pg.opt_group < 0 and pg.partition is not None and on_device)

    def placement_bytes(self) -> dict[str, int]:
        """Bytes of this rank's model states in device memory, host memory and on NVMe."""
        where = {"device": sum(self.memory_breakdown().values()), "host": 0, "nvme": 0}
        if self.param_store is not None:
            where["nvme"] += self.param_store.bytes_on_disk()
        elif self.stage == 3 and self.cfg.offload_param.device == "cpu":
            where["host"] += sum(pg.partition.numel() * pg.partition.element_size() for pg in self.groups)
        if self.placement.device != "none":
            masters = [m for pg in self.groups for m in pg.masters]
            for k, v in self.placement.placement(masters, True).items():
                where[k] += v
        return where

    def close(self) -> None:
        """Remove swap files and stop I/O threads (NVMe offload); idempotent."""
        self.placement.close()
        if self.param_store is not None:
            self.param_store.close()

    def partitions(self, t: torch.Tensor) -> bool:
        return self.partitions_parameters and id(t) in self.param_to_group

    def full_shape(self, t: torch.Tensor) -> tuple[int, ...]:
        """A parameter's shape as the model defines it (under stage 3 its data is a placeholder)."""
        if id(t) not in self.param_to_group:
            return tuple(t.shape)
        pg = self.param_to_group[id(t)]
        index = next(i for i, q in enumerate(pg.params) if q is t)
        return next(s.shape for u in pg.layout.units for s in u.slots if s.index == index)


@torch.no_grad()
def _round_to_int8(shards: list[torch.Tensor], quantizer) -> None:
    """zero_quantized_nontrainable_weights: frozen shards hold their int8-block values, so the
    quantized gathers of them are (up to float rounding) what is stored."""
    for shard in shards:
        if shard.numel():
            quantizer.dequantize(quantizer.quantize(shard.view(1, -1)), shard.numel(), out=shard.view(1, -1))


def _default_aio():
    from trident.config.schema import AioConfig

    return AioConfig()


def _partition_estimate(optimizer: torch.optim.Optimizer, world: int) -> int:
    """Elements of this rank's partition, before the layout exists (checks free disk space)."""
    total = sum(math.prod(getattr(p, "_trident_shape", p.shape)) for g in optimizer.param_groups
                for p in g["params"] if p.requires_grad)
    return -(-total // world)
