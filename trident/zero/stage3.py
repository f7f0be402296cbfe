"""ZeRO stage 3: parameters live as shards and are gathered module by module, just in time.

Each module's own parameters (not its children's) form one unit (trident.zero.partition). A
rank keeps only its shard of every unit. Hooks on each module:

- before forward: all-gather the units the module needs (one all-gather per unit, straight
  into the unit's flat buffer, the parameters becoming views of it);
- after forward: release them (the parameter's data becomes an empty tensor again), unless
  the recorded trace says they are needed again within `stage3_max_reuse_distance` elements;
  and wrap the outputs so that backward reaching the module gathers the units again;
- in backward a unit is released once every one of its parameters has produced its gradient
  (trident.zero.stage2 reports that), which also makes tied parameters and modules called
  several times per forward safe: a unit stays whole until its last use.

Prefetch: the order of gathers on the first step is recorded; afterwards, each gather also
starts the asynchronous gathers of the next modules in that order, up to
`stage3_prefetch_bucket_size` elements and `stage3_max_live_parameters` gathered elements.
Units whose parameters are all at most `stage3_param_persistence_threshold` elements (layer
norms, biases) stay whole on every rank; only their gradients and optimizer states are
partitioned, and they are re-gathered after each step.

Offload (`offload_param`): with device cpu the partition lives in (pinned) host memory and
each shard is copied to the device just before its all-gather; with device nvme each unit's
shard lives in its own swap file (trident.zero.nvme.ParamSwapper), read before the gather,
read ahead along the recorded trace (up to `offload_param.buffer_count` units), and dropped
once the gather has it; the step writes updated shards back into the files.

A parameter shared by two modules (tied embeddings) belongs to the unit of the first module in
`named_modules()` order; every module that holds it gathers that unit.

ZeRO++ (trident.zero.zeropp; off = none of this runs): with qwZ a unit's gather sends each
rank's shard as int8 blocks (QUANT) and its whole value is int8-rounded until released; with hpZ
every gather from the whole group also keeps this rank's secondary shard (1/hpz of the unit),
and until the next optimizer step the unit is gathered from those inside the node (NODE).
`zero.GatheredParameters` and checkpoints always gather the stored values (`exact`).

FP8 all-gather (`fp8.all_gather`, trident.zero.fp8_gather; off = none of this runs): the weight
of each torchao Float8Linear is a unit of its own, gathered as float8 bytes (FP8) with the
whole weight's scale, and the layer's matmul takes the gathered float8 weight directly.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from trident.comm import collectives
import trident.zero.zeropp as zeropp
from trident.zero.stage3_hooks import gather_in_backward, linear_forward

_Key = tuple[int, int]  # (partition group position, unit index)

PLAIN, QUANT, NODE, FP8 = "plain", "quant", "node", "fp8"  # how a unit is gathered (Stage3Coordinator._mode)

_COALESCE_BELOW = 1 << 16
"""ZeRO++ gathers of units with fewer elements share one collective (latency-bound); larger ones
each get their own, straight into their buffer (bandwidth-bound, and no extra copy)."""


class Stage3Coordinator:
    """Gathers and releases parameter units around each module's forward and backward."""

    def __init__(self, zero, model: torch.nn.Module, uses: dict, fp8_modules=()) -> None:
        self.zero, self.cfg = zero, zero.cfg
        self.units = {(gi, u.index): (pg, u) for gi, pg in enumerate(zero.groups) for u in pg.layout.units}
        key_of_param = {id(pg.params[s.index]): (gi, u.index)
                        for gi, pg in enumerate(zero.groups) for u in pg.layout.units for s in u.slots}
        self.keys_of = {m: sorted({key_of_param[id(p)] for p in ps if id(p) in key_of_param})
                        for m, ps in uses.items()}
        self.keys_of = {m: k for m, k in self.keys_of.items() if k}
        self.device = next(pg.params[0].device for pg in zero.groups)
        threshold = self.cfg.stage3_param_persistence_threshold
        self.persistent = {key for key, (pg, u) in self.units.items()
                           if all(s.numel <= threshold for s in u.slots)}
        self.full: dict[_Key, torch.Tensor] = {}
        self.held: set[_Key] = set()  # gathered for zero.GatheredParameters: not released by hooks
        self.peak_numel = 0  # most gathered elements at once (full or on their way), since start
        self._live_numel = 0  # gathered elements now (live_numel() without the sums)
        self.zeropp = getattr(zero, "zeropp", None)
        self.secondary: dict[_Key, torch.Tensor] = {}  # hpZ: this rank's 1/hpz of a unit, valid until the step
        self.inexact: set[_Key] = set()  # whole units holding int8-rounded values (qwZ), not the stored ones
        self._quantizer, self._hpz_keys = zeropp.plan_units(self.zeropp, self.units, self.persistent)
        self.pending: dict[_Key, tuple[torch.Tensor, Any]] = {}
        self._stride_cache: dict[_Key, list[tuple[int, ...]]] = {}
        self._shard_views: dict[_Key, torch.Tensor] = {}
        self._empties: dict[tuple, torch.Tensor] = {}
        self.trace: list | None = None
        self._recording: list = []
        self._cursor = 0
        self._next_use: list[dict[_Key, int]] = []
        self._cum: list[int] = []
        self._hooks = [model.register_forward_pre_hook(self._on_root_forward)]
        for m in self.keys_of:
            self._hooks.append(m.register_forward_pre_hook(self._pre_forward))
            self._hooks.append(m.register_forward_hook(self._post_forward))
        self._hooks.append(model.register_forward_hook(self._on_root_done))
        for m in self.keys_of:
            if type(m) is torch.nn.Linear:
                m.forward = functools.partial(linear_forward, m)  # see zero.stage3_hooks.Stage3Linear
        self.fp8 = None  # trident.zero.fp8_gather.Float8Gather with fp8.all_gather
        fp8 = {key_of_param[id(m.weight)]: m for m in fp8_modules if id(m.weight) in key_of_param}
        fp8 = {key: m for key, m in fp8.items() if not self.units[key][0].expert}
        if fp8:
            from trident.zero.fp8_gather import Float8Gather
            self.fp8 = Float8Gather(self, fp8)
        for key in self.units:
            self._release(key, force=True)
        self.refresh_persistent()

    # -- gather and release ------------------------------------------------------------------

    def numel(self, key: _Key) -> int:
        return self.units[key][1].padded

    def live_numel(self) -> int:
        return sum(t.numel() for t in self.full.values()) + sum(self.numel(k) for k in self.pending)

    def _launch(self, keys: list[_Key], exact: bool = False) -> None:
        """Start gathering units: all plain gathers of one group as one coalesced collective, each
        unit into its own buffer (`_launch_plain`). The ZeRO++ gathers (int8 rows, secondary
        shards) join their inputs side by side, so rank r's row of the result holds its shards and
        each unit is copied out whole: worth it for small units only, where the per-call latency
        dominates (layer norms, biases); a large one goes alone, straight into its buffer."""
        keys = [k for k in dict.fromkeys(keys) if k not in self.full and k not in self.pending]
        by_group: dict[tuple, list[_Key]] = {}  # expert units gather over their own group (trident.moe)
        for key in keys:
            mode = self._mode(key, exact)
            if mode not in (PLAIN, FP8) and self.numel(key) >= _COALESCE_BELOW:
                self._launch_batch([key], mode)
            else:
                by_group.setdefault((mode, id(self.units[key][0].comm.group)), []).append(key)
        for (mode, _), batch in by_group.items():
            self._launch_batch(batch, mode)

    def _mode(self, key: _Key, exact: bool) -> str:
        """How a unit is gathered: from the whole group (PLAIN), as int8 blocks (QUANT, qwZ),
        from the secondary shards inside the node (NODE, hpZ), or as float8 bytes (FP8, a
        Float8Linear's weight under fp8.all_gather)."""
        if exact:
            return PLAIN
        if self.fp8 is not None and key in self.fp8.modules:
            return FP8
        if self.zeropp is None:
            return PLAIN
        if key in self.secondary:
            return NODE
        return QUANT if key in self._quantizer else PLAIN

    def _launch_batch(self, keys: list[_Key], mode: str = PLAIN) -> None:
        if mode in (PLAIN, FP8):
            self._launch_plain(keys, mode)
            return
        if mode == NODE:
            shards = [self.secondary[key] for key in keys]
            group, world = self.zeropp.node_group, self.zeropp.hpz
        else:
            shards = [self._shard(key) for key in keys]
            comm = self.units[keys[0]][0].comm  # the same for every key of a batch
            group, world = comm.group, comm.world
        mine = shards[0] if len(keys) == 1 else torch.cat(shards)
        quantizer = self._quantizer[keys[0]] if mode == QUANT and world > 1 else None
        numel = mine.numel()
        if quantizer is not None:
            send = quantizer.quantize(mine.view(1, -1))
            out = torch.empty(world, send.shape[1], dtype=send.dtype, device=send.device)
            mine = send
        elif len(keys) == 1:
            out = torch.empty(world * mine.numel(), dtype=mine.dtype, device=mine.device)
        else:
            out = torch.empty(world, mine.numel(), dtype=mine.dtype, device=mine.device)
        if world == 1:
            out.view(-1).copy_(mine)
            handle = None
        else:
            handle = collectives.all_gather(out, mine, group=group, async_op=True, logger=self.zero.logger)
        batch = _Gather(keys, out, handle, mine, mode, quantizer, shards[0].dtype, numel)
        for key in keys:
            self.pending[key] = batch
        self._live_numel += sum(self.numel(key) for key in keys)
        self.peak_numel = max(self.peak_numel, self._live_numel)

    def _launch_plain(self, keys: list[_Key], mode: str = PLAIN) -> None:
        """Gather units from the whole group, each straight into a buffer of its own (one
        coalesced collective for all of them: no joined input, no copy out of a joint result);
        FP8: each shard cast to float8 bytes first (trident.zero.fp8_gather)."""
        shards = [self.fp8.cast(key) if mode == FP8 else self._shard(key) for key in keys]
        comm = self.units[keys[0]][0].comm  # the same for every key of a batch
        outs = [torch.empty(comm.world * s.numel(), dtype=s.dtype, device=s.device) for s in shards]
        if comm.world == 1:
            torch._foreach_copy_(outs, shards)
            handle = None
        else:
            handle = collectives.all_gather_coalesced(outs, shards, group=comm.group, async_op=True,
                                                      logger=self.zero.logger)
        batch = _Gather(keys, None, handle, shards, mode, None, shards[0].dtype, 0, outs)
        for key in keys:
            self.pending[key] = batch
        self._live_numel += sum(self.numel(key) for key in keys)
        self.peak_numel = max(self.peak_numel, self._live_numel)

    def _shard(self, key: _Key) -> torch.Tensor:
        """This rank's shard of a unit on the parameters' device: read from its swap file
        (offload_param nvme), copied from host memory (cpu), or a view of the partition."""
        pg, unit = self.units[key]
        if self.zero.param_store is not None:
            shard = self.zero.param_store.take(key)
        else:
            shard = self._shard_views.get(key)
            if shard is None:  # the partition lives as long as the coordinator: one view per unit
                shard = self._shard_views[key] = pg.partition[unit.partition_offset:unit.partition_offset + unit.shard]
        if shard.device != self.device:
            shard = shard.to(self.device, non_blocking=True)
        return shard

    def _wait(self, key: _Key) -> None:
        batch = self.pending.get(key)
        if batch is None:
            return
        if batch.handle is not None:
            batch.handle.wait()
        if batch.quantizer is not None:  # qwZ: every rank's int8 row back to values, once per batch
            rows = batch.out
            batch.out = batch.quantizer.dequantize(rows, batch.numel, batch.dtype)
            batch.quantizer = None
        col = 0
        for i, k in enumerate(batch.keys):
            pg, unit = self.units[k]
            width = unit.padded // self.zeropp.hpz if batch.mode == NODE else unit.shard
            if batch.outs is not None:
                full = batch.outs[i]
            elif len(batch.keys) == 1:
                full = batch.out.view(-1)
            else:
                full = batch.out[:, col:col + width].reshape(-1)  # a copy: the rows are strided
            col += width
            if self.pending.pop(k, None) is None:
                continue
            if batch.mode == FP8:
                self.fp8.arrived(k, full)
                self.inexact.add(k)  # the Parameter holds no values: zero.GatheredParameters gathers again
            else:
                base = full.storage_offset()
                for s, stride in zip(unit.slots, self._strides(k)):
                    pg.params[s.index].data = full.as_strided(s.shape, stride, base + s.offset)
            self.full[k] = full
            if self.zeropp is not None:
                self._gathered(k, full, batch.mode)

    def _gathered(self, key: _Key, full: torch.Tensor, mode: str) -> None:
        """ZeRO++ bookkeeping of a unit made whole: int8-rounded or not, and (hpZ, gathered from
        the whole group) this rank's secondary shard, which backward gathers from in the node."""
        if mode == QUANT or (mode == NODE and key in self._quantizer):  # secondary shards of an int8 gather
            self.inexact.add(key)
        if mode != NODE and key in self._hpz_keys:
            size = full.numel() // self.zeropp.hpz
            j = self.zeropp.node_rank
            self.secondary[key] = full[j * size:(j + 1) * size].clone()

    def _strides(self, key: _Key) -> list[tuple[int, ...]]:
        """Contiguous strides of each parameter of a unit (computed once)."""
        strides = self._stride_cache.get(key)
        if strides is None:
            strides = self._stride_cache[key] = [_contiguous_strides(s.shape) for s in self.units[key][1].slots]
        return strides

    def _placeholder(self, p: torch.Tensor) -> torch.Tensor:
        """The empty tensor a released parameter points at: one per dtype and device, shared, so a
        release allocates nothing and dispatches no operator."""
        key = (p.dtype, p.device)
        empty = self._empties.get(key)
        if empty is None:
            empty = self._empties[key] = torch.empty(0, dtype=p.dtype, device=p.device)
        return empty

    def secondary_numel_of(self, pg) -> int:
        """Elements of one partition group's secondary (hpZ) shards held now."""
        return sum(t.numel() for k, t in self.secondary.items() if self.units[k][0] is pg)

    def gather(self, keys, exact: bool = False) -> None:
        """Make the units whole now (one collective for the ones not already on their way);
        `exact`: with the stored values, not int8-rounded ones nor from the secondary shards."""
        self._launch(list(keys), exact)
        for key in keys:
            self._wait(key)

    def _release(self, key: _Key, force: bool = False) -> None:
        if (key in self.persistent or key in self.held) and not force:
            return
        if key in self.pending:
            self._wait(key)
        pg, unit = self.units[key]
        for s in unit.slots:
            p = pg.params[s.index]
            p.data = self._placeholder(p)
        if self.full.pop(key, None) is not None:
            self._live_numel -= self.numel(key)
        self.inexact.discard(key)
        if self.fp8 is not None:
            self.fp8.released(key)

    def live_numel_of(self, pg) -> int:
        """Gathered (whole) elements of one partition group's units right now."""
        return sum(self.numel(k) for k in list(self.full) + list(self.pending) if self.units[k][0] is pg)

    def hold(self, keys) -> None:
        """Gather units and keep them whole until `unhold` (zero.GatheredParameters)."""
        if self.zeropp is not None or self.fp8 is not None:
            for key in sorted(keys):
                self._wait(key)
                if key in self.inexact:
                    self._release(key, force=True)  # int8-rounded (qwZ) or float8: gather the stored values
        self.gather(sorted(keys), exact=True)
        self.held.update(keys)

    @torch.no_grad()
    def unhold(self, keys, write_back: bool) -> None:
        """End a hold; with `write_back`, the whole values become the shards (and masters)."""
        for key in sorted(keys):
            self.held.discard(key)
            self.secondary.pop(key, None)
            if write_back:
                pg, unit = self.units[key]
                lo, hi = unit.shard_range(pg.comm.rank)
                if self.zero.param_store is not None:
                    self.zero.param_store.write_range(key, 0, self.full[key][lo:hi])
                else:
                    pg.partition[unit.partition_offset:unit.partition_offset + unit.shard].copy_(self.full[key][lo:hi])
            self._release(key)
        if write_back:
            self.zero.reload_masters()
            if self.fp8 is not None:
                self.fp8.stale()

    def release_all(self) -> None:
        for key in list(self.full) + list(self.pending):
            self._release(key)

    @torch.no_grad()
    def refresh_persistent(self) -> None:
        """Re-gather the units kept whole (after each optimizer step updated their shards); the
        secondary (hpZ) shards are stale from now on: the next forward gathers from the group."""
        self.secondary.clear()
        if self.fp8 is not None:
            self.fp8.stale()  # the step changed the shards: new amaxes at the next float8 gather
        for key in self.persistent:
            if self.full.pop(key, None) is not None:
                self._live_numel -= self.numel(key)
        self.gather(sorted(self.persistent))

    # -- hooks -------------------------------------------------------------------------------

    def _on_root_forward(self, module, args) -> None:
        self._cursor = 0
        if self.trace is None and not self._recording:
            self._recording = []

    def _on_root_done(self, module, args, output) -> None:
        if not torch.is_grad_enabled():
            self.release_all()

    def _pre_forward(self, module, args) -> None:
        self.fetch_module(module)

    def _post_forward(self, module, args, output):
        pos = self._cursor - 1 if self.trace is not None else None
        for key in self.keys_of[module]:
            if not self._reused_soon(key, pos):
                self._release(key)
        if torch.is_grad_enabled():
            return gather_in_backward(output, self, module)
        return output

    def fetch_module(self, module) -> None:
        keys = self.keys_of[module]
        pos = None
        if self.trace is None:
            self._recording.append(module)
        else:
            pos = self._advance(module)
        self.gather(keys)
        if pos is not None:
            self._prefetch(pos + 1)

    def _advance(self, module) -> int | None:
        for j in range(self._cursor, len(self.trace)):
            if self.trace[j] is module:
                self._cursor = j + 1
                return j
        return None

    def _prefetch(self, start: int) -> None:
        """Start gathering the units of the next modules in the recorded order, as one
        collective, within the prefetch budget and the live-parameter limit (and, with
        offload_param nvme, reading the shards of the ones after them)."""
        budget = self.cfg.stage3_prefetch_bucket_size
        if budget == 0:
            return
        self._launch(self._units_ahead(start, budget))
        self._read_ahead(start)

    def _units_ahead(self, start: int, budget: int) -> list[_Key]:
        live = self.live_numel()
        ahead: list[_Key] = []
        for m in self.trace[start:]:
            for key in self.keys_of[m]:
                if key in self.full or key in self.pending or key in ahead:
                    continue
                n = self.numel(key)
                if n > budget or live + n > self.cfg.stage3_max_live_parameters:
                    return ahead
                ahead.append(key)
                budget -= n
                live += n
        return ahead

    def _read_ahead(self, start: int) -> None:
        """offload_param nvme: start reading the shards of the units after the ones being
        gathered, in trace order, up to the store's `buffer_count`."""
        store = self.zero.param_store
        if store is None:
            return
        for m in self.trace[start:]:
            for key in self.keys_of[m]:
                if key in self.full or key in self.pending:
                    continue
                if not store.prefetch(key):
                    return

    def _reused_soon(self, key: _Key, pos: int | None) -> bool:
        if pos is None or pos >= len(self._next_use):
            return False
        nxt = self._next_use[pos].get(key)
        return nxt is not None and self._cum[nxt] - self._cum[pos + 1] <= self.cfg.stage3_max_reuse_distance

    def unit_ready(self, gi: int, u: int) -> None:
        """All gradients of a unit have arrived: backward is done with it."""
        self._release((gi, u))

    def end_backward(self) -> None:
        if self.trace is None and self._recording:
            self._set_trace(self._recording)
            self._recording = []
        self.release_all()
        self._cursor = 0

    def _set_trace(self, trace: list) -> None:
        self.trace = trace
        self._cum = [0]
        for m in trace:
            self._cum.append(self._cum[-1] + sum(self.numel(k) for k in self.keys_of[m]))
        self._next_use = [{} for _ in trace]
        later: dict[_Key, int] = {}
        for i in range(len(trace) - 1, -1, -1):
            self._next_use[i] = dict(later)
            for key in self.keys_of[trace[i]]:
                later[key] = i


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for d in reversed(shape):
        strides.append(step)
        step *= max(d, 1)
    return tuple(reversed(strides))


class _Gather:
    """All-gathers in flight: the units, the output buffer and the collective's handle."""

    __slots__ = ("keys", "out", "handle", "source", "mode", "quantizer", "dtype", "numel", "outs")

    def __init__(self, keys: list[_Key], out: torch.Tensor | None, handle, source, mode: str = PLAIN,
                 quantizer=None, dtype: torch.dtype | None = None, numel: int = 0,
                 outs: list[torch.Tensor] | None = None) -> None:
        self.keys, self.out, self.handle, self.source = keys, out, handle, source  # source: alive until done
        # qwZ: `out` holds each rank's int8 row of `numel` values, dequantized to `dtype` on arrival
        self.mode, self.quantizer, self.dtype, self.numel = mode, quantizer, dtype, numel
        self.outs = outs  # plain gathers: one whole buffer per unit
