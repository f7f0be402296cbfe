"""Typed sections of a trident config: DeepSpeed's JSON keys, defaults and meanings.

Attribute names are the JSON keys (`cfg.fp16.loss_scale` is JSON `fp16.loss_scale`). Every field
says why it exists and its unit. Sections are frozen: the config is parsed once and then only read.
Load configs with `trident.config.load_config`, which reports unknown keys with a suggestion and
collects every problem; building these classes directly skips those friendlier checks.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from trident.config.errors import ConfigError, ConfigIssue, rule_error


class Section(BaseModel):
    """Base of every config section: unknown keys rejected, JSON types enforced, read-only."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


def _auto_is_none(value: Any) -> Any:
    # Hugging Face's DeepSpeed integration writes "auto" for values it fills in itself.
    return None if value == "auto" else value


BatchSize = Annotated[int | None, BeforeValidator(_auto_is_none)]
_BATCH = {"expects": 'a positive integer, "auto" or null'}


def _integral_float_to_int(value: Any) -> Any:
    # DeepSpeed configs write element counts as 5e8; JSON makes those floats.
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


Count = Annotated[int, BeforeValidator(_integral_float_to_int)]
"""An element or byte count: an integer, also written as a whole float such as 5e8."""


# -- precision ---------------------------------------------------------------------------------

class FP16Config(Section):
    """fp16 mixed precision with loss scaling (DeepSpeed's `fp16` section)."""

    enabled: bool = Field(False, description="Compute in fp16, keep fp32 master weights.")
    loss_scale: float = Field(0.0, ge=0, description=(
        "Static loss scale; 0 selects dynamic loss scaling (the scale searches for the largest "
        "value that does not overflow)."))
    initial_scale_power: int = Field(16, ge=0, description="Dynamic scaling starts at 2**initial_scale_power.")
    loss_scale_window: int = Field(1000, gt=0, description="Clean steps before the dynamic scale doubles.")
    hysteresis: int = Field(2, gt=0, description="Overflows tolerated before the dynamic scale is halved.")
    consecutive_hysteresis: bool = Field(False, description=(
        "Refill the hysteresis budget after every clean step, so only consecutive overflows count."))
    min_loss_scale: float = Field(1.0, gt=0, description="The dynamic scale is never halved below this.")


class BF16Config(Section):
    """bf16 mixed precision: fp32's exponent range, so no loss scaling is needed."""

    enabled: bool = Field(False, description="Compute in bf16, keep fp32 master weights.")


# -- optimizer and scheduler (their params are checked by trident.optim) ------------------------

class OptimizerConfig(Section):
    """The optimizer built when `trident.initialize` gets no `optimizer=`."""

    type: str = Field(json_schema_extra={"expects": "an optimizer name: Adam, AdamW, SGD, Adagrad, Lion, Lamb, "
                                                    "OneBitAdam, ZeroOneAdam or OneBitLamb"},
                      description=("Optimizer name, case-insensitive: Adam, AdamW, SGD, Adagrad, Lion, Lamb, or the "
                                   "1-bit OneBitAdam, ZeroOneAdam, OneBitLamb (ZeRO stage 0 only)."))
    params: dict[str, Any] = Field(default_factory=dict, description=(
        "Keyword arguments of the optimizer (DeepSpeed's names: lr, betas, eps, weight_decay, ...)."))


class SchedulerConfig(Section):
    """The learning-rate schedule, stepped once per optimizer step."""

    type: str = Field(json_schema_extra={"expects": "a schedule name: WarmupLR, WarmupDecayLR, WarmupCosineLR, "
                                                    "OneCycle or LRRangeTest"},
                      description="Schedule name (case-sensitive, as in DeepSpeed).")
    params: dict[str, Any] = Field(default_factory=dict, description="Keyword arguments of the schedule.")


# -- communication and monitoring --------------------------------------------------------------

class CommsLoggerConfig(Section):
    """Per-collective logging: op, bytes, time (DeepSpeed's `comms_logger`)."""

    enabled: bool = Field(False, description="Record every collective trident issues.")
    verbose: bool = Field(False, description="Log each collective as it completes, not only the summary.")
    prof_all: bool = Field(True, description="Record all ops; when false only those in prof_ops.")
    prof_ops: list[str] = Field(default_factory=list, description="Op names to record when prof_all is false.")
    debug: bool = Field(False, description="Add the calling function's name to each record.")


class TensorBoardConfig(Section):
    """Scalars (loss, lr, loss scale) written as TensorBoard events on rank 0."""

    enabled: bool = Field(False, description="Write TensorBoard event files.")
    output_path: str = Field("", description="Folder of the logs; empty means the current directory.")
    job_name: str = Field("DeepSpeedJobName", description="Sub-folder of output_path for this run.")


