"""FP8 GEMMs for trident's tp-split linear layers, with the scales one process would choose.

torchao's `Float8Linear` scales each operand by its own amax. A tp rank holds only a slice of
the weight (and, in a row-parallel layer, of the input; in a column-parallel layer, of the
output gradient), so its local amax would give other scales than the whole matrix does. Here
each split operand's amax is reduced (max) over the tp group before its scale is taken --
torchao's own `reduce_amax` path, pointed at trident's group -- so every rank casts with the
single-process scale. Tensorwise recipe only: a rowwise scale of a split reduction dimension
needs the same per row, not written yet.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist


@dataclasses.dataclass(frozen=True)
class _GroupMesh:
    """What torchao's amax reduction asks of a device mesh: its process group."""

    group: dist.ProcessGroup

    def get_group(self) -> dist.ProcessGroup:
        return self.group


@dataclasses.dataclass(frozen=True)
class TPFloat8:
    """A tp layer's FP8 settings: torchao's config and GEMM configs, and which operands are split
    over tp (their amax is reduced over `mesh`)."""

    config: object            # torchao Float8LinearConfig
    mm_config: object         # torchao LinearMMConfig
    mesh: _GroupMesh
    input_split: bool
    grad_output_split: bool


def tp_float8(config, group: dist.ProcessGroup, *, input_split: bool, grad_output_split: bool) -> TPFloat8:
    """Settings for one tp layer under torchao `config` (tensorwise; emulate as configured)."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    g = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    mm = LinearMMConfig(*(ScaledMMConfig(config.emulate, c.use_fast_accum, False, config.pad_inner_dim) for c in g))
    return TPFloat8(config, mm, _GroupMesh(group), input_split, grad_output_split)


def _cast(t: torch.Tensor, dtype: torch.dtype, fp8: TPFloat8, role, reduce: bool):
    from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
    return hp_tensor_to_float8_dynamic(t, dtype, fp8.mm_config, reduce_amax=reduce, gemm_input_role=role,
                                       device_mesh=fp8.mesh if reduce else None,
                                       round_scales_to_power_of_2=fp8.config.round_scales_to_power_of_2)


class _TPFloat8Matmul(torch.autograd.Function):
    """y = x w^T with its three GEMMs in float8; split operands scaled by their tp-wide amax."""

    @staticmethod
    def forward(ctx, x, weight, fp8: TPFloat8):
        from torchao.float8.float8_training_tensor import GemmInputRole
        ctx.save_for_backward(x, weight)
        ctx.fp8 = fp8
        c = fp8.config
        x_8 = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input.target_dtype, fp8, GemmInputRole.INPUT,
                    fp8.input_split)
        w_8 = _cast(weight.t(), c.cast_config_weight.target_dtype, fp8, GemmInputRole.WEIGHT, True)
        return torch.mm(x_8, w_8).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.float8.float8_training_tensor import GemmInputRole
        x, weight = ctx.saved_tensors
        fp8, c = ctx.fp8, ctx.fp8.config
        go = grad_output.reshape(-1, grad_output.shape[-1])
        go_8 = _cast(go, c.cast_config_grad_output.target_dtype, fp8, GemmInputRole.GRAD_OUTPUT,
                     fp8.grad_output_split)
        w_8 = _cast(weight.t(), c.cast_config_weight_for_grad_input.target_dtype, fp8, GemmInputRole.WEIGHT, True)
        grad_x = torch.mm(go_8, w_8.t()).reshape(*x.shape)
        x_8 = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight.target_dtype, fp8,
                    GemmInputRole.INPUT, fp8.input_split)
        go_8w = _cast(go, c.cast_config_grad_output_for_grad_weight.target_dtype, fp8, GemmInputRole.GRAD_OUTPUT,
                      fp8.grad_output_split)
        grad_w = torch.mm(go_8w.t(), x_8)
        return grad_x, grad_w, None


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: TPFloat8) -> torch.Tensor:
    """F.linear(x, weight, bias) with the GEMMs in float8 (bias added in the compute dtype)."""
    y = _TPFloat8Matmul.apply(x, weight, fp8)
    return y + bias if bias is not None else y
