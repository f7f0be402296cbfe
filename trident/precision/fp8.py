"""`fp8`: the model's linear layers run their matmuls in float8 with torchao.float8.

torchao's `Float8Linear` keeps the weight (and so the master weights, gradients and optimizer
states) in its dtype and casts the input, the weight and the output gradient to float8 with
dynamic scales inside each of its three GEMMs. Conversion replaces `nn.Linear` modules in place,
keeping each weight `Parameter` (ties survive), so it runs before anything records parameters:
after tensor parallelism and LoRA, before activation checkpointing, the dtype cast, data
parallelism and compile (trident.engine.build's fixed order).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import torch
from torch import nn

from trident.config.errors import ConfigError, ConfigIssue
from trident.config.run_sections import FP8Config

FP8_MIN_CAPABILITY = (8, 9)
"""CUDA compute capability of the first GPUs with FP8 tensor cores (Ada, then Hopper's 9.0)."""

GEMM_MULTIPLE = 16
"""torch._scaled_mm needs both dimensions of a float8 weight to be multiples of 16."""


@dataclasses.dataclass(frozen=True)
class FP8Report:
    """What a conversion did: the layers now in float8, and the linear layers kept with why."""

    recipe: str
    emulate: bool
    converted: list[str]
    kept: dict[str, str]  # module name -> reason

    def describe(self) -> str:
        """One start-up line: which modules run in FP8 (numbered blocks folded into `*`)."""
        mode = ", emulated" if self.emulate else ""
        text = (f"fp8 ({self.recipe}{mode}): {len(self.converted)} linear layers run their matmuls in float8: "
                f"{_fold(self.converted) or 'none'}")
        if self.kept:
            by_reason: dict[str, list[str]] = {}
            for name, reason in self.kept.items():
                by_reason.setdefault(reason, []).append(name)
            text += "; kept in the compute dtype: " + "; ".join(
                f"{_fold(names)} ({reason})" for reason, names in by_reason.items())
        return text


def check_fp8_hardware(cfg: FP8Config, device: torch.device) -> None:
    """Refuse FP8 where no FP8 matmul units exist, unless `fp8.emulate` asks for torchao's emulation."""
    if cfg.emulate:
        return
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= FP8_MIN_CAPABILITY:
            return
        where = (f"this GPU ({torch.cuda.get_device_name(device)}, compute capability "
                 f"{capability[0]}.{capability[1]}) has no FP8 tensor cores (they need 8.9 or newer: Ada, Hopper, "
                 "Blackwell)")
    else:
        where = f"the run computes on {device.type}, which has no FP8 matmul units (they need a GPU of compute " \
                "capability 8.9 or newer)"
    raise ConfigError([ConfigIssue("fp8.enabled", (
        f"true, but {where}; set fp8.enabled to false, or fp8.emulate to true for torchao's emulation "
        "(float8 rounding with ordinary matmuls: for tests, no speed-up)"))])


def module_filter(cfg: FP8Config, kept: dict[str, str] | None = None) -> Callable[[nn.Module, str], bool]:
    """torchao's `module_filter_fn` for the config's `filter`; records each refused linear layer
    and why in `kept`."""
    convert = [re.compile(p) for p in cfg.filter.convert]
    skip = [re.compile(p) for p in cfg.filter.skip]
    kept = {} if kept is None else kept

    converted_already = float8_linear_class()

    def accept(module: nn.Module, name: str) -> bool:
        if not isinstance(module, nn.Linear):
            return True  # torchao asks about every module; only linear layers are converted
        if isinstance(module, converted_already):
            return False  # trident's Float8Conv1D (trident.precision.fp8_conv1d): converted already
        reason = keep_reason(cfg, name, module.weight.shape, convert, skip)
        if reason is not None:
            kept[name] = reason
        return reason is None

    return accept


def keep_reason(cfg: FP8Config, name: str, weight_shape, convert=None, skip=None) -> str | None:
    """Why the linear layer `name` (of this rank's weight shape) stays in the compute dtype, or None."""
    convert = [re.compile(p) for p in cfg.filter.convert] if convert is None else convert
    skip = [re.compile(p) for p in cfg.filter.skip] if skip is None else skip
    if convert and not any(p.search(name) for p in convert):
        return "not matched by fp8.filter.convert"
    if any(p.search(name) for p in skip):
        return "fp8.filter.skip"
    if not cfg.emulate and any(d % GEMM_MULTIPLE for d in weight_shape):
        return f"dimensions not multiples of {GEMM_MULTIPLE}"
    return None


def float8_config(cfg: FP8Config):
    """torchao's `Float8LinearConfig` for the section's recipe and emulation."""
    float8 = _torchao_float8()
    base = float8.Float8LinearConfig.from_recipe_name(cfg.recipe)
    return dataclasses.replace(base, emulate=cfg.emulate)


def apply_fp8(model: nn.Module, cfg: FP8Config, device: torch.device, allow_none: bool = False) -> FP8Report:
    """Convert `model`'s linear layers in place (the section's filter decides which). Converting
    none is an error unless `allow_none` (the caller keeps other layers out for a reason it reports)."""
    check_fp8_hardware(cfg, device)
    float8 = _torchao_float8()
    kept: dict[str, str] = {}
    float8.convert_to_float8_training(model, module_filter_fn=module_filter(cfg, kept), config=float8_config(cfg))
    converted = [name for name, m in model.named_modules() if isinstance(m, float8_linear_class())]
    if not converted and not allow_none:
        raise ConfigError([ConfigIssue("fp8.filter", (
            "fp8.enabled is true but no linear layer was converted (the model has none, or the filter keeps them "
            f"all: {_fold(list(kept)) or 'no nn.Linear found'}); loosen fp8.filter or set fp8.enabled to false"))])
    return FP8Report(cfg.recipe, cfg.emulate, converted, kept)


def _torchao_float8():
    try:
        import torchao.float8 as float8
    except ImportError as err:
        raise ImportError("fp8.enabled needs torchao (torchao.float8); install trident's fp8 extra: "
                          "pip install 'trident[fp8]'") from err
    return float8


def float8_linear_class() -> type:
    """torchao's Float8Linear (the class conversion swaps in)."""
    _torchao_float8()
    from torchao.float8.float8_linear import Float8Linear
    return Float8Linear


def _fold(names: list[str]) -> str:
    """`blocks.0.mlp.fc, blocks.1.mlp.fc` -> `blocks.*.mlp.fc (x2)`, first-seen order."""
    groups: dict[str, int] = {}
    for name in names:
        key = re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.)", "*", name)
        groups[key] = groups.get(key, 0) + 1
    return ", ".join(k if n == 1 else f"{k} (x{n})" for k, n in groups.items())


def unconverted_matmuls(model: nn.Module, seen: set[str]) -> dict[str, str]:
    """Modules outside `seen` (converted or already reported) that multiply by a weight matrix
    but are not `nn.Linear`, so torchao leaves them in the compute dtype: `transformers`' Conv1D
    (GPT-2's transposed linear layers), experts stacked in 3-D tensors (MoE layers),
    convolutions. Named in the start-up report, so a run says what stays in 16 bits."""
    out = {}
    for name, m in model.named_modules():
        if name in seen or isinstance(m, (nn.Linear, nn.Embedding)) or "Embedding" in type(m).__name__:
            continue
        if any(len(getattr(p, "_trident_shape", p.shape)) >= 2 for p in m.parameters(recurse=False)):
            out[name] = f"{type(m).__name__}, not an nn.Linear: torchao.float8 converts nn.Linear layers only"
    return out