class CSVMonitorConfig(Section):
    """The same scalars as TensorBoard, as CSV files on rank 0."""

    enabled: bool = Field(False, description="Write CSV files.")
    output_path: str = Field("", description="Folder of the files; empty means the current directory.")
    job_name: str = Field("DeepSpeedJobName", description="Sub-folder of output_path for this run.")


class DistributedConfig(Section):
    """Process-group settings (a trident section)."""

    timeout_s: float = Field(1800.0, gt=0, allow_inf_nan=False, description=(
        "Seconds a collective may wait for the other ranks before the job stops with an error."))
    hang_detector: bool = Field(True, description=(
        "Record every collective and point-to-point call (op, group, sequence number, shapes, call "
        "site) in a per-rank ring buffer, and on a timeout report which ranks reached the stuck op."))
    flight_recorder_size: int = Field(256, gt=0, description="Calls kept per rank by the hang detector.")
    strict_collectives: bool = Field(False, description=(
        "Check cheaply that all ranks of a group issue the same collectives in the same order, and "
        "name the first divergence."))


class CheckpointConfig(Section):
    """`checkpoint`: periodic saving and automatic resume (a trident section; DeepSpeed's own
    `checkpoint` keys are not supported)."""

    path: str | None = Field(None, description=(
        "Folder of the periodic checkpoints (engine.save_checkpoint's save_dir); null = no periodic saving."))
    save_interval: int = Field(0, ge=0, description="Save every N optimizer steps; 0 = never.")
    keep_last: int = Field(0, ge=0, description="Keep only the newest N periodic checkpoints; 0 = keep all.")
    auto_resume: bool = Field(False, description=(
        "At initialize, load the newest complete checkpoint under `path` if there is one (used by "
        "elastic restarts: a restarted job continues where the last checkpoint left it)."))


class NumericsConfig(Section):
    """`numerics`: what to do when the loss or a gradient is not finite (a trident section)."""

    on_nonfinite: Literal["stop", "skip"] = Field("stop", description=(
        "fp32/bf16: a NaN or inf loss or gradient is reported with the first parameter it appears "
        "in, then the job stops (stop) or the step is skipped (skip). fp16 overflow is handled by "
        "the loss scaler and always skips."))


class HostAllocatorConfig(Section):
    """How glibc's malloc treats freed memory on CPU runs (a trident section).

    Autograd frees and re-allocates every gradient and activation each step. With glibc's
    defaults a process may hand those pages back to the OS and fault them in again on the next
    step (thousands of page faults per step for a 4M-parameter model); raising the thresholds
    keeps freed memory for reuse. Peak memory is unchanged; only the give-back is deferred.
    """

    enabled: bool = Field(True, description="Apply the thresholds below when the engine runs on CPU under glibc.")
    trim_threshold_mb: int = Field(512, gt=0, description=(
        "Free memory at the top of the heap kept before any is returned to the OS (MiB)."))
    mmap_threshold_mb: int = Field(32, gt=0, description=(
        "Allocations at least this large get their own mapping, unmapped on free (MiB)."))


# -- ZeRO ----------------------------------------------------------------------------------------

class OffloadOptimizerConfig(Section):
    """`zero_optimization.offload_optimizer`: where the fp32 masters and optimizer states live
    (ZeRO-Offload). The step runs on the CPU for both `cpu` and `nvme`."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description=(
        "none = with the parameters; cpu = host memory; nvme = files under nvme_path, swapped in per sub-group."))
    nvme_path: str | None = Field(None, description="Directory for the swap files (device nvme).")
    pin_memory: bool = Field(False, description="Page-locked host buffers (faster copies on CUDA).")
    buffer_count: Count = Field(4, gt=0, description="Sub-group buffers in flight (reads ahead, writes behind).")
    pipeline_read: bool | None = Field(None, description=(
        "Read the next sub-group while this one steps (prefetch); null = true. False reads on demand."))
    pipeline_write: bool | None = Field(None, description=(
        "Write sub-groups back while the next one steps; null = true. False waits for each write."))
    fast_init: bool = Field(False, description="DeepSpeed's faster NVMe start-up; accepted, start-up is already lazy.")
    ratio: float = Field(1.0, ge=0, le=1, description="Fraction of the optimizer offloaded; only 1.0 is supported.")

    @field_validator("ratio")
    @classmethod
    def _whole_ratio(cls, ratio: float) -> float:
        if ratio != 1.0:
            raise rule_error(f"got {ratio}; trident offloads the whole optimizer: use 1.0 or remove the key")
        return ratio


class OffloadParamConfig(Section):
    """`zero_optimization.offload_param`: where stage 3's parameter partitions live (ZeRO-Infinity)."""

    device: Literal["none", "cpu", "nvme"] = Field("none", description=(
        "none = device memory; cpu = host memory; nvme = one file per unit under nvme_path, read before its gather."))
    nvme_path: str | None = Field(None, description="Directory for the swap files (device nvme).")
    pin_memory: bool = Field(False, description="Page-locked host buffers (faster copies on CUDA).")
    buffer_count: Count = Field(5, gt=0, description="Parameter units read ahead of their gather.")
    buffer_size: Count = Field(100_000_000, gt=0, description="Elements per parameter swap buffer.")
    max_in_cpu: Count = Field(1_000_000_000, ge=0, description="Elements kept in host memory with device nvme.")


