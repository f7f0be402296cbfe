"""trident's tp-split layers with FP8 GEMMs (`trident.tensor_parallel.fp8`) against torchao's
Float8Linear on the whole weight in one process: output, input gradient and weight gradient."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from torchao.float8 import convert_to_float8_training  # the dev extra has torchao: missing, it fails

from trident.config import load_config
from trident.precision.fp8 import float8_config
from trident.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from trident.tensor_parallel.layers import ReplicatedHeadsLinear
from trident.tensor_parallel.fp8_convert import REPLICATED_HEADS, convert_tp_layers
from trident.testing.distributed import cached_mesh, run_on_ranks


def layer_grads(recipe: str, row: bool, tiny: bool = False):
    """|tp - torchao| for the output, input gradient and weight gradient: the largest absolute
    difference, or with `tiny` (operands spanning 5.5 decades along the split dimension) the
    largest elementwise relative one."""
    mesh = cached_mesh(tp=2)
    cfg = load_config({"fp8": {"enabled": True, "recipe": recipe, "emulate": True}}).fp8
    torch.manual_seed(0)
    full = nn.Linear(32, 48, bias=False)
    if tiny:
        x = torch.randn(2, 8, 32) * torch.logspace(-5, 0.5, 32)
        go = torch.randn(2, 8, 48) * torch.logspace(0.5, -5, 48)
    else:  # amaxes that differ between the halves
        x = torch.randn(2, 8, 32) * torch.linspace(0.1, 3.0, 32)
        go = torch.randn(2, 8, 48) * torch.linspace(3.0, 0.1, 48)
    ref = convert_to_float8_training(nn.Sequential(copy.deepcopy(full)), config=float8_config(cfg))
    xr = x.clone().requires_grad_()
    yr = ref(xr)
    yr.backward(go)
    cls = RowParallelLinear if row else ColumnParallelLinear
    layer = nn.Sequential(cls.from_linear(full, mesh) if row else cls.from_linear(full, mesh, gather_output=True))
    convert_tp_layers(layer, cfg)
    xt = x.clone().requires_grad_()
    y = layer(xt)
    y.backward(go)
    shard = slice(mesh.tp_rank * 16, (mesh.tp_rank + 1) * 16) if row else slice(mesh.tp_rank * 24,
                                                                                  (mesh.tp_rank + 1) * 24)
    ref_w = ref[0].weight.grad[:, shard] if row else ref[0].weight.grad[shard]
    return [_diff(y, yr, tiny), _diff(xt.grad, xr.grad, tiny), _diff(layer[0].weight.grad, ref_w, tiny)]


def _diff(a: torch.Tensor, b: torch.Tensor, relative: bool) -> float:
    d = (a - b).abs()
    return (d / b.abs().clamp(min=1e-30) if relative else d).max().item()


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
@pytest.mark.parametrize("row", [False, True])
def test_tp_layer_matches_float8_linear(recipe, row):
    """Measured: within 7.2e-7. With each rank's local amax, tensorwise would be up to 1.4 off;
    rowwise scales are powers of 2, so a local scale mostly casts alike (also within 1e-6)."""
    for diffs in run_on_ranks(2, layer_grads, recipe, row):
        assert max(diffs) < 1e-5, diffs


@pytest.mark.parametrize("row", [False, True])
def test_tp_layer_rowwise_scales_are_tp_wide(row):
    """Rowwise scales are powers of 2, and scaling by a power of 2 changes how a value rounds to
    e4m3 only in e4m3's subnormal range (|scaled value| < 2^-6): a rank's local amax (a larger scale)
    casts alike unless a row spans more than ~4.5 decades. Operands spanning 5.5 along the split
    dimension show it. Measured elementwise relative differences: with the tp-wide amax <= 2.9e-5
    (summation order where outputs cancel); with each rank's local amax 2.3e-3 (row-parallel output)
    and 2.8e-2 (column-parallel input gradient)."""
    for diffs in run_on_ranks(2, layer_grads, "rowwise", row, True):
        assert max(diffs) < 1e-4, diffs


def logged_all_reduces(fp8: bool) -> int:
    """all_reduce calls the comms logger counts for one forward and backward of a column-parallel
    layer (tensorwise), with or without FP8."""
    from trident.comm.logger import CommsLogger
    mesh = cached_mesh(tp=2)
    logger = CommsLogger(enabled=True)
    torch.manual_seed(0)
    layer = nn.Sequential(ColumnParallelLinear.from_linear(nn.Linear(32, 48, bias=False), mesh, gather_output=True,
                                                           logger=logger))
    if fp8:
        convert_tp_layers(layer, load_config({"fp8": {"enabled": True, "emulate": True}}).fp8)
    layer(torch.randn(2, 8, 32, requires_grad=True)).sum().backward()
    return logger.totals()["all_reduce"].calls


def test_tp_amax_reductions_go_through_trident_comm():
    """A column-parallel layer splits the weight and the output gradient: the weight's amax is
    reduced for the forward and the input-gradient GEMMs, the output gradient's for the input- and
    weight-gradient GEMMs -- four all-reduces the comms logger (and the hang detector) see, beside
    the input gradient's one."""
    for plain, fp8 in zip(run_on_ranks(2, logged_all_reduces, False), run_on_ranks(2, logged_all_reduces, True)):
        assert (plain, fp8) == (1, 5)


def convert_with_replicated_heads():
    mesh = cached_mesh(tp=2)
    model = nn.ModuleDict({"q": ColumnParallelLinear.from_linear(nn.Linear(32, 32, bias=False), mesh),
                           "k": ReplicatedHeadsLinear.from_linear(nn.Linear(32, 16, bias=False), mesh, head_dim=16)})
    converted, kept = convert_tp_layers(model, load_config({"fp8": {"enabled": True, "emulate": True}}).fp8)
    return converted, kept, model["k"].fp8


def test_replicated_kv_heads_stay_in_the_compute_dtype_and_are_reported():
    """A kv head shared by several tp ranks gets from each only its query heads' share of the output
    gradient: one process casts the summed gradient, which these ranks never hold before the GEMMs."""
    for converted, kept, fp8 in run_on_ranks(2, convert_with_replicated_heads):
        assert converted == ["q"] and fp8 is None
        assert kept == {"k": REPLICATED_HEADS}
