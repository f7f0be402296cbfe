"""DeepSpeed's config accessors on the engine (`engine.fp16_enabled()`, `engine.zero_optimization()`,
`engine.gradient_clipping()`...), with DeepSpeed's meanings and return types, read from the
parsed trident config (`self.config`) and the engine's parts.

Most of DeepSpeedEngine's accessors answer a question about a feature's settings. Where the
feature is one trident does not implement, the config that switches it on is refused at load,
so the answer is DeepSpeed's "off" value: `SWITCHED_OFF` lists those, as data. Accessors of the
settings of such a feature (pld_theta, eigenvalue_tol...) raise instead
(`trident.deepspeed.engine.surface.ENGINE_UNSUPPORTED`).
"""

from __future__ import annotations

from typing import Any

import torch

from trident.deepspeed.engine.surface import NotInTrident

SWITCHED_OFF: dict[str, Any] = {
    "checkpoint_serialization_enabled": True, "checkpoint_writer_enabled": False,
    "checkpoint_tag_validation_enabled": True, "checkpoint_tag_validation_fail": False,
    "elasticity_enabled": False, "is_elastic_model_parallel_supported": False, "pld_enabled": False,
    "eigenvalue_enabled": False, "data_efficiency_enabled": False,
    "data_sampling_enabled": False, "curriculum_learning_enabled": False, "random_ltd_enabled": False,
    "autotuning_enabled": False, "sparse_gradients_enabled": False,
    "optimizer_legacy_fusion": False, "zero_allow_untested_optimizer": True, "zero_force_ds_cpu_optimizer": False,
    "zero_partial_offload": 0.0, "super_offload": False, "compile_zero_optimization_stage": False,
    "compile_autosp": False, "compile_autotp": False, "uses_parallelization_pass_only": False,
    "mics_shard_size": -1, "zero_multi_rank_bucket_allreduce": False, "zero_load_from_fp32_weights": True,
    "zero_elastic_checkpoint": True, "zero_module_granularity_threshold": 0, "zero_model_persistence_threshold": 0,
    "zero_grad_hooks": True, "zero_legacy_stage1": False, "zero_ignore_unused_parameters": True,
    "zero_save_muon_momentum_buffer_in_memory": False, "graph_harvesting": False,
    "fp16_master_weights_and_gradients": False, "bf16_master_weights_and_gradients": False,
    "bf16_optimizer_states": False, "amp_enabled": False, "torch_autocast_enabled": False,
    "torch_autocast_dtype": None, "fp16_auto_cast": False, "managed_gradient_accumulation": False,
    "use_node_local_storage": False, "load_universal_checkpoint": False, "zero_allgather_partitions": True,
    "zeropp_loco_param": None, "zero_log_trace_cache_warnings": False, "zero_allgather_sequential": False,
    "is_sanity_checks_enabled": False, "dump_state": False, "zenflow_config": None,
    "is_deepcompile_enabled": False, "is_deepcompile_active": False,
}
"""Accessor -> its constant answer here (features trident lacks are off; what trident always does)."""

ZERO_SETTINGS: dict[str, str] = dict(line.split() for line in """
    zero_reduce_scatter reduce_scatter
    zero_overlap_comm overlap_comm
    zero_sub_group_size sub_group_size
    zero_reduce_bucket_size reduce_bucket_size
    zero_allgather_bucket_size allgather_bucket_size
    zero_contiguous_gradients contiguous_gradients
    zero_max_live_parameters stage3_max_live_parameters
    zero_max_reuse_distance stage3_max_reuse_distance
    zero_prefetch_bucket_size stage3_prefetch_bucket_size
    zero_param_persistence_threshold stage3_param_persistence_threshold
    zero_gather_16bit_weights_on_model_save stage3_gather_16bit_weights_on_model_save
    zero_round_robin_gradients round_robin_gradients
    zero_hpz_partition_size zero_hpz_partition_size
    zero_quantized_weights zero_quantized_weights
    zero_quantized_nontrainable_weights zero_quantized_nontrainable_weights
    zero_quantized_gradients zero_quantized_gradients
    zero_offload_optimizer offload_optimizer
    zero_offload_param offload_param
""".strip().splitlines())
"""Accessor -> the `zero_optimization` key it reads."""