class AioConfig(Section):
    """`aio`: the asynchronous file I/O used by NVMe offload (DeepSpeed's libaio settings; trident
    uses a thread pool with positioned reads and writes)."""

    block_size: Count = Field(1_048_576, gt=0, description="Bytes per read or write call.")
    queue_depth: Count = Field(8, gt=0, description="Requests in flight per thread.")
    thread_count: Count = Field(1, gt=0, description="I/O threads (DeepSpeed's intra_op_parallelism).")
    intra_op_parallelism: Count | None = Field(None, gt=0, description="DeepSpeed's newer name of thread_count.")
    single_submit: bool = Field(False, description="Submit requests one at a time instead of in batches.")
    overlap_events: bool = Field(True, description="Overlap submitting and completing requests.")
    use_gds: bool = Field(False, description="GPUDirect Storage; not available, must be false.")

    @field_validator("use_gds")
    @classmethod
    def _no_gds(cls, use_gds: bool) -> bool:
        if use_gds:
            raise rule_error("GPUDirect Storage is not supported by trident; set aio.use_gds to false")
        return use_gds

    @property
    def threads(self) -> int:
        return self.intra_op_parallelism or self.thread_count


class ZeroConfig(Section):
    """`zero_optimization`: which model states are partitioned over the data-parallel ranks.

    Stage 1 partitions the optimizer states (and fp32 master weights), stage 2 also the
    gradients, stage 3 also the parameters. Defaults are DeepSpeed's.
    """

    stage: int = Field(0, description=(
        "0 = plain data parallelism, 1 = optimizer states partitioned, 2 = + gradients, 3 = + parameters."))
    reduce_bucket_size: Count = Field(500_000_000, gt=0, description=(
        "Elements per gradient reduction bucket: larger buckets mean fewer, bigger messages."))
    allgather_bucket_size: Count = Field(500_000_000, gt=0, description=(
        "Elements per all-gather of updated parameters after the step (stages 1 and 2)."))
    overlap_comm: bool | None = Field(None, validate_default=True, description=(
        "Reduce gradients while backward still runs (each bucket is sent as soon as it is full); "
        "null = true. False reduces everything after backward, in one pass."))
    contiguous_gradients: bool = Field(True, description=(
        "Stages 2-3: copy each reduced gradient partition into one preallocated flat buffer, so the "
        "partition is contiguous instead of one tensor per parameter."))
    reduce_scatter: bool = Field(True, description=(
        "Reduce gradients with reduce-scatter (each rank receives its shard only); false all-reduces "
        "each bucket and keeps the rank's shard: the same result for twice the traffic."))
    round_robin_gradients: bool = Field(False, description=(
        "Stages 1-2: lay the parameters into the flat buffers in round-robin order (every N-th "
        "parameter in backward order together, DeepSpeed's reordering), which changes which "
        "gradients share a bucket; the result is the same."))
    sub_group_size: Count = Field(1_000_000_000, gt=0, description=(
        "Elements of a rank's partition the optimizer steps at a time (bounds the step's temporaries)."))
    stage3_prefetch_bucket_size: Count = Field(50_000_000, ge=0, description=(
        "Stage 3: elements of parameters gathered ahead of the module about to run; 0 = no prefetch."))
    stage3_max_live_parameters: Count = Field(1_000_000_000, ge=0, description=(
        "Stage 3: most gathered (full) parameter elements kept at once; more forces releases."))
    stage3_max_reuse_distance: Count = Field(1_000_000_000, ge=0, description=(
        "Stage 3: a parameter needed again within this many elements of gathers stays gathered."))
    stage3_param_persistence_threshold: Count = Field(100_000, ge=0, description=(
        "Stage 3: parameters with at most this many elements are kept whole on every rank."))
    stage3_gather_16bit_weights_on_model_save: bool = Field(False, description=(
        "Stage 3: save_16bit_model gathers the full weights; false leaves it to the consolidate tool."))
    offload_optimizer: OffloadOptimizerConfig = Field(default_factory=OffloadOptimizerConfig, description=(
        "Stages 1-3: fp32 masters and optimizer states in host memory or on NVMe; the step on the CPU."))
    offload_param: OffloadParamConfig = Field(default_factory=OffloadParamConfig, description=(
        "Stage 3: parameter partitions in host memory or on NVMe."))
    zero_quantized_weights: bool = Field(False, description=(
        "Stage 3 (ZeRO++ qwZ): all-gather parameters as int8 with one scale per block of each shard."))
    zero_quantized_nontrainable_weights: bool = Field(False, description=(
        "Stage 3: frozen parameters are stored rounded to int8 blocks and all-gathered as int8 (LoRA bases)."))
    zero_quantized_gradients: bool = Field(False, description=(
        "Stage 3 (ZeRO++ qgZ): reduce-scatter gradients as int4 blocks, all-to-all inside each node, "
        "then across nodes."))
    zero_hpz_partition_size: int = Field(1, ge=0, description=(
        "Stage 3 (ZeRO++ hpZ): ranks per node holding a secondary copy of the parameters; backward "
        "gathers from it inside the node. 0 or 1 = off; must divide the data-parallel size."))

    @model_validator(mode="after")
    def _offload_needs_stage(self) -> ZeroConfig:
        for key, section, first in (("offload_optimizer", self.offload_optimizer, 1),
                                    ("offload_param", self.offload_param, 3)):
            if section.device != "none" and self.stage < first:
                raise rule_error(f"{key}.device is {section.device!r} but stage is {self.stage}; {key} needs "
                                 f"stage >= {first}: raise the stage or set {key}.device to 'none'")
            if section.device == "nvme" and not section.nvme_path:
                raise rule_error(f"{key}.device is 'nvme' but {key}.nvme_path is not set; give a directory "
                                 "on a fast local disk")
        return self

    def inapplicable_keys(self) -> list[str]:
        """Keys set away from their defaults that have no effect at this stage (DeepSpeed
        configs often carry stage 3 keys into stage 2 runs; the engine warns about them)."""
        first_stage = {"reduce_scatter": 1, "allgather_bucket_size": 1, "sub_group_size": 1,
                       "contiguous_gradients": 2, "round_robin_gradients": 1}
        first_stage.update({k: 3 for k in type(self).model_fields if k.startswith("stage3_")})
        default = ZeroConfig()
        return [k for k, first in first_stage.items()
                if getattr(self, k) != getattr(default, k)
                and (self.stage < first or (k == "round_robin_gradients" and self.stage == 3))]

    @field_validator("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients",
                     "zero_hpz_partition_size")
    @classmethod
    def _zeropp_needs_stage3(cls, value, info):
        on = value is True or (not isinstance(value, bool) and value > 1)
        if on and info.data.get("stage") != 3:
            raise rule_error(f"{json.dumps(value)} needs stage 3 (ZeRO++ works on partitioned parameters), but stage "
                             f"is {info.data.get('stage')}; set stage to 3 or remove the key")
        return value

    @field_validator("stage")
    @classmethod
    def _known_stage(cls, stage: int) -> int:
        if stage not in (0, 1, 2, 3):
            raise rule_error(f"expected one of 0, 1, 2, 3 (the ZeRO stage), got {stage}")
        return stage

    @field_validator("overlap_comm")
    @classmethod
    def _resolve_overlap(cls, overlap: bool | None) -> bool:
        return True if overlap is None else overlap


