"""DeepSpeed's key names that trident's schema walk knows about: aliases and unimplemented keys.

The loader walks a config against trident's schema; where a key is not a field it consults
these tables through the registered dialect (`trident.config.dialect`): an alias is renamed to
today's key (warned once when deprecated), and a real DeepSpeed key trident lacks gets a
specific message instead of "unknown key". Most such keys are dropped or refused earlier, by
`rules.RULES`; these are what reaches the schema.
"""

from __future__ import annotations

DEPRECATED_ALIASES: dict[str, str] = {
    # DeepSpeed still reads its old name of the bf16 section (BFLOAT16_OLD in its constants).
    "bfloat16": "bf16",
    # DeepSpeed accepts these names of stage 3 settings (its pydantic aliases).
    "zero_optimization.prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "zero_optimization.max_live_parameters": "stage3_max_live_parameters",
    "zero_optimization.max_reuse_distance": "stage3_max_reuse_distance",
    "zero_optimization.param_persistence_threshold": "stage3_param_persistence_threshold",
    "zero_optimization.gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "zero_optimization.stage3_gather_fp16_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
}
"""Other JSON path -> current key name in the same section. The loader renames; it warns once
for the deprecated ones (those not in `SYNONYMS`)."""

SYNONYMS = frozenset(path for path in DEPRECATED_ALIASES
                     if path.startswith("zero_optimization.") and "fp16" not in path)
"""Aliases that are current DeepSpeed spellings, not deprecated ones: renamed without a warning."""

ZERO_UNIMPLEMENTED_KEYS = frozenset({
    "use_multi_rank_bucket_allreduce", "allgather_partitions",
    "load_from_fp32_weights", "elastic_checkpoint", "zenflow",
    "cpu_offload", "cpu_offload_param", "cpu_offload_use_pin_memory",
    "model_persistence_threshold", "stage3_model_persistence_threshold",
    "module_granularity_threshold",
    "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "ignore_unused_parameters", "legacy_stage1",
    "zeropp_loco_param", "mics_shard_size", "mics_hierarchical_params_gather", "memory_efficient_linear",
    "pipeline_loading_checkpoint", "override_module_apply", "log_trace_cache_warnings",
    "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module",
})

DEEPSPEED_ONLY_TOP_LEVEL = frozenset({
    "amp", "autotuning",
    "compression_training", "data_efficiency", "data_types",
    "disable_allgather", "dump_state", "eigenvalue", "elasticity",
    "gradient_allreduce_op", "graph_harvesting", "hybrid_engine", "log_level", "managed_gradient_accumulation",
    "memory_breakdown", "nebula", "progressive_layer_drop", "sparse_attention",
    "sparse_gradients", "timers", "torch_autocast", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
})

DEEPSPEED_SETTING = "`{path}` is a DeepSpeed setting that this version of trident does not implement; remove it"

UNIMPLEMENTED_KEYS: dict[str, tuple[frozenset[str], str]] = {
    "checkpoint": (frozenset({"tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
                              "writer"}), DEEPSPEED_SETTING),
    "zero_optimization": (ZERO_UNIMPLEMENTED_KEYS, "`{path}` is a ZeRO setting that this version of "
                                                   "trident does not implement; remove it"),
    "": (DEEPSPEED_ONLY_TOP_LEVEL, DEEPSPEED_SETTING),
    "fp16": (frozenset({"auto_cast", "fp16_master_weights_and_grads"}), DEEPSPEED_SETTING),
    "bf16": (frozenset({"immediate_grad_update", "check_overflow", "bf16_master_weights_and_grads",
                        "bf16_optimizer_states"}), DEEPSPEED_SETTING),
}
"""Section path -> (real DeepSpeed keys trident lacks, message). These get a specific error
instead of "unknown key", so a DeepSpeed user learns the key is real but not supported here."""
