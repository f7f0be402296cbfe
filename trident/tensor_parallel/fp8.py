"""FP8 GEMMs for trident's tp-split linear layers, with the scales one process would choose.

torchao's `Float8Linear` scales each operand by its own amax. A tp rank holds only a slice of
the weight (and, in a row-parallel layer, of the input; in a column-parallel layer, of the
output gradient), so its local amax would give other scales than the whole matrix does. Here
each split operand's amax is reduced (max) over the tp group before its scale is taken, so every
rank casts with the single-process scale. Tensorwise and rowwise: a rowwise scale (one per row,
its amax taken along one dimension) is reduced over tp only where that dimension is the split one.

The reduction goes through trident.comm (the layer's comms logger and the hang detector's flight
recorder see it, as they see the tp mappings), except while torch.compile traces the layer: there
it is torch's functional all-reduce, which dynamo captures in the graph (torchao's own
`reduce_amax` path), where trident's collective would be a graph break inside the autograd
Function and leave the casts uncompiled. The casts themselves are torchao's.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from trident.comm import collectives


@dataclasses.dataclass(frozen=True)
class TPFloat8:
    """A tp layer's FP8 settings: torchao's config and GEMM configs, and which operands are split
    over tp (their amax is reduced over `tp`, the layer's TPHandle: its group and comms logger)."""

    config: object            # torchao Float8LinearConfig
    mm_config: object         # torchao LinearMMConfig
    tp: object                # trident.tensor_parallel.layers.TPHandle
    input_split: bool
    grad_output_split: bool


def tp_float8(config, tp, *, input_split: bool, grad_output_split: bool) -> TPFloat8:
    """Settings for one tp layer (`tp`: its TPHandle) under torchao `config` (emulate as configured)."""
    from torchao.float8.float8_training_tensor import LinearMMConfig, ScaledMMConfig
    g = (config.gemm_config_output, config.gemm_config_grad_input, config.gemm_config_grad_weight)
    mm = LinearMMConfig(*(ScaledMMConfig(config.emulate, c.use_fast_accum, False, config.pad_inner_dim) for c in g))
    return TPFloat8(config, mm, tp, input_split, grad_output_split)


def _cast(t: torch.Tensor, cast_config, fp8: TPFloat8, role, axis: int, split_dim: int | None):
    """`t` (2-D) in float8 as torchao's `cast_config` says: one scale (tensorwise), or one per
    slice along `axis` (rowwise: the amax is taken over dimension `axis`). The amax is reduced over
    tp when the dimensions it covers include `split_dim`, the one split over tp (None: none is)."""
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_training_tensor import hp_tensor_and_scale_to_float8
    from torchao.float8.float8_utils import amax_to_scale, tensor_to_amax
    tensorwise = cast_config.scaling_granularity is ScalingGranularity.TENSORWISE
    axiswise_dim = None if tensorwise else axis
    amax = tensor_to_amax(t, scaling_granularity=cast_config.scaling_granularity, axiswise_dim=axiswise_dim)
    if split_dim is not None and (tensorwise or axis % 2 == split_dim % 2):
        amax = _max_over_tp(amax, fp8.tp)
    scale = amax_to_scale(amax, cast_config.target_dtype, fp8.config.round_scales_to_power_of_2)
    return hp_tensor_and_scale_to_float8(t, scale, cast_config.target_dtype, fp8.mm_config, role, axiswise_dim)


def _max_over_tp(amax: torch.Tensor, tp) -> torch.Tensor:
    """The elementwise max of every tp rank's `amax` (see the module docstring for the two paths)."""
    if torch.compiler.is_compiling():
        from torch.distributed import _functional_collectives as funcol
        out = funcol.all_reduce(amax, "MAX", tp.group)
        return out.wait() if isinstance(out, funcol.AsyncCollectiveTensor) else out
    out = amax.contiguous().clone()
    collectives.all_reduce(out, dist.ReduceOp.MAX, group=tp.group, logger=tp.logger)
    return out


class _TPFloat8Matmul(torch.autograd.Function):
    """y = x w^T with its three GEMMs in float8; split operands scaled by their tp-wide amax.

    Shapes: x [T, K], w^T [K, N], grad_output [T, N]. A row-parallel layer splits K (x's and
    w^T's), a column-parallel one N (w^T's and grad_output's); T is never split here (sequence
    parallelism gathers tokens before the GEMM and after it in backward)."""

    @staticmethod
    def forward(ctx, x, weight, fp8: TPFloat8):
        from torchao.float8.float8_training_tensor import GemmInputRole as R
        ctx.save_for_backward(x, weight)
        ctx.fp8 = fp8
        c, k, n = fp8.config, _k_split(fp8), _n_split(fp8)
        x_8 = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input, fp8, R.INPUT, -1, -1 if k else None)
        w_8 = _cast(weight.t(), c.cast_config_weight, fp8, R.WEIGHT, 0, 0 if k else (1 if n else None))
        return torch.mm(x_8, w_8).reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad_output):
        from torchao.float8.float8_training_tensor import GemmInputRole as R
        x, weight = ctx.saved_tensors
        fp8 = ctx.fp8
        c, k, n = fp8.config, _k_split(fp8), _n_split(fp8)
        w_split = 0 if k else (1 if n else None)
        go = grad_output.reshape(-1, grad_output.shape[-1])
        go_8 = _cast(go, c.cast_config_grad_output, fp8, R.GRAD_OUTPUT, -1, -1 if n else None)
        w_8 = _cast(weight.t(), c.cast_config_weight_for_grad_input, fp8, R.WEIGHT, -1, w_split)
        grad_x = torch.mm(go_8, w_8.t()).reshape(*x.shape)
        x_8 = _cast(x.reshape(-1, x.shape[-1]), c.cast_config_input_for_grad_weight, fp8, R.INPUT, 0, -1 if k else None)
        go_8w = _cast(go, c.cast_config_grad_output_for_grad_weight, fp8, R.GRAD_OUTPUT, 0, -1 if n else None)
        grad_w = torch.mm(go_8w.t(), x_8)
        return grad_x, grad_w, None


def _k_split(fp8: TPFloat8) -> bool:
    return fp8.input_split  # row-parallel: the reduction dimension is split


def _n_split(fp8: TPFloat8) -> bool:
    return fp8.grad_output_split  # column-parallel: the output features are split


def float8_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8: TPFloat8) -> torch.Tensor:
    """F.linear(x, weight, bias) with the GEMMs in float8 (bias added in the compute dtype)."""
    y = _TPFloat8Matmul.apply(x, weight, fp8)
    return y + bias if bias is not None else y
