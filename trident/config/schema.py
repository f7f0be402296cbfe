"""Typed sections of a trident config: DeepSpeed's JSON keys, defaults and meanings.

Attribute names are the JSON keys (`cfg.fp16.loss_scale` is JSON `fp16.loss_scale`). Every field
says why it exists and its unit. Sections are frozen: the config is parsed once and then only read.
Load configs with `trident.config.load_config`, which reports unknown keys with a suggestion and
collects every problem; building these classes directly skips those friendlier checks.

`TridentConfig`, the whole config, is here; its sections are in `run_sections` (precision,
optimizer, monitors, checkpoints, compile, parameter server...), `parallel_sections` (ZeRO and
the parallel layouts) and `trainer_sections` (`trident train`), on the base in `section`. Every
section class is importable from this module too.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, PrivateAttr, field_validator, model_validator

from trident.config.errors import ConfigError, ConfigIssue
from trident.config.monitor_sections import CometConfig, CurriculumLearningConfig, MLflowConfig, WandbConfig
from trident.config.parallel_sections import (ActivationCheckpointingConfig, AioConfig, ContextParallelConfig,
                                              ExpertParallelConfig, LoRAConfig, OffloadOptimizerConfig,
                                              OffloadParamConfig, PipelineConfig, TensorParallelConfig, ZeroConfig)
from trident.config.run_sections import (BF16Config, CheckpointConfig, CommsLoggerConfig, CompileConfig,
                                         CSVMonitorConfig, DistributedConfig, FP16Config, FP8Config,
                                         FP8FilterConfig, HostAllocatorConfig,
                                         NumericsConfig, OptimizerConfig, ParameterServerConfig, SchedulerConfig,
                                         TensorBoardConfig)
from trident.config.run_sections import FlopsProfilerConfig
from trident.config.section import BatchSize, Section
from trident.config.trainer_sections import DataConfig, ModelConfig, MoEModelConfig, TrainerConfig

__all__ = [
    "ActivationCheckpointingConfig", "AioConfig", "BF16Config", "CSVMonitorConfig", "CheckpointConfig",
    "CommsLoggerConfig", "CompileConfig", "ContextParallelConfig", "DataConfig", "DistributedConfig",
    "ExpertParallelConfig", "FP16Config", "FP8Config", "FP8FilterConfig", "FlopsProfilerConfig", "HostAllocatorConfig",
    "LoRAConfig", "ModelConfig", "MoEModelConfig",
    "NumericsConfig", "OffloadOptimizerConfig", "OffloadParamConfig", "OptimizerConfig", "ParameterServerConfig",
    "PipelineConfig", "SchedulerConfig", "Section", "TensorBoardConfig", "TensorParallelConfig", "TrainerConfig",
    "TridentConfig", "ZeroConfig",
]
__all__ += ["CometConfig", "CurriculumLearningConfig", "MLflowConfig", "WandbConfig"]  # monitor_sections

_BATCH = {"expects": 'a positive integer, "auto" or null'}


class TridentConfig(Section):
    """A whole config. Missing sections take their defaults."""

    train_batch_size: BatchSize = Field(None, gt=0, json_schema_extra=_BATCH, description=(
        "Samples per optimizer step over all data-parallel ranks = micro x accumulation x dp."))
    train_micro_batch_size_per_gpu: BatchSize = Field(None, gt=0, json_schema_extra=_BATCH, description=(
        "Samples per forward/backward on one rank."))
    gradient_accumulation_steps: BatchSize = Field(None, gt=0, json_schema_extra=_BATCH, description=(
        "Micro-batches whose gradients are summed before each optimizer step."))
    optimizer: OptimizerConfig | None = Field(None, description="Built when initialize() gets no optimizer.")
    scheduler: SchedulerConfig | None = Field(None, description="Learning-rate schedule; null = constant lr.")
    fp16: FP16Config = Field(default_factory=FP16Config, description="fp16 mixed precision.")
    bf16: BF16Config = Field(default_factory=BF16Config, description="bf16 mixed precision.")
    fp8: FP8Config = Field(default_factory=FP8Config, description=(
        "FP8 matmuls of the linear layers (torchao.float8), on top of bf16/fp32 compute."))
    gradient_clipping: float = Field(0.0, ge=0, json_schema_extra={"hint": "0 disables clipping"}, description=(
        "Clip the global L2 norm of the gradients to this value; 0 disables clipping."))
    communication_data_type: Literal["fp32", "fp16", "bf16"] | None = Field(None, description=(
        "Dtype gradients are reduced in (cast for the collective and back); null = DeepSpeed's default, the "
        "run's 16-bit dtype under fp16/bf16, else fp32. bf16 halves a bf16 run's stage-0 gradient bytes."))
    gradient_predivide_factor: float = Field(1.0, gt=0, description=(
        "Divide gradients by this before the all-reduce and by dp/factor after (keeps fp16 sums in range)."))
    prescale_gradients: bool = Field(False, description="Divide gradients by dp before the all-reduce, not after.")
    steps_per_print: int | None = Field(10, ge=0, description=(
        "Log loss, lr and loss scale every N optimizer steps; 0 or null = never."))
    wall_clock_breakdown: bool = Field(False, description="Time forward, backward and step; log with each print.")
    seed: int = Field(1234, description="Seed of model initialisation and data order.")
    dataloader_drop_last: bool = Field(False, description=(
        "Drop the last incomplete micro-batch of each epoch in the loader initialize(training_data=...) builds."))
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig, description="Collective logging.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard scalars.")
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig, description="CSV scalars.")
    wandb: WandbConfig = Field(default_factory=WandbConfig, description="Weights & Biases scalars.")
    comet: CometConfig = Field(default_factory=CometConfig, description="Comet scalars.")
    mlflow: MLflowConfig = Field(default_factory=MLflowConfig, description="MLflow scalars.")
    curriculum_learning: CurriculumLearningConfig = Field(default_factory=CurriculumLearningConfig, description=(
        "DeepSpeed's legacy sequence-length curriculum."))
    distributed: DistributedConfig = Field(default_factory=DistributedConfig, description="Process groups.")
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig, description=(
        "Periodic checkpoints and auto-resume."))
    numerics: NumericsConfig = Field(default_factory=NumericsConfig, description="Non-finite loss or gradients.")
    host_allocator: HostAllocatorConfig = Field(default_factory=HostAllocatorConfig, description=(
        "glibc malloc thresholds on CPU runs."))
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig, description="ZeRO stages 0-3.")
    aio: AioConfig = Field(default_factory=AioConfig, description="File I/O of NVMe offload.")
    tensor_parallel: TensorParallelConfig = Field(default_factory=TensorParallelConfig, description=(
        "Tensor parallelism."))
    pipeline: PipelineConfig = Field(default_factory=PipelineConfig, description="Pipeline parallelism.")
    context_parallel: ContextParallelConfig = Field(default_factory=ContextParallelConfig, description=(
        "Context (sequence) parallelism; not implemented yet."))
    expert_parallel: ExpertParallelConfig = Field(default_factory=ExpertParallelConfig, description=(
        "Expert parallelism (mixture-of-experts layers)."))
    lora: LoRAConfig | None = Field(None, description="LoRA fine-tuning (frozen base, trainable adapters).")
    activation_checkpointing: ActivationCheckpointingConfig = Field(
        default_factory=ActivationCheckpointingConfig, description="Activation checkpointing (recompute).")
    compile: CompileConfig = Field(default_factory=CompileConfig, description=(
        "torch.compile of each block after parallelization."))
    parameter_server: ParameterServerConfig = Field(default_factory=ParameterServerConfig, description=(
        "Parameter-server training."))
    flops_profiler: FlopsProfilerConfig = Field(default_factory=FlopsProfilerConfig, description=(
        "FLOPs, parameters and latency per module at one step; TFLOP/s and MFU."))
    model: ModelConfig = Field(default_factory=ModelConfig, description="`trident train` only.")
    data: DataConfig = Field(default_factory=DataConfig, description="`trident train` only.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="`trident train` only.")
    _notes: tuple = PrivateAttr(default=())
    """Keys the loader accepted without using (`trident.config.notes.Note`): DeepSpeed keys with
    no effect here and unknown keys; `trident.initialize` lists them in one start-up line."""

    def get(self, key: str, default: Any = None) -> Any:
        """A top-level section of this config as plain data: DeepSpeed's `engine.config` is the
        config dict, and transformers reads it so (`engine.config.get("zero_optimization", {}).get("stage")`).
        Keys trident does not keep (unknown or ignored ones) read as `default`."""
        return self.model_dump().get(key, default)

    @model_validator(mode="after")
    def _experts_divide(self) -> TridentConfig:
        moe, ep = self.model.moe, self.expert_parallel.size
        if moe is not None and moe.num_experts % ep:
            raise ConfigError([ConfigIssue("model.moe.num_experts", (
                f"{moe.num_experts} is not divisible by expert_parallel.size={ep}; each ep rank holds "
                f"num_experts / ep experts, so choose a multiple of {ep}"))])
        return self

    @field_validator("communication_data_type", mode="before")
    @classmethod
    def _comm_dtype_any_case(cls, value: Any) -> Any:
        return value.lower() if isinstance(value, str) else value  # DeepSpeed lower-cases it too

    @model_validator(mode="after")
    def _fp8_not_with_parameter_server(self) -> TridentConfig:
        if self.fp8.enabled and self.parameter_server.servers > 0:
            raise ConfigError([ConfigIssue("fp8.enabled", (
                "true with parameter_server.servers > 0; parameter-server training does not convert the model to "
                "FP8: set fp8.enabled to false or parameter_server.servers to 0"))])
        return self

    @model_validator(mode="after")
    def _fp8_all_gather_under_zero3(self) -> TridentConfig:
        if not self.fp8.all_gather:
            return self
        zero = self.zero_optimization
        conflicts = [("fp8.enabled", not self.fp8.enabled, "false"),
                     ("zero_optimization.stage", zero.stage != 3, str(zero.stage)),
                     ("zero_optimization.offload_param.device", zero.offload_param.device != "none",
                      repr(zero.offload_param.device)),
                     ("zero_optimization.zero_quantized_weights", zero.zero_quantized_weights, "true"),
                     ("zero_optimization.zero_quantized_nontrainable_weights",
                      zero.zero_quantized_nontrainable_weights, "true"),
                     ("zero_optimization.zero_hpz_partition_size", zero.zero_hpz_partition_size > 1,
                      str(zero.zero_hpz_partition_size))]
        for key, bad, value in conflicts:
            if bad:
                raise ConfigError([ConfigIssue("fp8.all_gather", (
                    f"true with {key} {value}; the float8 all-gather of weights needs fp8.enabled true and "
                    "zero_optimization.stage 3 with the parameter shards on the device (offload_param.device "
                    "\"none\") and no ZeRO++ weight quantization or secondary partition (qwZ, hpZ): change "
                    f"{key} or set fp8.all_gather to false"))])
        return self

    @model_validator(mode="after")
    def _one_precision(self) -> TridentConfig:
        if self.fp16.enabled and self.bf16.enabled:
            raise ConfigError([ConfigIssue("fp16.enabled", (
                "fp16.enabled and bf16.enabled are both true; enable at most one "
                "(bf16 needs no loss scaling, fp16 is for hardware without bf16)"))])
        return self

    def to_dict(self) -> dict[str, Any]:
        """The fully resolved config (every default filled in) as JSON-ready data."""
        return self.model_dump(mode="json")

    def resolved_json(self, indent: int = 2) -> str:
        """`to_dict()` as JSON text, for printing and for saving into a run folder."""
        return json.dumps(self.to_dict(), indent=indent)