# -- model parallelism ---------------------------------------------------------------------------

class TensorParallelConfig(Section):
    """`tensor_parallel`: split weight matrices over `size` ranks (a trident section)."""

    size: int = Field(1, gt=0, description="Tensor-parallel ranks per model replica (innermost mesh axis).")
    sequence_parallel: bool = Field(False, description=(
        "Run LayerNorm and dropout on sequence shards; all-reduces become all-gather/reduce-scatter."))
    plan: str | dict[str, str] | None = Field(None, description=(
        'How to split a model written without trident: a preset name ("gpt2", "llama"), "hf" (a '
        "transformers model's own plan), \"auto\" (\"hf\", else the preset of its model type) or "
        '{module-name pattern: "column" | "row" | "vocab"}; null for models built from trident layers.'))


class PipelineConfig(Section):
    """`pipeline`: consecutive layers on different ranks, micro-batches streamed through them."""

    stages: int = Field(1, gt=0, description="Pipeline stages (outermost mesh axis).")
    partition_method: str = Field("parameters", description=(
        '"parameters" (balance parameter counts), "uniform" (layer counts) or "type:REGEX".'))
    schedule: Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"] = Field("1f1b", description=(
        "Order of forward and backward work on each stage."))
    virtual_stages: int = Field(1, gt=0, description="Model chunks per rank (interleaved_1f1b only).")
    micro_batches: int | None = Field(None, gt=0, description=(
        "Micro-batches per step; null = gradient_accumulation_steps (they are the same thing)."))


