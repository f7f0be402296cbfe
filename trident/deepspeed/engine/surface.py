"""DeepSpeed 0.19's public surface, as data: every public name of `DeepSpeedEngine`,
`PipelineEngine` and the `deepspeed` package, and what trident does with each.

Built from DeepSpeed 0.19.6's source (`deepspeed/runtime/engine.py`, `runtime/pipe/engine.py`,
`deepspeed/__init__.py`: the public methods, properties and `self.x` attributes of the two
classes, and the package's public module-level names). Every name is either implemented, with
DeepSpeed's meaning and return type (the names in `ENGINE`, `PIPELINE_ENGINE` and `PACKAGE`
that are not in the `*_UNSUPPORTED` tables), or listed in an `*_UNSUPPORTED` table with what
to use instead: reading it raises `NotInTrident`, an `AttributeError` naming it (so `hasattr`
stays False). `tests/unit/test_deepspeed_surface.py` walks these lists.

Where trident keeps a meaning of its own under a DeepSpeed name, `DIFFERENT` says which and why.
"""

from __future__ import annotations


class NotInTrident(AttributeError):
    """A DeepSpeed name trident does not implement; the message says what to use instead."""


def _split(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ENGINE = _split("""
destroy get_batch_info set_train_batch_size set_train_micro_batch_size set_data_post_process_func
set_custom_curriculum_learning_schedule get_global_grad_norm checkpoint_serialization_enabled
checkpoint_writer_enabled checkpoint_tag_validation_enabled checkpoint_tag_validation_fail elasticity_enabled
is_elastic_model_parallel_supported pld_enabled pld_params pld_theta pld_gamma eigenvalue_enabled
eigenvalue_verbose eigenvalue_max_iter eigenvalue_tol eigenvalue_stability eigenvalue_gas_boundary_resolution
eigenvalue_layer_name eigenvalue_layer_num curriculum_enabled_legacy curriculum_params_legacy
data_efficiency_enabled data_efficiency_config data_sampling_enabled data_sampling_config
curriculum_learning_enabled curriculum_learning_config random_ltd_enabled random_ltd_config random_ltd_initialize
get_data_parallel_rank get_tensor_parallel_rank get_model_parallel_rank get_sequence_parallel_group
wall_clock_breakdown flops_profiler_enabled flops_profiler_recompute_fwd_factor flops_profiler_profile_step
flops_profiler_module_depth flops_profiler_top_modules flops_profiler_detailed flops_profiler_output_file
memory_breakdown autotuning_enabled autotuning_start_profile_step autotuning_end_profile_step
autotuning_metric_path autotuning_model_info_path autotuning_metric autotuning_profile_model_info
sparse_gradients_enabled train_batch_size train_micro_batch_size_per_gpu optimizer_name optimizer_params
optimizer_legacy_fusion scheduler_name scheduler_params quantize_training zero_optimization
zero_allow_untested_optimizer zero_force_ds_cpu_optimizer zero_reduce_scatter zero_overlap_comm
zero_offload_optimizer zero_offload_param zero_use_cpu_optimizer zero_cpu_offload zero_partial_offload
super_offload cpuadam_cores_perc zero_sub_group_size zero_optimization_stage compile_zero_optimization_stage
compile_autosp compile_autotp uses_parallelization_pass_only mics_shard_size zero_reduce_bucket_size
zero_multi_rank_bucket_allreduce zero_allgather_bucket_size zero_optimization_partition_gradients
zero_optimization_partition_weights is_first_weights_partition_group zero_contiguous_gradients
zero_load_from_fp32_weights zero_elastic_checkpoint zero_nvme_offload_optimizer zero_max_live_parameters
zero_max_reuse_distance zero_prefetch_bucket_size zero_module_granularity_threshold
zero_param_persistence_threshold zero_model_persistence_threshold zero_gather_16bit_weights_on_model_save
zero_grad_hooks zero_legacy_stage1 zero_ignore_unused_parameters zero_save_muon_momentum_buffer_in_memory
tensor_parallel_config autotp_size graph_harvesting fp16_enabled bfloat16_enabled
fp16_master_weights_and_gradients bf16_master_weights_and_gradients bf16_optimizer_states amp_enabled
amp_params torch_autocast_enabled torch_autocast_dtype torch_autocast_lower_precision_safe_modules
fp16_auto_cast loss_scale gradient_accumulation_steps managed_gradient_accumulation use_node_local_storage
load_universal_checkpoint log_level communication_data_type postscale_gradients gradient_predivide_factor
steps_per_print zero_allgather_partitions zero_round_robin_gradients zero_hpz_partition_size
zero_quantized_weights zero_quantized_nontrainable_weights zero_quantized_gradients zeropp_loco_param
zero_log_trace_cache_warnings zero_allgather_sequential is_sanity_checks_enabled dump_state gradient_clipping
dynamic_loss_scale initial_dynamic_scale dynamic_loss_scale_args swap_tensor_config aio_config zenflow_config
get_data_types is_map_style_dataset is_iterable_style_dataset dataloader_drop_last was_step_applied
deepspeed_io train eval forward print_forward_breakdown allreduce_gradients no_sync coalesce_grad_reduction
scale backward is_gradient_accumulation_boundary set_gradient_accumulation_boundary zero_grad
clip_fp32_gradients step get_wall_clock_timers get_lr get_type get_mom get_pld_theta allreduce_bucket
allreduce_and_copy allreduce_no_retain buffered_allreduce_fallback sparse_allreduce_no_retain
sparse_allreduce_bucket sparse_allreduce sparse_all_gather all_gather_scalar module_state_dict
load_moe_state_dict load_module_state_dict load_checkpoint save_checkpoint save_fp16_model save_16bit_model
empty_partition_cache get_autosp_backend get_autotp_backend get_deepcompile_backend
get_deepspeed_compile_backend compile get_compile_time register_compile_pass is_deepcompile_enabled
is_deepcompile_active is_compiled offload_states reload_states
all_to_all_group basic_optimizer block_eigenvalue checkpoint_engine client_lr_scheduler client_optimizer
collate_fn config curriculum_scheduler_legacy data_parallel_group dist_backend dont_change_device eigenvalue
enable_backward_allreduce engine_timers engine_timers_cache flatten flops_profiler gas_boundary_ctr
gate_modules global_samples global_steps gradient_average has_moe_layers inside_no_sync_ctxt
loaded_checkpoint_dp_world_size loaded_checkpoint_mp_world_size losses lr_scheduler mesh_device micro_steps
module_forward_post_hook module_forward_pre_hook moe_layers monitor mpu num_experts optimizer param_names
pipeline_parallelism progressive_layer_drop random_ltd_scheduler save_non_zero_checkpoint save_zero_checkpoint
scale_wrt_gas skipped_steps sparse_tensor_module_names timers torch_autocast_z0_gradscaler tput_timer
training_data training_dataloader unflatten use_ds_comm warn_unscaled_loss
module global_rank world_size dp_world_size mp_world_size local_rank device
""")
"""Every public name of DeepSpeedEngine: its methods and properties, then its `self.x`
attributes, then the coordinates its base sets (module, ranks, device)."""

_INTERNAL = "it is an internal step of DeepSpeed's engine; trident's engine.backward / engine.step do this work"
_FEATURE = "it belongs to DeepSpeed's {}, which trident does not implement (a config that switches it on is refused)"

ENGINE_UNSUPPORTED: dict[str, str] = {
    "set_train_batch_size": "set train_batch_size in the config; trident fixes the batch sizes at initialize",
    "set_train_micro_batch_size": "set train_micro_batch_size_per_gpu in the config",
    "set_data_post_process_func": _FEATURE.format("data efficiency pipeline"),
    "set_custom_curriculum_learning_schedule": _FEATURE.format("data-efficiency curriculum (data_efficiency.data_sampling)")
    + "; the legacy `curriculum_learning` section runs (engine.curriculum_scheduler_legacy)",
    **{n: _FEATURE.format("progressive layer drop") for n in ("pld_params", "pld_theta", "pld_gamma")},
    **{n: _FEATURE.format("eigenvalue computation") for n in (
        "eigenvalue_verbose", "eigenvalue_max_iter", "eigenvalue_tol", "eigenvalue_stability",
        "eigenvalue_gas_boundary_resolution", "eigenvalue_layer_name", "eigenvalue_layer_num")},
    "data_efficiency_config": _FEATURE.format("data efficiency"),
    "data_sampling_config": _FEATURE.format("data efficiency"),
    "curriculum_learning_config": _FEATURE.format("data-efficiency curriculum (data_efficiency.data_sampling)")
    + "; the legacy `curriculum_learning` section runs (engine.curriculum_scheduler_legacy)",
    "random_ltd_config": _FEATURE.format("random-LTD"),
    "random_ltd_initialize": _FEATURE.format("random-LTD"),
    **{n: _FEATURE.format("autotuner") + "; `trident plan` searches layouts instead"
       for n in ("autotuning_start_profile_step", "autotuning_end_profile_step", "autotuning_metric_path",
                 "autotuning_model_info_path", "autotuning_metric", "autotuning_profile_model_info")},
    "quantize_training": _FEATURE.format("mixture-of-quantization training"),
    "cpuadam_cores_perc": "a setting of DeepSpeed's compiled CPU Adam; trident's CPU Adam uses torch's threads",
    "is_first_weights_partition_group": _FEATURE.format("MiCS sharding"),
    "amp_params": _FEATURE.format("NVIDIA apex AMP") + "; use bf16 or fp16",
    "swap_tensor_config": ("DeepSpeed's swap settings; trident's NVMe offload reads the `aio` section "
                           "(engine.aio_config())"),
    "print_forward_breakdown": "set wall_clock_breakdown: true; the times are logged every steps_per_print steps",
    "allreduce_gradients": _INTERNAL + " (the all-reduce runs inside engine.backward on the boundary)",
    "coalesce_grad_reduction": _INTERNAL + " (gradients are bucketed and reduced on the boundary anyway)",
    "clip_fp32_gradients": _INTERNAL + " (engine.step clips to gradient_clipping)",
    **{n: _INTERNAL for n in ("allreduce_bucket", "allreduce_and_copy", "allreduce_no_retain",
                              "buffered_allreduce_fallback", "sparse_allreduce_no_retain", "sparse_allreduce_bucket",
                              "sparse_allreduce", "sparse_all_gather", "all_gather_scalar", "flatten", "unflatten",
                              "engine_timers", "engine_timers_cache", "gas_boundary_ctr", "module_forward_pre_hook",
                              "module_forward_post_hook", "inside_no_sync_ctxt")},
    "scale": "call engine.backward(loss) instead of engine.scale(loss).backward(): trident's gradient "
             "reduction and loss scaling run inside engine.backward",
    "load_moe_state_dict": ("it is a step of DeepSpeed's MoE checkpoint loading; engine.load_checkpoint loads "
                            "experts too"),
    **{n: _FEATURE.format("DeepCompile") + "; set compile.enabled in the config (torch.compile per block)"
       for n in ("get_autosp_backend", "get_autotp_backend", "get_deepcompile_backend", "get_deepspeed_compile_backend",
                 "get_compile_time", "register_compile_pass")},
    "offload_states": "DeepSpeed's manual offload of engine states; use zero_optimization.offload_optimizer / "
                      "offload_param in the config",
    "reload_states": "DeepSpeed's manual offload of engine states; use zero_optimization.offload_optimizer / "
                     "offload_param in the config",
    "checkpoint_engine": "DeepSpeed's pluggable checkpoint writers; engine.save_checkpoint writes trident's format",
    "loaded_checkpoint_dp_world_size": "trident checkpoints load under any layout; `trident checkpoint inspect` "
                                       "shows the layout a checkpoint was saved under",
    "loaded_checkpoint_mp_world_size": "trident checkpoints load under any layout; `trident checkpoint inspect` "
                                       "shows the layout a checkpoint was saved under",
    "log_level": "trident logs through Python's logging module (logger `trident`)",
}

PIPELINE_ENGINE = _split("""
set_has_attention_mask reset_activation_shape train_batch eval_batch set_train_batch_size is_first_stage
is_last_stage get_pipeline_parallel_rank set_dataloader set_dataiterator set_batch_fn
is_gradient_accumulation_boundary log_for_device tput_log forward backward step module_state_dict
load_module_state_dict get_additional_losses
agg_additional_losses agg_loss agg_train_loss batch_fn batch_timer data_iterator dp_group_loss dynamic_shape
enable_backward_allreduce eval_return_logits first_gradient_send first_output_send global_rank grad_layer
grad_partition_grad_layer_meta_cache grid has_attention_mask has_bool_tensors is_data_parallel
is_grad_partitioned is_model_parallel is_pipe_parallel is_pipe_partitioned log_batch_step_id loss loss_model
meta_buffer micro_batch_size micro_batches next_stage num_pipe_buffers num_stages outputs pipe_buffers
pipe_partition_grad_meta_cache pipe_partition_input_meta_cache pipe_partition_output_meta_cache pipe_recv_buf
pipeline_enable_backward_allreduce prev_stage stage_id total_additional_losses total_loss using_bf16_optimizer
""")
"""Every public name PipelineEngine adds to DeepSpeedEngine's."""

_PIPE_INTERNAL = "it is an internal buffer or cache of DeepSpeed's pipeline executor; trident's executor keeps its own"
PIPELINE_UNSUPPORTED: dict[str, str] = {
    **{n: _PIPE_INTERNAL for n in (
        "agg_additional_losses", "agg_loss", "agg_train_loss", "dp_group_loss", "first_gradient_send",
        "first_output_send", "grad_layer", "grad_partition_grad_layer_meta_cache", "meta_buffer", "num_pipe_buffers",
        "outputs", "pipe_buffers", "pipe_partition_grad_meta_cache", "pipe_partition_input_meta_cache",
        "pipe_partition_output_meta_cache", "pipe_recv_buf", "total_additional_losses", "total_loss",
        "batch_timer", "log_batch_step_id", "loss_model", "using_bf16_optimizer", "has_bool_tensors",
        "eval_return_logits")},
    "grid": "DeepSpeed's PipelineParallelGrid; engine.mesh (trident.ParallelMesh) holds the groups and ranks",
    "set_train_batch_size": "set train_batch_size in the config; trident fixes the batch sizes at initialize",
}

PACKAGE = _split("""
ops module_inject get_accelerator TORCH_DISTRIBUTED_DEFAULT_PORT DeepSpeedEngine DeepSpeedOptimizerCallable
DeepSpeedSchedulerCallable ADAM_OPTIMIZER LAMB_OPTIMIZER MUON_OPTIMIZER DeepSpeedOptimizer DeepSpeedDataLoader
DeepSpeedHybridEngine PipelineEngine InferenceEngine DeepSpeedInferenceConfig add_tuning_arguments
DeepSpeedConfig DeepSpeedConfigError checkpointing DeepSpeedTransformerLayer DeepSpeedTransformerConfig
replace_transformer_layer revert_transformer_layer set_autotp_mode log_dist OnDevice logger init_distributed
zero domino is_compile_supported PipelineModule version git_hash git_branch load_ds_config
merge_tp_model_init_into_config record_tp_model_init_args __version__ __version_major__ __version_minor__
__version_patch__ __git_hash__ __git_branch__ dist set_optimizer_flags initialize add_config_arguments
default_inference_config init_inference tp_model_init
comm pipe utils accelerator runtime
""")
"""Every public name of the `deepspeed` package (`deepspeed/__init__.py`), then the
submodules scripts reach through it (`deepspeed.comm.get_rank()`, `deepspeed.runtime...`)."""

_INFERENCE = ("DeepSpeed's inference engine (kernel injection, inference tensor parallelism), which trident does "
              "not implement; for generation use the model itself (engine.module, or trident.hf.from_pretrained) "
              "under torch.no_grad()")
PACKAGE_UNSUPPORTED: dict[str, str] = {
    "init_inference": _INFERENCE,
    "default_inference_config": _INFERENCE,
    "InferenceEngine": _INFERENCE,
    "DeepSpeedInferenceConfig": _INFERENCE,
    "module_inject": _INFERENCE,
    "replace_transformer_layer": _INFERENCE,
    "revert_transformer_layer": _INFERENCE,
    "set_autotp_mode": "DeepSpeed AutoTP's mode switch; set tensor_parallel.size (or autotp_size) in the config",
    "tp_model_init": "DeepSpeed AutoTP's model init; set tensor_parallel: {size: N, plan: \"auto\"} in the config",
    "merge_tp_model_init_into_config": "DeepSpeed AutoTP's model init; set tensor_parallel in the config",
    "record_tp_model_init_args": "DeepSpeed AutoTP's model init; set tensor_parallel in the config",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused CUDA transformer kernel; use the model's own layers "
                                 "(compile.enabled: true compiles each block)",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused CUDA transformer kernel; use the model's own layers",
    "DeepSpeedHybridEngine": "DeepSpeed's RLHF hybrid engine, which trident does not implement",
    "domino": "DeepSpeed's Domino tensor-parallel overlap, which trident does not implement",
}

DIFFERENT: dict[str, str] = {
    "memory_breakdown": "trident's engine.memory_breakdown() returns this rank's model-state bytes (a dict); "
                        "DeepSpeed's returns its `memory_breakdown` config flag",
    "config": "engine.config is the parsed trident config (TridentConfig); DeepSpeed keeps the dict it was given",
    "loss_scale": "engine.loss_scale is the current loss scale as a float (trident's meaning) that can also be "
                  "called: engine.loss_scale() is DeepSpeed's, the configured fp16.loss_scale (0 = dynamic)",
    "__version__": "trident's version; `deepspeed_version` names the DeepSpeed release whose API trident follows",
}


def unsupported(kind: str, name: str) -> NotInTrident | None:
    """The error for DeepSpeed name `name` of `kind` ("engine", "pipeline engine", "deepspeed")
    when trident does not implement it; None when it is not such a name."""
    table = {"engine": ENGINE_UNSUPPORTED, "pipeline engine": {**ENGINE_UNSUPPORTED, **PIPELINE_UNSUPPORTED},
             "deepspeed": PACKAGE_UNSUPPORTED}[kind]
    reason = table.get(name)
    if reason is None:
        return None
    owner = {"engine": "DeepSpeedEngine", "pipeline engine": "PipelineEngine", "deepspeed": "deepspeed"}[kind]
    return NotInTrident(f"{owner}.{name} is not available in trident: {reason}")
