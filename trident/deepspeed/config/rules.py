"""DeepSpeed's config dialect, read the way DeepSpeed 0.19 reads it (`trident.config` knows only
trident's own sections; this runs first, through the dialect `trident.deepspeed.config` registers).

A DeepSpeed config copied from a public repository carries keys trident has no use for. This
module sorts every such key, before the schema sees the config, into one of three kinds:

  renamed   a legacy DeepSpeed name of a setting trident has (`cpu_offload` -> offload_optimizer)
  ignored   a key DeepSpeed knows that changes nothing here, or a value that asks for what
            trident does anyway, or the section of a feature trident lacks whose `enabled` is
            false: dropped, and listed once in one start-up line with the reason
  refused   a value that asks for a feature trident lacks: a `ConfigIssue` naming the feature

The tables below are data: one line per DeepSpeed key, with the values that are harmless
(`OFF`) and the reason. Unknown keys with no close match are the loader's business (it knows
the schema); `strict` turns those warnings into errors there.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from trident.config.errors import ConfigIssue, join_path
from trident.config.loader import warn_deprecated
from trident.config.notes import Note, unknown_line

ANY = object()
"""Every value of the key is harmless."""


@dataclass(frozen=True)
class Rule:
    """`harmless(value)` -> dropped with `reason`; otherwise refused as `feature`, or, with no
    feature, left for the schema (a key trident shares with DeepSpeed, such as pipeline.stages)."""

    harmless: Callable[[Any], bool]
    reason: str
    feature: str = ""


def _values(*ok: Any) -> Callable[[Any], bool]:
    # JSON's true is not 1 here: compare booleans only with booleans.
    return lambda v: any(v == o and isinstance(v, bool) == isinstance(o, bool) for o in ok)


def _always(_: Any) -> bool:
    return True


def _at_most_one(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and v <= 1)


def _off_section(v: Any) -> bool:
    """A feature section is off when its `enabled` is false (or absent, DeepSpeed's default),
    and no nested sub-feature is switched on."""
    if v is None or v is False or v == {}:
        return True
    if not isinstance(v, dict):
        return False
    if v.get("enabled", False) not in (False, None):
        return False
    return all(_off_section(sub) for sub in v.values() if isinstance(sub, dict))


PERF = "a DeepSpeed performance setting; trident's results do not depend on it"

# Keys by JSON path; a section path with a Rule covers the whole section.
RULES: dict[str, Rule] = {
    # -- top level ---------------------------------------------------------------------------
    "zero_allow_untested_optimizer": Rule(_always, "trident's ZeRO runs any torch.optim optimizer"),
    "zero_force_ds_cpu_optimizer": Rule(_always, "trident picks its CPU Adam for offload by itself"),
    "memory_breakdown": Rule(_always, "trident logs model-state bytes per rank at start-up anyway"),
    "dump_state": Rule(_always, "a debug print of DeepSpeed's own state"),
    "disable_allgather": Rule(_always, "a DeepSpeed debug switch"),
    "log_level": Rule(_always, "trident logs through Python's logging module"),
    "timers": Rule(_always, "DeepSpeed's throughput timers; trident's are `wall_clock_breakdown`"),
    "disable_python_gc": Rule(_always, PERF),
    # DeepSpeed builds its monitor settings from the top-level tensorboard / csv_monitor / wandb / comet
    # sections; a `monitor_config` section in the file (LLaMA-Factory's configs have one) is never read
    "monitor_config": Rule(_always, "not a key DeepSpeed reads: its monitors are the top-level tensorboard, "
                                    "csv_monitor, wandb and comet sections"),
    "graph_harvesting": Rule(_values(False), "off", "CUDA graph harvesting"),
    "sparse_gradients": Rule(_values(False), "off", "sparse embedding gradients"),
    "seq_parallel_communication_data_type": Rule(_always, "DeepSpeed-Ulysses is not used"),
    "gradient_allreduce_op": Rule(_values("mean", None), "trident averages gradients", "summed gradients"),
    "data_types": Rule(lambda v: isinstance(v, dict) and v.get("grad_accum_dtype") in (None, "fp32", "float32")
                       and set(v) <= {"grad_accum_dtype"}, "gradients accumulate in fp32",
                       "gradient accumulation in another dtype (data_types)"),
    "use_data_before_expert_parallelism": Rule(_values(False), "off", "DeepSpeed's MoE data ordering"),
    "managed_gradient_accumulation": Rule(_values(False, None), "off", "managed gradient accumulation"),
    "sequence_parallel_size": Rule(_at_most_one, "1 = no sequence parallelism",
                                   "DeepSpeed-Ulysses sequence parallelism (use context_parallel.size)"),
    "amp": Rule(_off_section, "NVIDIA apex AMP is off", "NVIDIA apex AMP (use fp16 or bf16)"),
    # `flops_profiler` is a trident section (trident.config.run_sections.FlopsProfilerConfig)
    "autotuning": Rule(_off_section, "off", "DeepSpeed's autotuner (see `trident plan`)"),
    "nebula": Rule(_off_section, "off", "Nebula checkpointing"),
    "elasticity": Rule(_off_section, "off", "DeepSpeed elasticity (trident uses torchrun's elastic agent)"),
    "eigenvalue": Rule(_off_section, "off", "eigenvalue computation"),
    "progressive_layer_drop": Rule(_off_section, "off", "progressive layer dropping"),
    "data_efficiency": Rule(_off_section, "off", "data efficiency (curriculum, random-LTD)"),
    "hybrid_engine": Rule(_off_section, "off", "the hybrid (RLHF) engine"),
    # no `enabled` switch: DeepSpeed reads a non-empty block (a `mode`, block sizes) as sparse attention asked for
    "sparse_attention": Rule(lambda v: v in (None, False, {}), "empty", "sparse attention"),
    "compression_training": Rule(_off_section, "every technique is off", "compression training"),
    "quantize_training": Rule(_off_section, "off", "mixture-of-quantization training"),
    "weight_quantization": Rule(_off_section, "off", "weight quantization"),
    "torch_autocast": Rule(_off_section, "off", "torch.autocast mixed precision (use bf16 or fp16)"),
    # `compile`: enabled/backend/mode/fullgraph/... are trident's (schema); DeepCompile's keys are here
    "compile.deepcompile": Rule(_values(False), "off", "DeepCompile (DeepSpeed's compiler passes for ZeRO; "
                                "trident compiles each block with torch.compile instead: set compile.enabled)"),
    **{f"compile.{k}": Rule(_always, "a DeepCompile setting; DeepCompile is not used") for k in (
        "autoep_non_moe", "free_activation", "free_activation_threshold", "offload_activation",
        "offload_activation_pin_memory", "offload_opt_states", "double_buffer", "symmetric_memory", "debug_log",
        "offload_parameters", "sync_before_reduce", "sync_after_reduce", "sync_before_allgather",
        "sync_after_allgather", "keep_int_input_tensors", "keep_all_input_tensors", "passes", "dump_graphs")},
    # -- precision ---------------------------------------------------------------------------
    "fp16.auto_cast": Rule(_always, "trident casts floating-point inputs to the compute dtype anyway"),
    "fp16.fp16_master_weights_and_grads": Rule(_values(False), "fp32 master weights",
                                               "fp16 master weights and gradients"),
    **{f"bf16.{k}": Rule(_always, "bf16 needs no loss scaling")
       for k in ("loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
                 "consecutive_hysteresis", "min_loss_scale", "auto_cast")},
    "bf16.immediate_grad_update": Rule(_always, "an ordering choice of DeepSpeed's bf16 optimizer; same result"),
    "bf16.check_grad_overflow": Rule(_always, "trident checks gradients as `numerics.on_nonfinite` says"),
    "bf16.check_overflow": Rule(_always, "trident checks gradients as `numerics.on_nonfinite` says"),
    "bf16.bf16_master_weights_and_grads": Rule(_values(False), "fp32 master weights",
                                               "bf16 master weights and gradients"),
    "bf16.bf16_optimizer_states": Rule(_values(False), "fp32 optimizer states", "bf16 optimizer states"),
    # -- ZeRO ----------------------------------------------------------------------------------
    "zero_optimization.allgather_partitions": Rule(
        _always, "trident always all-gathers updated partitions; false (broadcasts) gives the same result"),
    "zero_optimization.elastic_checkpoint": Rule(_always, "trident checkpoints load under any layout"),
    "zero_optimization.load_from_fp32_weights": Rule(_always, "trident restores the fp32 masters it saved"),
    "zero_optimization.ignore_unused_parameters": Rule(
        _always, "trident's ZeRO does not need every parameter to receive a gradient"),
    "zero_optimization.legacy_stage1": Rule(_values(False), "off", "DeepSpeed's legacy stage 1"),
    **{f"zero_optimization.{k}": Rule(_always, PERF) for k in (
        "use_multi_rank_bucket_allreduce", "memory_efficient_linear", "model_persistence_threshold",
        "stage3_model_persistence_threshold", "module_granularity_threshold", "stage3_module_granularity_threshold",
        "use_all_reduce_for_fetch_params", "stage3_use_all_reduce_for_fetch_params", "allgather_sequential",
        "stage3_allgather_sequential", "log_trace_cache_warnings", "enable_sanity_checks", "override_module_apply",
        "pipeline_loading_checkpoint", "save_muon_momentum_buffer_in_memory")},
    "zero_optimization.zeropp_loco_param": Rule(_values(None), "off", "ZeRO++ LoCo error feedback"),
    "zero_optimization.mics_shard_size": Rule(lambda v: isinstance(v, int) and v <= 0, "off", "MiCS sharding"),
    "zero_optimization.mics_hierarchical_params_gather": Rule(_values(False), "off", "MiCS hierarchical gather"),
    "zero_optimization.zenflow": Rule(_values(None), "off", "ZenFlow"),
    "zero_optimization.leaf_module": Rule(lambda v: not v, "none given", "ZeRO-3 leaf modules"),
    "zero_optimization.offload_optimizer.super_offload": Rule(_values(False), "off", "SuperOffload"),
    # -- checkpoint ----------------------------------------------------------------------------
    "checkpoint.tag_validation": Rule(_always, "trident checks every rank's tag through its manifest"),
    "checkpoint.load_universal": Rule(_always, "every trident checkpoint loads under any layout"),
    "checkpoint.use_node_local_storage": Rule(_values(False), "off", "node-local checkpoint storage"),
    "checkpoint.parallel_write": Rule(lambda v: not (isinstance(v, dict) and v.get("pipeline_stage")), "off",
                                      "parallel checkpoint writing per pipeline stage"),
    "checkpoint.writer": Rule(_values(None), "default writer", "DeepSpeed's checkpoint writers"),
    # -- DeepSpeed's `pipeline` section (PipelineModule takes these as arguments) ----------------
    "pipeline.stages": Rule(_values("auto"), "the PipelineModule's num_stages decides"),
    "pipeline.partition": Rule(_always, "PipelineModule(partition_method=...) decides the partition"),
    "pipeline.seed_layers": Rule(_values(False), "off", "per-layer seeding of pipeline layers"),
    "pipeline.activation_checkpoint_interval": Rule(
        _always, "pass PipelineModule(activation_checkpoint_interval=...) instead"),
    "pipeline.pipe_partitioned": Rule(_always, "activations cross stages whole; same result"),
    "pipeline.grad_partitioned": Rule(_always, "gradients cross stages whole; same result"),
    "pipeline.use_reentrant": Rule(_always, "trident's recompute does not use reentrant autograd"),
    # -- DeepSpeed's AutoTP section -------------------------------------------------------------
    # (`tensor_parallel.autotp_size` is read as tensor_parallel.size with plan "auto": `spellings`)
    "tensor_parallel.tp_overlap_comm": Rule(_always, PERF),
    "tensor_parallel.partition_config": Rule(lambda v: not v, "none given", "AutoTP partition configs"),
}


def top_level_keys() -> frozenset[str]:
    """The top-level keys these rules handle (what `spellings` must not call unknown)."""
    return frozenset(path for path in RULES if "." not in path) | {"bfloat16"}


def translate(data: dict) -> tuple[dict, list[Note], list[ConfigIssue]]:
    """Rename DeepSpeed's legacy names, drop what changes nothing here, refuse what asks for a
    feature trident lacks. Returns (the config trident's schema reads, notes, issues)."""
    notes: list[Note] = []
    issues: list[ConfigIssue] = []
    data = _legacy_names(dict(data))
    _apply_rules(data, "", notes, issues)
    return data, notes, issues


def _apply_rules(section: dict, path: str, notes: list[Note], issues: list[ConfigIssue]) -> None:
    for key in list(section):
        full = join_path(path, str(key))
        value = section[key]
        rule = RULES.get(full)
        if rule is not None and (rule.feature or rule.harmless(value)):
            del section[key]
            if rule.harmless(value):
                notes.append(Note(full, "ignored", rule.reason))
            else:
                issues.append(ConfigIssue(full, f"{_show(value)} asks for {rule.feature}, which trident does "
                                                "not implement; remove the key or switch it off"))
        elif isinstance(value, dict) and key not in ("params",):
            section[key] = value = dict(value)
            _apply_rules(value, full, notes, issues)


def _show(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _legacy_names(data: dict) -> dict:
    """DeepSpeed's legacy spellings, renamed as DeepSpeed 0.19 renames them: the `bfloat16`
    section and the old ZeRO keys."""
    if "bfloat16" in data and "bf16" not in data:
        _deprecated("bfloat16", "bf16")
        data["bf16"] = data.pop("bfloat16")
    zero = data.get("zero_optimization")
    if isinstance(zero, bool):
        _deprecated("zero_optimization: true|false", "zero_optimization: {\"stage\": N}")
        new: dict[str, Any] = {"stage": 1 if zero else 0}
        if zero and "allgather_size" in data:
            new["allgather_bucket_size"] = data.pop("allgather_size")
        data["zero_optimization"] = new
        return data
    if not isinstance(zero, dict):
        return data
    zero = dict(zero)
    pin = zero.pop("cpu_offload_use_pin_memory", None)
    if pin is not None:
        _deprecated("zero_optimization.cpu_offload_use_pin_memory", "offload_*.pin_memory")
    for old, new_key in (("cpu_offload", "offload_optimizer"), ("cpu_offload_param", "offload_param"),
                         ("cpu_offload_params", "offload_param")):
        if old not in zero:
            continue
        value = zero.pop(old)
        _deprecated(f"zero_optimization.{old}", f"zero_optimization.{new_key}: {{\"device\": \"cpu\"}}")
        if value is True and new_key not in zero:
            zero[new_key] = {"device": "cpu", **({"pin_memory": bool(pin)} if pin is not None else {})}
    data["zero_optimization"] = zero
    return data


def _deprecated(old: str, new: str) -> None:
    warn_deprecated(old, new, stacklevel=7)  # the loader's once-per-process set, shared with its own aliases


def ignored_line(notes: list[Note]) -> str | None:
    """One line naming every DeepSpeed key that has no effect here, with the reasons."""
    ignored = [n for n in notes if n.kind == "ignored"]
    if not ignored:
        return None
    return f"config: {len(ignored)} DeepSpeed key(s) ignored, no effect here: " + "; ".join(str(n) for n in ignored)


def startup_lines(notes: list[Note]) -> list[str]:
    """At most two lines: the ignored DeepSpeed keys (with reasons), and the unknown keys."""
    return [line for line in (ignored_line(notes), unknown_line(notes)) if line]
