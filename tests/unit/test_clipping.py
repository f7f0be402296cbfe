"""The norm kernel every strategy uses: exact sums of squares, and the clip rule."""

from __future__ import annotations

import math

import pytest
import torch

from trident.optim.clipping import NORM_CHUNK, clip_coefficient, global_norm, sum_of_squares


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_sum_of_squares_is_exact_in_float64_for_a_demo_sized_gradient(dtype):
    g = torch.Generator().manual_seed(0)
    big = (torch.randn(4_240_000, generator=g) * torch.rand(4_240_000, generator=g) ** 4).to(dtype)
    exact = float(big.double().square().sum())
    assert float(sum_of_squares([big])) == pytest.approx(exact, rel=1e-12)
    # what this replaces: torch's fp32 vector_norm on CPU drifts by ~1e-4 at this size
    assert abs(float(torch.linalg.vector_norm(big.float())) ** 2 - exact) / exact > 1e-6


def test_pieces_sum_to_the_whole_whatever_the_cut():
    g = torch.Generator().manual_seed(1)
    whole = torch.randn(3 * NORM_CHUNK + 17, generator=g)
    pieces = list(whole.split([5, NORM_CHUNK - 1, 2 * NORM_CHUNK, 13]))
    assert float(sum_of_squares(pieces)) == pytest.approx(float(sum_of_squares([whole])), rel=1e-14)
    assert float(sum_of_squares([])) == 0.0


def test_global_norm_without_groups_and_non_finite():
    assert global_norm([([torch.full((3,), 2.0)], ()), ([torch.full((4, 4), 1.0)], ())]) == pytest.approx(math.sqrt(28))
    assert not math.isfinite(global_norm([([torch.tensor([1.0, float("inf")])], ())]))
    assert math.isnan(global_norm([([torch.tensor([float("nan")])], ())]))


def test_clip_coefficient_follows_torch_and_deepspeed():
    assert clip_coefficient(4.0, 0.0) == 1.0          # clipping off
    assert clip_coefficient(0.5, 1.0) == 1.0          # below the threshold
    assert clip_coefficient(4.0, 1.0) == pytest.approx(1.0 / (4.0 + 1e-6), rel=1e-15)
    p = torch.nn.Parameter(torch.ones(16))
    p.grad = torch.full((16,), 1.0)                   # norm 4
    torch.nn.utils.clip_grad_norm_([p], 1.0)
    assert float(p.grad[0]) == pytest.approx(clip_coefficient(4.0, 1.0), rel=1e-7)