FLOPS_PROFILER_SETTINGS: dict[str, str] = {f"flops_profiler_{key}": key for key in (
    "enabled", "recompute_fwd_factor", "profile_step", "module_depth", "top_modules", "detailed", "output_file")}
"""Accessor -> the `flops_profiler` key it reads."""


def _constant(name: str, value: Any):
    def accessor(self) -> Any:
        return value
    accessor.__name__ = name
    accessor.__doc__ = f"DeepSpeed's `{name}()`: always {value!r} in trident."
    return accessor


def _section_setting(name: str, section: str, key: str):
    def accessor(self) -> Any:
        return getattr(getattr(self.config, section), key)
    accessor.__name__ = name
    accessor.__doc__ = f"DeepSpeed's `{name}()`: {section}.{key}."
    return accessor


class LossScale(float):
    """The current loss scale (a float, trident's `engine.loss_scale`) that DeepSpeed scripts can
    call: `engine.loss_scale()` is DeepSpeed's, the configured `fp16.loss_scale` (0 = dynamic)."""

    def __new__(cls, current: float, configured: float = 0.0) -> LossScale:
        obj = super().__new__(cls, current)
        obj.configured = configured
        return obj

    def __reduce__(self):
        return LossScale, (float(self), self.configured)

    def __call__(self) -> float:
        return self.configured


