"""Config sections of the run itself: precision, optimizer and scheduler, communication logging
and monitors, process groups, checkpoints, numerics, the host allocator, compilation and the
parameter server. Attribute names are the JSON keys; every field says why it exists and its unit.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from trident.config.errors import ConfigError, ConfigIssue, rule_error
from trident.config.section import Section


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


class FP8FilterConfig(Section):
    """Which linear layers `fp8` converts, by module name (the name in `model.named_modules()`
    after tensor parallelism, e.g. `blocks.0.attn.qkv`). Patterns are Python regexes matched
    with `re.search`, so `head` matches any name containing it; anchor with `^...$` for exact names."""

    convert: list[str] = Field(default_factory=list, description=(
        "Convert only linear layers whose name matches one of these; empty = every linear layer."))
    skip: list[str] = Field(default_factory=list, description=(
        "Keep linear layers whose name matches one of these in the compute dtype (e.g. the head and the first "
        "and last block: [\"head\", \"^blocks\\\\.0\\\\.\", \"^blocks\\\\.11\\\\.\"]); wins over convert."))

    @field_validator("convert", "skip")
    @classmethod
    def _regexes_compile(cls, patterns: list[str]) -> list[str]:
        for i, pattern in enumerate(patterns):
            try:
                re.compile(pattern)
            except re.error as err:
                raise rule_error(f"entry {i}, {pattern!r}, is not a valid regular expression ({err}); "
                                 "write a Python regex matched against module names") from None
        return patterns


class FP8Config(Section):
    """FP8 matmuls for the model's linear layers with torchao.float8 (a trident section; needs the
    `fp8` extra). Weights, gradients and optimizer states keep their dtypes; each converted layer
    casts its input, weight and output gradient to float8 with dynamic scales for its three GEMMs."""

    enabled: bool = Field(False, description="Convert the model's linear layers to torchao's Float8Linear.")
    recipe: Literal["tensorwise", "rowwise"] = Field("tensorwise", description=(
        "torchao's scaling recipe: one scale per tensor (fastest) or one per row (more accurate; "
        "torchao runs it best with bf16 compute)."))
    filter: FP8FilterConfig = Field(default_factory=FP8FilterConfig, description=(
        "Module-name regexes: the linear layers to convert and those to keep in the compute dtype."))
    emulate: bool = Field(False, description=(
        "torchao's emulation: float8 rounding and scales computed with ordinary matmuls, so FP8 runs on CPU or "
        "a GPU without FP8 units (compute capability < 8.9). For tests; no speed-up."))
    all_gather: bool = Field(False, description=(
        "Under ZeRO stage 3, all-gather each converted layer's weight shards as float8 bytes (scaled by the "
        "whole weight's amax, as torchao casts it) instead of the compute dtype: half the bytes of bf16, a "
        "quarter of fp32. Tensorwise recipe only."))

    @model_validator(mode="after")
    def _all_gather_needs_tensorwise(self) -> FP8Config:
        if self.all_gather and self.recipe != "tensorwise":
            raise ConfigError([ConfigIssue("fp8.all_gather", (
                f"true with fp8.recipe {self.recipe!r}; the float8 all-gather casts each weight with one scale "
                "(torchao's tensorwise recipe), a rowwise weight is cast per row inside each matmul: set "
                "fp8.recipe to \"tensorwise\" or fp8.all_gather to false"))])
        return self


# -- optimizer and scheduler (their params are checked by trident.optim) ------------------------

class OptimizerConfig(Section):
    """The optimizer built when `trident.initialize` gets no `optimizer=`."""

    type: str = Field(json_schema_extra={"expects": "an optimizer name: Adam, AdamW, SGD, Adagrad, Lion, Lamb, "
                                                    "OneBitAdam, ZeroOneAdam, OneBitLamb or Muon"},
                      description=("Optimizer name, case-insensitive: Adam, AdamW, SGD, Adagrad, Lion, Lamb, or the "
                                   "1-bit OneBitAdam, ZeroOneAdam, OneBitLamb (ZeRO stage 0 only), or Muon (AdamW for non-matrices)."))
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


# -- compilation ---------------------------------------------------------------------------------

COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
COMPILE_KWARGS = ("fullgraph", "dynamic", "mode", "options")


class CompileConfig(Section):
    """`compile`: each transformer block (decoder layer, pipeline layer) compiled with
    `torch.compile` after parallelization (DeepSpeed's section; its DeepCompile keys are handled
    in trident.deepspeed.config.rules)."""

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


# -- FLOPs profiler --------------------------------------------------------------------------------

class FlopsProfilerConfig(Section):
    """`flops_profiler`: one step's FLOPs, parameters and forward latency per module, with the
    step's TFLOP/s and MFU (DeepSpeed's section and defaults; trident.monitor.flops_profiler)."""

    enabled: bool = Field(False, description="Profile step `profile_step` and print the report.")
    recompute_fwd_factor: float = Field(0.0, ge=0, allow_inf_nan=False, description=(
        "Share of the forward recomputed in backward (activation checkpointing: 1.0 = all of it). "
        "trident measures recomputation that runs inside modules; this factor is used where none was seen."))
    profile_step: int = Field(1, ge=0, description=(
        "The optimizer step profiled, counted as DeepSpeed's global_steps (0 = the first step; "
        "1 leaves one warm-up step)."))
    module_depth: int = Field(-1, ge=-1, description="Deepest module level listed; -1 lists every level.")
    top_modules: int = Field(1, gt=0, description="Module types listed per depth in the aggregated profile.")
    detailed: bool = Field(True, description="List every module down to module_depth, not only the aggregate.")
    output_file: str | None = Field(None, description=(
        "Write the report to this file (rank 0) instead of printing it; null prints to stdout."))