def _reserved_size(size: int, feature: str) -> int:
    """The size of a mesh axis whose feature has not landed: only 1 is accepted."""
    if size > 1:
        raise rule_error(f"{size} is not supported yet ({feature} is not implemented); set it to 1")
    return size


class ContextParallelConfig(Section):
    """`context_parallel`: split every sequence over `size` ranks (mesh axis cp, between dp and ep).
    Each rank holds 2 of 2 x size chunks (load-balanced under the causal mask); attention reaches
    the rest by the ring, by Ulysses' all-to-all, or both (trident.context_parallel)."""

    size: int = Field(1, gt=0, description=(
        "Context-parallel ranks per model replica, each holding a slice of every sequence; 1 = off."))
    method: Literal["ring", "ulysses", "hybrid"] = Field("ring", description=(
        "ring: key/value blocks travel around the cp ranks; ulysses: all-to-all to head shards "
        "(heads divisible by size); hybrid: Ulysses inside groups of ulysses_size, the ring across."))
    ulysses_size: int | None = Field(None, gt=0, description=(
        "hybrid only: ranks per Ulysses group (divides size); null = size for ulysses."))

    @model_validator(mode="after")
    def _hybrid_needs_ulysses_size(self) -> "ContextParallelConfig":
        if self.method == "hybrid" and (self.ulysses_size is None or self.size % self.ulysses_size):
            raise rule_error(f"method 'hybrid' needs ulysses_size dividing size={self.size}, got "
                             f"{self.ulysses_size}; Ulysses runs inside groups of ulysses_size ranks and the ring "
                             f"across them")
        if self.method != "hybrid" and self.ulysses_size not in (None, self.size if self.method == "ulysses" else 1):
            raise rule_error(f"ulysses_size={self.ulysses_size} is only used with method 'hybrid' (method is "
                             f"{self.method!r}); remove it or set method to 'hybrid'")
        return self


class ExpertParallelConfig(Section):
    """`expert_parallel`: place each mixture-of-experts layer's experts on `size` ranks (mesh axis
    ep, between cp and tp; `trident.moe`). The data-parallel size of the batch arithmetic is then
    dp x ep: ep ranks see different samples."""

    size: int = Field(1, gt=0, description=(
        "Expert-parallel ranks: each holds 1/size of the experts and sees its own data; 1 = off."))


class LoRAConfig(Section):
    """`lora`: freeze the model and train low-rank adapters on its target linear layers
    (`trident.peft.apply_lora`; peft's names). Present = on."""

    r: int = Field(8, gt=0, description="Rank of each adapter (A: r x in, B: out x r).")
    alpha: float = Field(16.0, gt=0, description="The update is scaled by alpha / r.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the adapter's input.")
    target_modules: list[str] = Field(default_factory=lambda: ["qkv", "proj", "fc"], description=(
        "Linear layers to adapt: a module whose name equals an entry or ends with '.' + it; an entry with "
        "regex characters must match the whole name."))
    modules_to_save: list[str] = Field(default_factory=list, description=(
        "Modules trained in full besides the adapters (e.g. a new head)."))
    bias: Literal["none", "lora_only", "all"] = Field("none", description="Which biases train.")
    init: Literal["default", "gaussian", "pissa"] = Field("default", description=(
        "A's initialisation (B starts at zero): kaiming-uniform, N(0, 1/r), or the base weight's top-r "
        "singular directions (PiSSA; moved out of the frozen weight)."))


class ActivationCheckpointingConfig(Section):
    """Recompute layers in backward instead of keeping their activations (DeepSpeed's section,
    plus `layers` / `every` to choose which modules trident.initialize wraps)."""

    partition_activations: bool = Field(False, description=(
        "Split each kept layer input over the tensor-parallel ranks; gather it for the rerun."))
    cpu_checkpointing: bool = Field(False, description="Keep the (partitioned) layer inputs in host memory.")
    contiguous_memory_optimization: bool = Field(False, description=(
        "Copy kept inputs into number_checkpoints preallocated buffers reused every step."))
    number_checkpoints: int | None = Field(None, gt=0, description=(
        "Checkpointed layers alive at once (needed by contiguous_memory_optimization)."))
    synchronize_checkpoint_boundary: bool = Field(False, description=(
        "torch.cuda.synchronize() at each checkpoint boundary (CUDA only)."))
    profile: bool = Field(False, description="Time each checkpointed forward and rerun.")
    layers: list[str] = Field(default_factory=list, description=(
        "Regexes of module names (model.named_modules()) to checkpoint, e.g. [\"blocks\\\\.\\\\d+\"]; "
        "empty = none wrapped by trident (the model may call trident.checkpointing.checkpoint itself)."))
    every: int = Field(1, gt=0, description="Checkpoint every k-th module matching `layers` (selective).")

    @field_validator("layers")
    @classmethod
    def _valid_regexes(cls, layers: list[str]) -> list[str]:
        import re  # only here: the one regex-valued key of the schema
        for pattern in layers:
            try:
                re.compile(pattern)
            except re.error as err:
                raise rule_error(f"{pattern!r} is not a valid regular expression ({err}); write module-name "
                                 f"patterns like \"blocks\\\\.\\\\d+\"") from None
        return layers


