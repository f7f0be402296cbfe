"""The norm kernel every strategy uses: near-exact sums of squares in a few operators, and the clip rule."""

from __future__ import annotations

import math

import pytest
import torch

from trident.monitor.step_cost import StepCost
from trident.optim.clipping import ROW, clip_coefficient, contiguous_runs, global_norm, sum_of_squares


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_is_near_exact_for_a_demo_sized_gradient(dtype):
    """fp32 rows of 1024 carry a tiny downward bias on CPU (~4e-8); the fp32 norm drifts 1e-4."""
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(4_240_000, generator=g) * torch.rand(4_240_000, generator=g) ** 4).to(dtype)
    exact = float(big.double().square().sum())
    assert float(sum_of_squares([big])) == pytest.approx(exact, rel=1e-7)
    # what this replaces: torch's fp32 vector_norm on CPU drifts by ~1e-4 at this size
    assert abs(float(torch.linalg.vector_norm(big.float())) ** 2 - exact) / exact > 1e-6


def test_pieces_sum_to_the_whole_whatever_the_cut():
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(300 * ROW + 17, generator=g)
    cuts = [5, ROW - 1, 200 * ROW, 99 * ROW + 13]
    pieces = [p.clone() for p in whole.split(cuts)]   # separate storages: read one by one
    exact = float(whole.double().square().sum())
    # what matters for parity: two layouts of one gradient agree far below the fp32 rounding
    assert float(sum_of_squares(pieces)) == pytest.approx(float(sum_of_squares([whole])), rel=1e-8)
    assert float(sum_of_squares([whole])) == pytest.approx(exact, rel=1e-7)
    assert float(sum_of_squares([])) == 0.0


def test_views_of_one_buffer_are_read_as_one_run():
    flat = torch.randn(10 * ROW + 3)
    views = list(flat.split([ROW + 1, 3 * ROW, 6 * ROW + 2]))
    runs = contiguous_runs([v.view(-1, 1) if v.numel() % 2 else v for v in views])
    assert len(runs) == 1 and runs[0].data_ptr() == flat.data_ptr() and runs[0].numel() == flat.numel()
    # a gap (another rank's shard between) starts a new run; reordered views too
    assert len(contiguous_runs([views[0], views[2]])) == 2
    assert len(contiguous_runs([views[1], views[0]])) == 2


def test_operator_count_does_not_grow_with_elements():
    def count(n):
        tensors = [torch.randn(n), torch.randn(n // 3), torch.randn(7)]
        with StepCost() as cost:
            sum_of_squares(tensors)
        return cost.ops
    assert count(4 * ROW) == count(4000 * ROW)


def test_global_norm_without_groups_and_non_finite():
    assert global_norm([([torch.full((3,), 2.0)], ()), ([torch.full((4, 4), 1.0)], ())]) == pytest.approx(math.sqrt(28))
    assert not math.isfinite(global_norm([([torch.tensor([1.0, float("inf")])], ())]))
    assert math.isnan(global_norm([([torch.tensor([float("nan")])], ())]))
    with StepCost() as cost:
        global_norm([([torch.randn(5000)], ()), ([torch.randn(3, 7)], ())])
    assert cost.host_syncs == 1


def test_clip_coefficient_follows_torch_and_deepspeed():
    assert clip_coefficient(4.0, 0.0) == 1.0          # clipping off
    assert clip_coefficient(0.5, 1.0) == 1.0          # below the threshold
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-15)
    p = torch.nn.Parameter(torch.ones(16))
    p.grad = torch.full((16,), 1.0)                   # norm 4
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert float(p.grad[0]) == pytest.approx(clip_coefficient(4.0, 1.0), rel=1e-7)
