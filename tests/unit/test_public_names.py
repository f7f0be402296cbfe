"""Every public name a user imports today still imports (issue 34: names move, behaviour does not).

The list is what README.md, docs/ and examples/ import or spell out (`trident.hf.from_pretrained`,
`import trident as deepspeed` then `deepspeed.ops.adam`), and what each package's `__init__`
exports, as of 2026-11-27. A module that moves keeps its old public path working; removing a name
from this list is a breaking change and needs a deprecation note in README.md first.
"""

from __future__ import annotations

import importlib

import pytest

PUBLIC: dict[str, str] = {
    "trident": (
        "Engine ParallelMesh __version__ add_config_arguments checkpointing comm compression config "
        "context_parallel data get_fp32_state_dict_from_zero_checkpoint hf init_distributed initialize "
        "integrations load_config load_state_dict_from_zero_checkpoint models moe monitor ops optim "
        "parallel parameter_server peft pipe pipeline planner tensor_parallel utils zero"),
    "trident.checkpointing": (
        "apply_activation_checkpointing checkpoint configure consolidate "
        "get_fp32_state_dict_from_zero_checkpoint is_configured load_state_dict_from_zero_checkpoint "
        "profile_timings reset reshard"),
    "trident.checkpointing.consolidate": "get_fp32_state_dict_from_zero_checkpoint",
    "trident.checkpointing.reshard": "CheckpointReader",
    "trident.comm": (
        "CommsLogger DistEnv Handle OpStats P2POp ReduceOp all_gather all_gather_into_tensor "
        "all_gather_list all_reduce all_to_all all_to_all_single allgather_fn barrier broadcast "
        "collectives comms_logger configure default_device destroy_process_group exchange gather "
        "get_backend get_global_rank get_local_rank get_rank get_world_size inference_all_reduce "
        "init_distributed irecv is_available is_initialized isend log_summary new_group premul_sum recv "
        "reduce reduce_scatter reduce_scatter_fn reduce_scatter_tensor scatter send"),
    "trident.comm.backend": "init_distributed",
    "trident.comm.recorder": "FlightRecorder",
    "trident.compression": "CompressedAllReduce ErrorFeedback pack_signs unpack_signs",
    "trident.compression.traffic": "traffic",
    "trident.config": (
        "BF16Config BatchSizes CSVMonitorConfig CommsLoggerConfig ConfigError ConfigIssue DataConfig "
        "DistributedConfig FP16Config ModelConfig OptimizerConfig SchedulerConfig TensorBoardConfig "
        "TrainerConfig TridentConfig ZeroConfig batch_issues fill_auto load_config resolve_batch"),
    "trident.config.hf_auto": "auto_paths",
    "trident.config.loader": "load_config",
    "trident.config.schema": "DataConfig DistributedConfig",
    "trident.context_parallel": "ContextParallel METHODS apply_context_parallel attention bind current shard_batch using",
    "trident.data": (
        "BlendedDataset DistributedSampler DocumentCorpus Documents GPTWindows IndexedDataError "
        "IndexedDataset IndexedDatasetWriter PackedDocuments TokenDataset TridentDataLoader "
        "bundled_corpus_text encode_corpus load_text_dataset load_tokenizer load_tokens"),
    "trident.data.build": "build_loader",
    "trident.data.prepare": "prepare",
    "trident.data.tokenizer": "BUNDLED_CORPUS load_tokenizer",
    "trident.diagnostics": "ABORT_EXIT_CODE FlightRecorder OneLineError active_recorder configure preflight shutdown",
    "trident.diagnostics.gpu_device": "gpu_preset_name",
    "trident.hf": "LoadError export_checkpoint from_pretrained save_pretrained",
    "trident.integrations": "transformers",
    "trident.integrations.transformers": "TridentTrainer",
    "trident.models": "GPT GPTConfig GPT_PRESETS TinyMLP gpt_pipe make_regression_data",
    "trident.models.gpt": "GPT GPTConfig GPT_PRESETS MLP",
    "trident.models.gpt_pipe": "gpt_pipe load_gpt_state_dict",
    "trident.models.toy": "TinyMLP make_regression_data",
    "trident.moe": "MoE MoESpec apply_expert_parallel check_moe_args expert_stats is_expert layer moe_layers",
    "trident.moe.layer": "MoE",
    "trident.monitor": "CSVMonitor Monitors ProgressBar TensorBoardMonitor step_cost",
    "trident.monitor.log": "logger",
    "trident.monitor.step_cost": "StepCost",
    "trident.ops": "adam",
    "trident.ops.adam": "DeepSpeedCPUAdam FusedAdam",
    "trident.optim": (
        "CPUAdam LRRangeTest LRSchedule Lion Muon OneCycle WarmupCosineLR WarmupDecayLR WarmupLR "
        "build_optimizer build_scheduler check_optimizer check_scheduler resolve_optimizer_config "
        "resolve_scheduler_config"),
    "trident.parallel": "AXES AXIS_ORDER Coord DENSE_GRADIENT_AXES EXPERT_GRADIENT_AXES ParallelMesh Topology topology",
    "trident.parallel.mesh": "ParallelMesh",
    "trident.parameter_server": (
        "ParameterServerError PushPullStrategy ServeResult UpdateRecord WorkerLostError assign_servers "
        "format_updates initialize_parameter_server serve staleness_violations"),
    "trident.peft": "LoRALinear apply_lora lora_state_dict merge_lora merge_lora_state_dict save_adapters",
    "trident.pipe": "LayerSpec PipelineModule ProcessTopology TiedLayerSpec",
    "trident.pipeline": (
        "Backward BackwardInput BackwardWeight Costs Forward HFPipelineModule Instruction LayerSpec "
        "LoadMicroBatch OptimizerStep PipelineError PipelineModule RecvActivation RecvGrad ReduceGrads "
        "ReduceTiedGrads SCHEDULES ScheduleError SendActivation SendGrad StageExecutor TiedLayerSpec "
        "Timeline add_aux_loss build_all build_schedule check_schedule forward_only from_hf gpipe "
        "hf_shard_specs hf_state_dict interleaved_1f1b load_hf_state_dict one_f_one_b partition_balanced "
        "partition_uniform simulate zb_h1"),
    "trident.pipeline.instructions": "COMM COMPUTE RECVS SENDS channel_kind peer",
    "trident.planner": (
        "Candidate Cluster Estimate GPUSpec GPU_PRESETS Layout MODEL_PRESETS ModelSpec ModelStates "
        "SearchResult StateBytes Workload check estimate gpu_preset grad_accumulation layout_problems "
        "lora_parameters make_cluster mixed_precision_bytes model_from_gpt_config model_from_hf_config "
        "model_preset model_state_bytes search trident_state_bytes zero_paper_bytes zero_state_table"),
    "trident.planner.cluster": "Calibration load_calibration save_calibration",
    "trident.planner.memory": "activation_memory lora_parameters",
    "trident.planner.search": "fit_micro_batch",
    "trident.tensor_parallel": (
        "Column ColumnParallelLinear PRESETS Row RowParallelLinear STYLES SequenceParallelDropout "
        "ShardSpec Vocab VocabParallelEmbedding apply_plan apply_tensor_parallel copy_to_tp_region "
        "gather_from_sequence_parallel_region gather_from_tp_region is_tp_split mappings "
        "mark_sequence_parallel merge_state_dicts parallelize reduce_from_tp_region "
        "reduce_scatter_to_sequence_parallel_region scatter_to_sequence_parallel_region "
        "scatter_to_tp_region shard_specs split_state_dict tp_layers unit_dropout_mask "
        "vocab_parallel_cross_entropy"),
    "trident.testing.distributed": "cached_mesh run_on_ranks shutdown_pool",
    "trident.testing.memory": "LiveTensorBytes",
    "trident.utils": "RepeatingLoader logger zero_to_fp32",
    "trident.zero": "GatheredParameters Init TiledLinear ZeroOptimizer",
}


@pytest.mark.parametrize("module", sorted(PUBLIC))
def test_public_names_import(module):
    mod = importlib.import_module(module)
    missing = []
    for name in PUBLIC[module].split():
        if hasattr(mod, name):
            continue
        try:
            importlib.import_module(f"{module}.{name}")
        except ImportError:
            missing.append(name)
    assert not missing, f"{module} no longer provides {missing}"


def test_trident_imports_as_deepspeed():
    import trident as deepspeed

    assert deepspeed.initialize is importlib.import_module("trident").initialize
    for path in ("comm", "pipe", "ops.adam", "utils.zero_to_fp32", "zero", "checkpointing", "moe.layer"):
        target = deepspeed
        for part in path.split("."):
            target = getattr(target, part, None) or importlib.import_module(f"{target.__name__}.{part}")
        assert target is not None
