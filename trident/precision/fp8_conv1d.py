"""`fp8` for `transformers`' Conv1D: GPT-2's linear layers, which torchao does not convert.

Conv1D computes y = x W + b with W stored in x out, which is exactly the transposed weight
torchao's float8 matmul (`matmul_with_hp_or_float8_args`) takes from a linear layer
(`weight.t()`). `Float8Conv1D` is torchao's `Float8Linear` holding Conv1D's own parameters
as they are (same objects, names and layout: checkpoints and `save_pretrained` see no change)
and passing W straight in, so its three GEMMs cast and scale as a converted `nn.Linear` with
weight W^T would: the same numbers.
"""

from __future__ import annotations

import torch
from torch import nn

from trident.config.run_sections import FP8Config
from trident.precision.fp8 import float8_config, float8_linear_class, keep_reason


def is_conv1d(module: nn.Module) -> bool:
    """`transformers.pytorch_utils.Conv1D` (checked by name and attributes: transformers is optional)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx")


def _float8_conv1d_class() -> type:
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    class Float8Conv1D(float8_linear_class()):
        """torchao's Float8Linear over a Conv1D's (in x out) weight; see the module docstring."""

        @classmethod
        def from_conv1d(cls, conv: nn.Module, config) -> "Float8Conv1D":
            with torch.device("meta"):
                new = cls(conv.nx, conv.nf, bias=False, config=config)
            new.weight, new.bias, new.nf = conv.weight, conv.bias, conv.nf
            return new

        def forward(self, input: torch.Tensor) -> torch.Tensor:
            if torch.is_autocast_enabled():
                input = input.to(torch.get_autocast_gpu_dtype())
            output = matmul_with_hp_or_float8_args.apply(input, self.weight, self.linear_mm_config, self.config)
            return output if self.bias is None else output + self.bias.to(output.dtype)

    return Float8Conv1D


def convert_conv1d(model: nn.Module, cfg: FP8Config) -> tuple[list[str], dict[str, str]]:
    """Replace the model's Conv1D layers the section's filter accepts by `Float8Conv1D`.
    Returns (converted names, {kept name: why})."""
    targets = [(name, m) for name, m in model.named_modules() if is_conv1d(m)]
    if not targets:
        return [], {}
    cls, config = _float8_conv1d_class(), float8_config(cfg)
    converted, kept = [], {}
    for name, conv in targets:
        reason = keep_reason(cfg, name, tuple(conv.weight.shape))
        if reason is not None:
            kept[name] = reason
            continue
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, cls.from_conv1d(conv, config))
        converted.append(name)
    return converted, kept


__all__ = ["convert_conv1d", "is_conv1d"]