# -- compilation ---------------------------------------------------------------------------------

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options")


class CompileConfig(Section):
    """`compile`: each transformer block (decoder layer, pipeline layer) compiled with
    `torch.compile` after parallelization (DeepSpeed's section; its DeepCompile keys are handled
    in trident.config.compat)."""

    enabled: bool = Field(False, description="Compile each block with torch.compile.")
    scope: Literal["model", "blocks"] | None = Field(None, description=(
        "What is compiled: \"model\" = the model's whole call (embedding, head and loss with the "
        "blocks: fewest graphs and launches), \"blocks\" = each transformer block, null = the whole "
        "model on a GPU when nothing in it must stay eager (no ZeRO-3, tensor, context or pipeline "
        "parallelism, no activation checkpointing), else the blocks."))
    backend: str = Field("inductor", description=(
        "torch.compile's backend: a name from torch._dynamo.list_backends() or an importable "
        "`package.module.function`."))
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = Field(
        None, description="torch.compile's mode; null = its default.")
    fullgraph: bool = Field(False, description=(
        "Fail on any graph break inside a block (ZeRO-3's gather hooks and tensor parallelism's "
        "collectives need breaks: see docs/compile.md)."))
    dynamic: bool | None = Field(None, description="torch.compile's dynamic shapes; null = decided by torch.")
    options: dict[str, Any] | None = Field(None, description="Backend options (inductor's config keys).")
    kwargs: dict[str, Any] = Field(default_factory=dict, description=(
        "More torch.compile arguments (DeepSpeed 0.14's key): fullgraph, dynamic, mode or options."))

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, backend: str) -> str:
        if backend == "inductor":
            return backend
        import importlib
        import torch._dynamo  # only here: the list of backends
        known = torch._dynamo.list_backends(exclude_tags=())
        module_name, _, fn_name = backend.rpartition(".")
        if backend in known:
            return backend
        if module_name:
            try:
                if callable(getattr(importlib.import_module(module_name), fn_name, None)):
                    return backend
            except ImportError:
                pass
        names = ", ".join(b for b in sorted(known) if b.islower())  # not the TESTING_ONLY ones
        raise rule_error(f"{backend!r} is not a torch.compile backend: it is neither one of "
                         f"torch._dynamo.list_backends() ({names}) nor an importable package.module.function; "
                         f"use \"inductor\" (the default) or \"aot_eager\"")

    @field_validator("kwargs")
    @classmethod
    def _known_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(kwargs) - set(COMPILE_KWARGS))
        if unknown:
            raise rule_error(f"{unknown} are not torch.compile arguments trident passes; allowed: "
                             f"{list(COMPILE_KWARGS)} (backend has its own key, compile.backend)")
        mode = kwargs.get("mode")
        if mode is not None and mode not in COMPILE_MODES:
            raise rule_error(f"mode {mode!r} is not a torch.compile mode; choose one of {list(COMPILE_MODES)}")
        return kwargs

    @model_validator(mode="after")
    def _one_of_mode_and_options(self) -> CompileConfig:
        merged = self.compile_kwargs()
        clash = [k for k in self.kwargs if getattr(self, k) not in (None, False, {})
                 and getattr(self, k) != self.kwargs[k]]
        if clash:
            raise ConfigError([ConfigIssue("kwargs", (
                f"{clash} given both as compile.<key> and in compile.kwargs with different values; keep one"))])
        if merged.get("mode") is not None and merged.get("options"):
            raise ConfigError([ConfigIssue("options", (
                f"set together with mode {merged['mode']!r}; torch.compile takes one of them: use options alone "
                "(e.g. {\"max_autotune\": true}) or mode alone"))])
        return self

    def compile_kwargs(self) -> dict[str, Any]:
        """torch.compile's keyword arguments: the named keys over `kwargs`, unset ones left out."""
        named = {"fullgraph": self.fullgraph or None, "dynamic": self.dynamic, "mode": self.mode,
                 "options": self.options}
        merged = {**self.kwargs, **{k: v for k, v in named.items() if v is not None}}
        return {"backend": self.backend, **merged}


# -- parameter server ----------------------------------------------------------------------------

