"""DeepSpeedEngine's public attributes (`engine.monitor`, `engine.mpu`, `engine.client_optimizer`,
`engine.data_parallel_group`...) and its small helpers (`zero_grad`, `module_state_dict`,
`deepspeed_io`...), over what trident's Engine holds.

What `initialize` was given (`mpu`, a client optimizer or scheduler, `training_data`,
`collate_fn`) is set on the engine by `trident.engine.build`; the class defaults below are
DeepSpeed's values when they were not given, or for features trident does not have.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from trident.deepspeed.engine.surface import NotInTrident
from trident.moe.layer import MoE


class DeepSpeedAttributesAPI:
    """DeepSpeedEngine's attributes and helpers."""

    client_optimizer = None
    client_lr_scheduler = None
    mpu = None
    training_data = None
    collate_fn = None
    gradient_average = True
    enable_backward_allreduce = True
    scale_wrt_gas = True
    warn_unscaled_loss = True
    dont_change_device = False
    use_ds_comm = False
    mesh_device = None
    all_to_all_group = None
    progressive_layer_drop = None
    eigenvalue = None
    block_eigenvalue = None
    flops_profiler = None
    curriculum_scheduler_legacy = None
    random_ltd_scheduler = None
    torch_autocast_z0_gradscaler = None
    save_zero_checkpoint = True

    @property
    def monitor(self):
        """The monitors (DeepSpeed's MonitorMaster: TensorBoard, CSV, W&B, Comet, MLflow):
        `write_events([(name, value, step)])`."""
        return self.monitors

    @property
    def basic_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer

    @property
    def losses(self):
        """The loss summed over the accumulation window so far (DeepSpeed's `engine.losses`)."""
        return self._window_loss

    @property
    def tput_timer(self):
        return self.timers

    @property
    def data_parallel_group(self):
        return self.mesh.dp_group if self.mesh is not None else None

    @property
    def dist_backend(self) -> str | None:
        return dist.get_backend() if dist.is_initialized() else None

    @property
    def mp_world_size(self) -> int:
        """Model-parallel (tensor-parallel) ranks per replica, as DeepSpeed's mpu reports them."""
        return self.mesh.tp_size if self.mesh is not None else 1

    @property
    def pipeline_parallelism(self) -> bool:
        return self.mesh is not None and self.mesh.pp_size > 1

    @property
    def save_non_zero_checkpoint(self) -> bool:
        return self.dp_rank == 0

    @property
    def sparse_tensor_module_names(self) -> set:
        return set()  # sparse gradients are off

    @property
    def param_names(self) -> dict:
        return {p: n for n, p in self.module.named_parameters()}

    @property
    def moe_layers(self) -> list:
        return [m for m in self.module.modules() if isinstance(m, MoE)]

    @property
    def has_moe_layers(self) -> bool:
        return bool(self.moe_layers)

    @property
    def num_experts(self) -> list[int]:
        return [m.num_experts for m in self.moe_layers]

    @property
    def gate_modules(self) -> list:
        return [m.gate for m in self.moe_layers]

    @property
    def is_compiled(self) -> bool:
        return bool(getattr(self, "compile_report", None)) or getattr(self, "_compiled_by_call", False)

    def compile(self, backend: str = "inductor", compile_kwargs: dict | None = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """torch.compile the model inside the engine (DeepSpeed's `engine.compile()`); the config's
        `compile` section compiles block by block instead, and is what trident recommends."""
        if schedule is not None or compiled_autograd_enabled:
            raise NotInTrident("DeepSpeedEngine.compile(schedule= / compiled_autograd_enabled=) is DeepCompile's, "
                               "which trident does not implement; call engine.compile(backend=...) or set "
                               "compile.enabled in the config")
        self.module.compile(backend=backend, **(compile_kwargs or {}))
        self._compiled_by_call = True

    def zero_grad(self) -> None:
        """Drop the gradients the model holds (DeepSpeed's `engine.zero_grad()`)."""
        for p in self.module.parameters():
            p.grad = None

    def get_wall_clock_timers(self) -> dict[str, float]:
        """Seconds per phase since the last report (`wall_clock_breakdown: true` fills them)."""
        return dict(self.timers.totals)

    def empty_partition_cache(self) -> None:
        """Nothing to release: trident frees gathered ZeRO-3 parameters after each use."""

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin") -> bool:
        return self.save_16bit_model(save_dir, save_filename)

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            for name, p in self.module.named_parameters():
                if not p.requires_grad:
                    state.pop(prefix + name, None)
        return state

    def load_module_state_dict(self, checkpoint: dict, strict: bool = True, custom_load_fn=None,
                               fetch_z3_params: bool = False, z3_params_to_fetch=None, allowed_missing_keys=None):
        """Load `checkpoint["module"]` into the model (DeepSpeed's checkpoint dict)."""
        state = checkpoint["module"] if "module" in checkpoint else checkpoint
        if custom_load_fn is not None:
            return custom_load_fn(src=state, dst=self.module)
        return self.module.load_state_dict(state, strict=strict)

    @staticmethod
    def is_map_style_dataset(obj: Any) -> bool:
        return hasattr(obj, "__getitem__") and hasattr(obj, "__len__")

    @staticmethod
    def is_iterable_style_dataset(obj: Any) -> bool:
        return isinstance(obj, torch.utils.data.IterableDataset)

    def deepspeed_io(self, dataset, batch_size: int | None = None, route: str = "train", pin_memory: bool = True,
                     data_sampler=None, collate_fn=None, num_local_io_workers: int | None = None):
        """A loader of `dataset` as DeepSpeed builds it: this rank's share by torch's DistributedSampler
        (shuffled with seed 0 for training, in order for "eval" / "predict"), micro-batches of
        `batch_size` (default: train_micro_batch_size_per_gpu), `dataloader_drop_last` from the config."""
        from trident.deepspeed.engine.loader import deepspeed_loader

        if not (self.is_map_style_dataset(dataset) or self.is_iterable_style_dataset(dataset)):
            raise ValueError("engine.deepspeed_io(dataset): training data must be a torch Dataset")
        return deepspeed_loader(dataset, batch_size or self.train_micro_batch_size_per_gpu(),
                                self.data_parallel_size_for_data(), self.data_parallel_rank_for_data(),
                                shuffle=route == "train", drop_last=self.dataloader_drop_last(),
                                collate_fn=collate_fn or self.collate_fn, data_sampler=data_sampler,
                                num_workers=num_local_io_workers or 0, pin_memory=pin_memory)

    def data_parallel_size_for_data(self) -> int:
        """Ranks that read different samples (dp x ep)."""
        mesh = self.mesh
        return mesh.dp_size * mesh.ep_size if mesh is not None else self.dp_world_size

    def data_parallel_rank_for_data(self) -> int:
        mesh = self.mesh
        return mesh.dp_rank * mesh.ep_size + mesh.ep_rank if mesh is not None else self.dp_rank
