"""Building a model already partitioned (`Init`) and gathering parameters on demand
(`GatheredParameters`).

`Init` is a context manager. Every `nn.Module` constructed inside it partitions its own
parameters as soon as its `__init__` has finished (the outermost `__init__` of that instance,
so a subclass's extra initialisation still sees whole tensors): each rank keeps its 1/N shard
and the parameter's data becomes an empty tensor. At most one module's own parameters are ever
whole at once, so a model several times larger than one rank's share can be built. All ranks
must build the model with the same random state: every rank generates the same full tensor and
keeps its slice, so the result equals the unpartitioned model built from that seed.

`GatheredParameters(params, modifier_rank=None)` makes partitioned parameters whole for the
duration of a `with` block, on every rank. With `modifier_rank=r`, rank r's values at the end of
the block are broadcast to the others and partitioned back (master weights included), so an
in-place change made on one rank is seen everywhere. Parameters that are not partitioned pass
through (with `modifier_rank`, they are still broadcast over the engine's data-parallel group).
"""

from __future__ import annotations

import functools
import os
from typing import Callable, Iterable

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.zero.partition import padded_size

INIT_HOOKS: list[Callable[[], Callable[[], None] | None]] = []
"""Run when an `Init` context is entered, each returning an undo function (run on exit) or None.
Libraries whose models initialise their weights after `__init__` register here from above (e.g.
`trident.hf.zero_init` makes transformers' `_init_weights` run on whole tensors)."""


def register_init_hook(hook: Callable[[], Callable[[], None] | None]) -> None:
    """Run `hook` whenever an `Init` context is entered (once per hook)."""
    if hook not in INIT_HOOKS:
        INIT_HOOKS.append(hook)


def full_data(p: torch.nn.Parameter) -> torch.Tensor:
    """The whole value of a parameter: its data, or its `Init` shards gathered."""
    shard = getattr(p, "_trident_shard", None)
    if shard is None:
        return p.data
    group = p._trident_group
    world = dist.get_world_size(group)
    full = torch.empty(shard.numel() * world, dtype=shard.dtype, device=shard.device)
    collectives.all_gather(full, shard, group=group)
    n = 1
    for d in p._trident_shape:
        n *= d
    return full[:n].view(p._trident_shape)