class DeepSpeedSettingsAPI:
    """DeepSpeedEngine's config accessors, over `self.config` (a TridentConfig); the constant
    ones (`SWITCHED_OFF`) and the plain ZeRO settings (`ZERO_SETTINGS`) are added below, from data."""

    # -- precision ----------------------------------------------------------------------------

    def fp16_enabled(self) -> bool:
        return bool(self.config.fp16.enabled)

    def bfloat16_enabled(self) -> bool:
        return bool(self.config.bf16.enabled)

    def dynamic_loss_scale(self) -> bool:
        return self.config.fp16.loss_scale == 0

    def initial_dynamic_scale(self) -> float:
        return float(2 ** self.config.fp16.initial_scale_power)

    def dynamic_loss_scale_args(self) -> dict | None:
        """DeepSpeed's dynamic loss-scaler arguments under fp16 with a dynamic scale; else None."""
        fp16 = self.config.fp16
        if not (fp16.enabled and fp16.loss_scale == 0):
            return None
        return {"init_scale": 2 ** fp16.initial_scale_power, "scale_window": fp16.loss_scale_window,
                "delayed_shift": fp16.hysteresis, "consecutive_hysteresis": fp16.consecutive_hysteresis,
                "min_scale": fp16.min_loss_scale}

    def torch_autocast_lower_precision_safe_modules(self) -> list:
        return []

    def get_data_types(self) -> tuple[torch.dtype, torch.dtype]:
        """(the model's dtype, the dtype gradients accumulate in): trident accumulates in fp32."""
        return self.compute_dtype, torch.float32

    @property
    def communication_data_type(self) -> torch.dtype:
        """The dtype gradients are reduced in: the config's, else the 16-bit dtype of the run, else fp32."""
        named = self.config.communication_data_type
        if named is not None:
            return {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[named]
        return torch.float16 if self.fp16_enabled() else torch.bfloat16 if self.bfloat16_enabled() else torch.float32

    @communication_data_type.setter
    def communication_data_type(self, value: Any) -> None:
        raise NotInTrident("DeepSpeedEngine.communication_data_type cannot be changed after initialize in trident: "
                           "set communication_data_type in the config")

    # -- the loop -----------------------------------------------------------------------------

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    def steps_per_print(self) -> int | None:
        return self.config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return bool(self.config.wall_clock_breakdown)

    def curriculum_enabled_legacy(self) -> bool:
        return bool(self.config.curriculum_learning.enabled)

    def curriculum_params_legacy(self) -> dict | bool:
        """The `curriculum_learning` section without `enabled` (DeepSpeed's; False when the config has none)."""
        if "curriculum_learning" not in self.config.model_fields_set:
            return False
        return self.config.curriculum_learning.model_dump(exclude={"enabled"}, exclude_none=True)

    def postscale_gradients(self) -> bool:
        return not self.config.prescale_gradients

    def gradient_predivide_factor(self) -> float:
        return self.config.gradient_predivide_factor

    def dataloader_drop_last(self) -> bool:
        return bool(self.config.dataloader_drop_last)

    def get_batch_info(self) -> tuple[int, int, int]:
        """(train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps)."""
        return self.train_batch_size(), self.train_micro_batch_size_per_gpu(), self.gradient_accumulation_steps()

    # -- ZeRO ---------------------------------------------------------------------------------

    def zero_optimization(self) -> bool:
        return self.zero_optimization_stage() > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.zero_optimization_stage() >= 2

    def zero_optimization_partition_weights(self) -> bool:
        return self.zero_optimization_stage() >= 3

    def zero_use_cpu_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device in ("cpu", "nvme")

    def zero_cpu_offload(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "cpu"

    def zero_nvme_offload_optimizer(self) -> bool:
        return self.config.zero_optimization.offload_optimizer.device == "nvme"

    def aio_config(self) -> dict:
        return self.config.aio.model_dump()

    # -- optimizer and scheduler --------------------------------------------------------------

    def optimizer_name(self) -> str | None:
        """The client optimizer's class name, else the config's optimizer type."""
        if self.client_optimizer is not None:
            return type(self.client_optimizer).__name__
        return self.config.optimizer.type if self.config.optimizer is not None else None

    def optimizer_params(self) -> dict | None:
        return dict(self.config.optimizer.params) if self.config.optimizer is not None else None

    def scheduler_name(self) -> str | None:
        return self.config.scheduler.type if self.config.scheduler is not None else None

    def scheduler_params(self) -> dict | None:
        return dict(self.config.scheduler.params) if self.config.scheduler is not None else None

    def _optimizer_param(self, key: str) -> list:
        return [group[key] for group in self.optimizer.param_groups if key in group]

    def get_type(self) -> list:
        return self._optimizer_param("type")

    def get_mom(self) -> list:
        """Each param group's momentum (SGD, RMSprop) or betas (the others), as DeepSpeed returns it."""
        return self._optimizer_param("momentum" if self.optimizer_name() in ("SGD", "RMSprop") else "betas")

    def get_pld_theta(self) -> None:
        return None  # progressive layer drop is off

    # -- parallel layout ----------------------------------------------------------------------

    def tensor_parallel_config(self):
        return self.config.tensor_parallel

    def autotp_size(self) -> int:
        return self.config.tensor_parallel.size

    def get_data_parallel_rank(self) -> int:
        return self.dp_rank

    def get_tensor_parallel_rank(self) -> int:
        return self.mesh.tp_rank if self.mesh is not None else 0

    def get_model_parallel_rank(self) -> int:
        return self.get_tensor_parallel_rank()

    def get_sequence_parallel_group(self):
        """The context-parallel group (DeepSpeed-Ulysses' sequence group), or None without one."""
        return self.mesh.cp_group if self.mesh is not None and self.mesh.cp_size > 1 else None


for _name, _value in SWITCHED_OFF.items():
    setattr(DeepSpeedSettingsAPI, _name, _constant(_name, _value))
for _name, _key in ZERO_SETTINGS.items():
    setattr(DeepSpeedSettingsAPI, _name, _section_setting(_name, "zero_optimization", _key))
for _name, _key in FLOPS_PROFILER_SETTINGS.items():
    setattr(DeepSpeedSettingsAPI, _name, _section_setting(_name, "flops_profiler", _key))