class ParameterServerConfig(Section):
    """`parameter_server`: servers hold the parameters and run the optimizer; workers compute
    gradients, push them and pull fresh parameters (a trident section)."""

    servers: int = Field(0, ge=0, description=(
        "Server ranks; 0 = no parameter server (collective data parallelism). The first S ranks serve."))
    mode: Literal["sync", "async"] = Field("sync", description=(
        "sync: a server waits for every worker's gradient (equals data parallelism); async: it applies "
        "each gradient as it arrives."))
    staleness: int = Field(0, ge=0, description=(
        "async: a worker more than this many versions behind a shard blocks until it catches up "
        "(0 = synchronous)."))
    placement: Literal["round_robin", "balanced"] = Field("balanced", description=(
        "How parameters are assigned to servers: tensor by tensor in turn, or balanced by size."))


# -- trident's built-in trainer (`trident train`; ignored by trident.initialize) ------------------

class MoEModelConfig(Section):
    """`model.moe`: make every `every_n_layers`-th block's MLP a mixture of experts (`trident.moe.MoE`)."""

    num_experts: int = Field(8, gt=0, description="Experts per MoE layer (a multiple of expert_parallel.size).")
    k: int = Field(2, gt=0, description="Experts each token visits (top-k).")
    every_n_layers: int = Field(1, gt=0, description="Blocks every_n_layers - 1, 2 x every_n_layers - 1, ... are MoE.")
    capacity_factor: float = Field(1.0, gt=0, description="Slots per expert = ceil(tokens / experts x factor x k).")
    eval_capacity_factor: float = Field(1.0, gt=0, description="capacity_factor in evaluation.")
    min_capacity: int = Field(4, ge=0, description="Slots per expert at least.")
    drop_tokens: bool = Field(True, description="Drop choices past capacity; false = dropless.")
    aux_loss_coef: float = Field(0.01, ge=0, description="Weight of the load-balancing loss in the training loss.")
    z_loss_coef: float = Field(0.0, ge=0, description="Weight of the router z-loss in the training loss.")

    @model_validator(mode="after")
    def _k_fits(self) -> MoEModelConfig:
        if self.k > self.num_experts:
            raise rule_error(f"k={self.k} is larger than num_experts={self.num_experts}; each token picks k "
                             "distinct experts, so choose k <= num_experts")
        return self


class ModelConfig(Section):
    """The model `trident train` builds; explicit sizes override the preset's."""

    type: Literal["gpt"] = Field("gpt", description="Model family; trident's reference GPT.")
    preset: str | None = Field(None, description="A named size from trident.models.gpt.GPT_PRESETS.")
    n_layer: int | None = Field(None, gt=0, description="Transformer blocks.")
    n_head: int | None = Field(None, gt=0, description="Attention heads per block.")
    d_model: int | None = Field(None, gt=0, description="Width of the residual stream.")
    seq_len: int | None = Field(None, gt=0, description="Tokens per training sequence (context length).")
    d_ff: int | None = Field(None, gt=0, description="Hidden width of the MLP; null = 4 x d_model.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout probability.")
    bias: bool = Field(True, description="Bias terms in linear layers and layer norms.")
    tie_embeddings: bool = Field(True, description="Share the token embedding with the output layer.")
    moe: MoEModelConfig | None = Field(None, description="Mixture-of-experts MLPs; null = dense.")


class DataConfig(Section):
    """The data `trident train` trains on: prepared `.bin`/`.idx` shards (`trident data prepare`)."""

    dataset: str = Field("kjv", description=(
        '"kjv" (the bundled corpus) or a UTF-8 text file (one document per line); used when `paths` is '
        "null, prepared into ~/.cache/trident/data on first use."))
    tokenizer: str | None = Field(None, description="Path to a tokenizers JSON file; null = the bundled one.")
    paths: list[str] | None = Field(None, description=(
        "Prepared data: folders of .bin/.idx shards or shard prefixes, one corpus each; null = `dataset`."))
    weights: list[float] | None = Field(None, description=(
        "Share of samples drawn from each of `paths` (normalised; exact within one sample at every prefix); "
        "null = proportional to their sizes."))
    seq_len: int | None = Field(None, gt=0, description="Tokens per training sequence; null = model.seq_len.")
    packing: bool = Field(False, description=(
        "Pack whole documents into each sequence; position ids restart and attention is blocked at "
        "document boundaries, so a packed row trains like its documents one by one."))
    bucketing: bool = Field(False, description=(
        "One document per sample, batched with documents of similar length under max_tokens_per_batch."))
    max_tokens_per_batch: int | None = Field(None, gt=0, description=(
        "With bucketing: padded tokens per micro-batch (instead of a sample count); null = micro batch x seq_len."))
    num_workers: int = Field(0, ge=0, description=(
        "Loader worker processes per rank (prefetching); 0 = read in the training process, which on CPU is "
        "cheaper: a memory-mapped sample costs microseconds, a worker's hand-over milliseconds."))
    seed: int | None = Field(None, description="Seed of the data order; null = the top-level `seed`.")
    shuffle: bool = Field(True, description="Reshuffle the training sequences every epoch.")
    drop_last: bool = Field(True, description=(
        "Kept for old configs; the stream of samples runs on across epochs, so no batch is incomplete."))
    val_fraction: float = Field(0.01, ge=0, lt=1, description="Share of the documents held out for validation.")

    @model_validator(mode="after")
    def _consistent(self) -> DataConfig:
        problems = []
        if self.weights is not None:
            if self.paths is None or len(self.weights) != len(self.paths):
                problems.append(f"weights has {len(self.weights)} entries for "
                                f"{0 if self.paths is None else len(self.paths)} paths; give one weight per path")
            elif any(w < 0 for w in self.weights) or not sum(self.weights) > 0:
                problems.append(f"weights {self.weights} must be non-negative and sum to a positive number (they "
                                f"sum to {sum(self.weights)}); they are normalised, so [3, 1] draws 75% from "
                                f"the first path")
        if self.paths is not None and not self.paths:
            problems.append("paths is empty; give at least one folder or shard prefix, or null")
        if self.packing and self.bucketing:
            problems.append("packing and bucketing are both true; packing fills fixed rows with whole documents, "
                            "bucketing batches single documents by length: choose one")
        if self.max_tokens_per_batch is not None and not self.bucketing:
            problems.append("max_tokens_per_batch is set but bucketing is false; it only applies to bucketed "
                            "batches: set bucketing to true or remove it")
        if problems:
            raise rule_error("; ".join(problems))
        return self