class Init:
    """Context in which modules are built with their parameters partitioned over `group`.

    DeepSpeed's `zero.Init` shape: `Init(data_parallel_group=None, mesh=None, enabled=True,
    dtype=None, config_dict_or_path=None, remote_device=None, pin_memory=False, mpu=None)`. The
    group is `data_parallel_group`, else the mpu's data-parallel group, else the mesh's dp group,
    else the whole world. `remote_device` "cpu" (or None / "none") keeps the partitions where
    the parameters are built; "nvme" is refused (give `zero_optimization.offload_param` in the
    engine's config instead). `pin_memory` has no effect on CPU. Use ZeRO stage 3 for the
    engine of a model built this way.
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group=None, mesh=None,
                 enabled: bool = True, dtype: torch.dtype | None = None, config_dict_or_path=None,
                 remote_device: str | None = None, pin_memory: bool = False, mpu=None, config=None,
                 **unused_deepspeed_args) -> None:
        if module is not None:
            raise ValueError("zero.Init(module=...) partitions modules as they are built; wrap the model's "
                             "construction in `with trident.zero.Init(): model = MyModel()` instead")
        if str(remote_device).lower() not in ("none", "cpu"):
            raise ValueError(f"zero.Init(remote_device={remote_device!r}) is not supported: trident keeps the "
                             "partitions where the model is built; for NVMe give zero_optimization.offload_param "
                             "in the engine's config")
        if data_parallel_group is None and mpu is not None:
            data_parallel_group = mpu.get_data_parallel_group()
        config_dict_or_path = config_dict_or_path if config_dict_or_path is not None else config
        if config_dict_or_path is not None and enabled:  # disabled, DeepSpeed builds the model as is
            from trident.config.loader import read_json
            data = config_dict_or_path if isinstance(config_dict_or_path, dict) else read_json(config_dict_or_path)
            zero = data.get("zero_optimization", {})
            stage = zero.get("stage", 0) if isinstance(zero, dict) else int(bool(zero))
            if stage != 3:
                raise ValueError(f"zero.Init builds a partitioned model, which only ZeRO stage 3 can train; "
                                 f"the config has zero_optimization.stage {stage}")
        self.enabled = enabled
        self.dtype = dtype
        self.mesh = mesh
        self.group = data_parallel_group
        self._patched: list[tuple[type, object]] = []

    def __enter__(self) -> "Init":
        if not self.enabled:
            return self
        if not dist.is_initialized() and "RANK" in os.environ and "MASTER_ADDR" in os.environ:
            from trident.comm import init_distributed  # DeepSpeed starts the group from the environment
            init_distributed()
        if not dist.is_initialized():
            raise RuntimeError("zero.Init needs torch.distributed initialised (trident.comm.init_distributed())")
        if self.group is None:
            self.group = self.mesh.dp_group if self.mesh is not None else dist.group.WORLD
        self.world, self.rank = dist.get_world_size(self.group), dist.get_rank(self.group)
        for cls in _subclasses(torch.nn.Module):
            self._patch(cls)
        self._old_init_subclass = torch.nn.Module.__dict__.get("__init_subclass__")
        ctx = self

        def init_subclass(cls, **kwargs):
            super(torch.nn.Module, cls).__init_subclass__(**kwargs)
            ctx._patch(cls)
        torch.nn.Module.__init_subclass__ = classmethod(init_subclass)
        self._undo_hooks = [undo for undo in (hook() for hook in INIT_HOOKS) if undo is not None]
        return self

    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for cls, original in reversed(self._patched):
            cls.__init__ = original
        self._patched = []
        if self._old_init_subclass is None:
            del torch.nn.Module.__init_subclass__
        else:
            torch.nn.Module.__init_subclass__ = self._old_init_subclass
        for undo in reversed(getattr(self, "_undo_hooks", [])):
            undo()
        self._undo_hooks = []

    def _patch(self, cls: type) -> None:
        original = cls.__dict__.get("__init__")
        if original is None or getattr(original, "_trident_wrapped", False):
            return
        ctx = self

        @functools.wraps(original)
        def wrapped(module, *args, **kwargs):
            depth = module.__dict__.get("_trident_init_depth", 0)
            object.__setattr__(module, "_trident_init_depth", depth + 1)
            try:
                original(module, *args, **kwargs)
            finally:
                object.__setattr__(module, "_trident_init_depth", depth)
            if depth == 0:
                ctx._partition(module)
        wrapped._trident_wrapped = True
        cls.__init__ = wrapped
        self._patched.append((cls, original))

    @torch.no_grad()
    def _partition(self, module: torch.nn.Module) -> None:
        for p in module.parameters(recurse=False):
            if hasattr(p, "_trident_shard"):
                continue
            data = p.data if self.dtype is None else p.data.to(self.dtype)
            n = data.numel()
            shard_size = padded_size(max(n, 1), self.world) // self.world
            flat = torch.zeros(shard_size * self.world, dtype=data.dtype, device=data.device)
            flat[:n].copy_(data.reshape(-1))
            p._trident_shard = flat[self.rank * shard_size:(self.rank + 1) * shard_size].clone()
            p._trident_shape = tuple(data.shape)
            p._trident_group = self.group
            p.data = torch.empty(0, dtype=data.dtype, device=data.device)


def _subclasses(cls: type) -> Iterable[type]:
    seen, stack = set(), list(cls.__subclasses__())
    while stack:
        c = stack.pop()
        if c not in seen:
            seen.add(c)
            yield c
            stack.extend(c.__subclasses__())


class GatheredParameters:
    """Make partitioned parameters whole inside a `with` block (see the module docstring)."""

    def __init__(self, params, modifier_rank: int | None = None, fwd_module=None, enabled: bool = True) -> None:
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in params if p is not None]
        self.modifier_rank = modifier_rank
        self.enabled = enabled

    def __enter__(self) -> "GatheredParameters":
        if not self.enabled:
            return self
        self._engine_keys: dict = {}
        for p in self.params:
            owner = getattr(p, "_trident_zero", None)
            if owner is not None and owner.coordinator is not None:
                self._engine_keys.setdefault(owner, set()).add(owner.key_of(p))
            elif hasattr(p, "_trident_shard"):
                p.data = full_data(p).clone()
        for owner, keys in self._engine_keys.items():
            owner.coordinator.hold(keys)
        return self

    @torch.no_grad()
    def __exit__(self, *exc) -> None:
        if not self.enabled:
            return
        for p in self.params:
            owner = getattr(p, "_trident_zero", None)
            if self.modifier_rank is not None:
                group = p._trident_group if hasattr(p, "_trident_shard") else (
                    owner.group if owner is not None else None)
                if group is not None and dist.get_world_size(group) > 1:
                    collectives.broadcast(p.data, src=self.modifier_rank, group=group)
            if owner is None and hasattr(p, "_trident_shard"):
                if self.modifier_rank is not None:
                    world, rank = dist.get_world_size(p._trident_group), dist.get_rank(p._trident_group)
                    n = p.data.numel()
                    flat = torch.zeros_like(p._trident_shard).repeat(world)
                    flat[:n].copy_(p.data.reshape(-1))
                    p._trident_shard.copy_(flat[rank * p._trident_shard.numel():(rank + 1) * p._trident_shard.numel()])
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        for owner, keys in self._engine_keys.items():
            owner.coordinator.unhold(keys, write_back=self.modifier_rank is not None)
        if self.modifier_rank is not None:
            for owner in {getattr(p, "_trident_zero", None) for p in self.params} - {None}:
                if owner.coordinator is None:
                    owner.reload_masters()
