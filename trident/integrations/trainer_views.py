"""What the Trainer sees of trident's engine: its optimizer and schedule (which the engine steps),
and an accelerator that shards data and gathers metrics over trident's data-parallel ranks."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.data_loader import prepare_data_loader

from trident.engine.build import data_parallel_rank, data_parallel_size
from trident.engine.engine import Engine
from trident.parallel.mesh import ParallelMesh

class EngineOptimizer:
    """The Trainer's view of the engine's optimizer: the engine steps and zeroes it (inside
    `engine.step()`), so `step` / `zero_grad` here do nothing; the rest is the real one's."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.optimizer = engine.optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    def step(self, closure=None) -> None:
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        return None

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class EngineScheduler:
    """The Trainer's view of the engine's LR schedule: the engine steps it; `get_last_lr` is the
    rate the last optimizer step used (what the Trainer logs as `learning_rate`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.scheduler = engine.lr_scheduler
        self.step_lr: list[float] | None = None

    def step(self, *args: Any, **kwargs: Any) -> None:
        return None

    def get_last_lr(self) -> list[float]:
        return list(self.step_lr) if self.step_lr is not None else self.engine.get_lr()

    def state_dict(self) -> dict:
        return self.scheduler.state_dict() if self.scheduler is not None else {}

    def load_state_dict(self, state: dict) -> None:
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state)


class TridentAccelerator(Accelerator):
    """The Trainer's accelerator with data sharded over trident's data-parallel ranks (not the
    whole world: tp / cp ranks of a replica read the same samples), metrics gathered over them,
    and no gradient-sync context of its own (the engine knows its accumulation boundaries).
    Becomes the class of the accelerator the Trainer built (`__class__` swap): everything else
    is accelerate's."""

    _trident_trainer: "TridentTrainer"
    _trident_metrics = False

    def _trident_shard(self) -> tuple[int, int]:
        mesh = self._trident_trainer._trident_mesh()
        return (data_parallel_size(mesh), data_parallel_rank(mesh)) if mesh is not None else (1, 0)

    def prepare_data_loader(self, data_loader, device_placement=None, slice_fn_for_dispatch=None):
        if getattr(data_loader, "_is_accelerate_prepared", False):
            return data_loader
        if device_placement is None:
            device_placement = self.device_placement
        num_processes, process_index = self._trident_shard()
        prepared = prepare_data_loader(
            data_loader, self.device, num_processes=num_processes, process_index=process_index,
            split_batches=self.split_batches, put_on_device=device_placement, rng_types=self.rng_types.copy(),
            dispatch_batches=self.dispatch_batches, even_batches=self.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch, use_seedable_sampler=self.use_seedable_sampler,
            data_seed=self.dataloader_config.data_seed, non_blocking=self.non_blocking,
            use_stateful_dataloader=self.use_stateful_dataloader)
        self._dataloaders.append(prepared)
        return prepared

    def gather_for_metrics(self, input_data, use_gather_object=False):
        self._trident_metrics = True  # one copy of each sample: gather over the data-parallel ranks only
        try:
            return super().gather_for_metrics(input_data, use_gather_object=use_gather_object)
        finally:
            self._trident_metrics = False

    def gather(self, tensor):
        mesh = self._trident_trainer._trident_mesh()
        if not self._trident_metrics or mesh is None or mesh.world_size == data_parallel_size(mesh):
            return super().gather(tensor)
        from accelerate.utils import recursively_apply
        group = data_group(mesh)
        return recursively_apply(functools.partial(all_gather_cat, group=group), tensor, error_on_other_type=True)

    def no_sync(self, model):
        return contextlib.nullcontext()

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, Engine):
            return model.module
        return super().unwrap_model(model, keep_fp32_wrapper=keep_fp32_wrapper, keep_torch_compile=keep_torch_compile)


def data_group(mesh: ParallelMesh):
    return mesh.group("dp", "ep")


def all_gather_cat(tensor: torch.Tensor, group) -> torch.Tensor:
    tensor = tensor.contiguous() if tensor.ndim else tensor.reshape(1)
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor, group=group)
    return torch.cat(parts, dim=0)