class TrainerConfig(Section):
    """Length, logging and checkpointing of a `trident train` run."""

    train_steps: int = Field(150, gt=0, description="Optimizer steps to run.")
    run_dir: str = Field("runs", description="Folder that holds one sub-folder per run.")
    run_name: str | None = Field(None, description="Name of this run's folder; null = a timestamp.")
    save_interval: int = Field(0, ge=0, description="Save a checkpoint every N steps; 0 = only at the end.")
    log_interval: int = Field(1, gt=0, description="Write metrics every N steps.")


# -- the whole config ----------------------------------------------------------------------------

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
    comms_logger: CommsLoggerConfig = Field(default_factory=CommsLoggerConfig, description="Collective logging.")
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig, description="TensorBoard scalars.")
    csv_monitor: CSVMonitorConfig = Field(default_factory=CSVMonitorConfig, description="CSV scalars.")
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
    model: ModelConfig = Field(default_factory=ModelConfig, description="`trident train` only.")
    data: DataConfig = Field(default_factory=DataConfig, description="`trident train` only.")
    trainer: TrainerConfig = Field(default_factory=TrainerConfig, description="`trident train` only.")
    _notes: tuple = PrivateAttr(default=())
    """Keys the loader accepted without using (`trident.config.compat.Note`): DeepSpeed keys with
    no effect here and unknown keys; `trident.initialize` lists them in one start-up line."""

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


# -- keys the loader treats specially (kept here, in one place) -----------------------------------

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

_DEEPSPEED_ONLY_TOP_LEVEL = frozenset({
    "amp", "autotuning", "comet",
    "compression_training", "curriculum_learning", "data_efficiency", "data_types",
    "dataloader_drop_last", "disable_allgather", "dump_state", "eigenvalue", "elasticity", "flops_profiler",
    "gradient_allreduce_op", "graph_harvesting", "hybrid_engine", "log_level", "managed_gradient_accumulation",
    "memory_breakdown", "nebula", "progressive_layer_drop", "sparse_attention",
    "sparse_gradients", "timers", "torch_autocast", "wandb", "weight_quantization",
    "zero_allow_untested_optimizer", "zero_force_ds_cpu_optimizer",
})

_DEEPSPEED_SETTING = "`{path}` is a DeepSpeed setting that this version of trident does not implement; remove it"

UNIMPLEMENTED_KEYS: dict[str, tuple[frozenset[str], str]] = {
    "checkpoint": (frozenset({"tag_validation", "load_universal", "use_node_local_storage", "parallel_write",
                              "writer"}), _DEEPSPEED_SETTING),
    "zero_optimization": (ZERO_UNIMPLEMENTED_KEYS, "`{path}` is a ZeRO setting that this version of "
                                                   "trident does not implement; remove it"),
    "": (_DEEPSPEED_ONLY_TOP_LEVEL, _DEEPSPEED_SETTING),
    "fp16": (frozenset({"auto_cast", "fp16_master_weights_and_grads"}), _DEEPSPEED_SETTING),
    "bf16": (frozenset({"immediate_grad_update", "check_overflow", "bf16_master_weights_and_grads",
                        "bf16_optimizer_states"}), _DEEPSPEED_SETTING),
}
"""Section path -> (real DeepSpeed keys trident lacks, message). These get a specific error
instead of "unknown key", so a DeepSpeed user learns the key is real but not supported here."""
