"""Config sections of the parallel layout: ZeRO (with offload and NVMe I/O), tensor, pipeline,
context and expert parallelism, LoRA and activation checkpointing. Attribute names are the JSON
keys; every field says why it exists and its unit.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import Field, field_validator, model_validator

from trident.config.errors import rule_error
from trident.config.section import Count, Section


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
