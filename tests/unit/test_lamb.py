"""`Lamb` (DeepSpeed's FusedLamb semantics) against the LAMB paper's formulas, on one process."""

from __future__ import annotations

import pytest
import torch

from trident.config.schema import OptimizerConfig
from trident.optim.factory import build_optimizer, check_optimizer
from trident.optim.lamb import Lamb

BETAS = (0.9, 0.999)
EPS = 1e-8


def paper_lamb(params: list[torch.Tensor], grads: list[list[torch.Tensor]], lr: float, wd: float,
               min_coeff: float, max_coeff: float) -> tuple[list[torch.Tensor], list[list[float]]]:
    """You et al. 2020, Algorithm 2 (LAMB), without bias correction, with the trust ratio
    phi(||x||) / ||r + wd x|| taken as clamp(||x|| / ||r + wd x||, min_coeff, max_coeff):
        m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2;  r = m / (sqrt(v) + eps)
        x = x - lr * ratio * (r + wd x)"""
    xs = [p.detach().clone().double() for p in params]
    ms = [torch.zeros_like(x) for x in xs]
    vs = [torch.zeros_like(x) for x in xs]
    ratios = []
    for step_grads in grads:
        step_ratios = []
        for x, m, v, g in zip(xs, ms, vs, step_grads):
            g = g.double()
            m.mul_(BETAS[0]).add_((1 - BETAS[0]) * g)
            v.mul_(BETAS[1]).add_((1 - BETAS[1]) * g * g)
            u = m / (v.sqrt() + EPS) + wd * x
            ratio = min(max((x.norm() / u.norm()).item(), min_coeff), max_coeff)
            x.sub_(lr * ratio * u)
            step_ratios.append(ratio)
        ratios.append(step_ratios)
    return xs, ratios


def make_case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    # a big-norm tensor (ratio clipped at max_coeff), a tiny one (clipped at min_coeff), a plain one
    params = [torch.randn(8, 4, generator=g) * 50, torch.randn(16, generator=g) * 1e-4, torch.randn(5, 3, generator=g)]
    grads = [[torch.randn(p.shape, generator=g) for p in params] for _ in range(6)]
    return params, grads


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_lamb_equals_the_paper_without_bias_correction(wd):
    params, grads = make_case()
    expected, expected_ratios = paper_lamb(params, grads, lr=0.01, wd=wd, min_coeff=0.5, max_coeff=3.0)
    ps = [torch.nn.Parameter(p.clone()) for p in params]
    opt = Lamb(ps, lr=0.01, bias_correction=False, weight_decay=wd, min_coeff=0.5, max_coeff=3.0)
    for step_grads, want in zip(grads, expected_ratios):
        for p, g in zip(ps, step_grads):
            p.grad = g.clone()
        opt.step()
        assert opt.get_lamb_coeffs() == pytest.approx(want, rel=1e-5)
    assert 3.0 in expected_ratios[0] and 0.5 in expected_ratios[0]  # both bounds were hit
    for p, x in zip(ps, expected):
        torch.testing.assert_close(p.detach().double(), x, rtol=1e-5, atol=1e-7)


def test_bias_correction_scales_the_step_as_deepspeeds_kernel():
    """FusedLamb folds the bias correction into the step size, lr * sqrt(1 - b2^t) / (1 - b1^t),
    and takes the trust ratio on the uncorrected moments."""
    params, grads = make_case(1)
    moved = []
    for bias_correction in (False, True):
        p = torch.nn.Parameter(params[2].clone())
        opt = Lamb([p], lr=0.01, bias_correction=bias_correction)
        p.grad = grads[0][2].clone()
        opt.step()
        moved.append(p.detach() - params[2])
    scale = (1 - BETAS[1]) ** 0.5 / (1 - BETAS[0])
    torch.testing.assert_close(moved[1], moved[0] * scale, rtol=1e-5, atol=1e-8)


def test_zero_norms_give_ratio_one_and_config_builds_lamb():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = build_optimizer(OptimizerConfig(type="lamb", params={"lr": 0.1, "max_coeff": 5.0}), [p])
    assert isinstance(opt, Lamb) and opt.param_groups[0]["max_coeff"] == 5.0
    p.grad = torch.ones(4)
    opt.step()
    assert opt.get_lamb_coeffs() == [1.0]


def test_bad_lamb_params_name_the_key():
    issues = check_optimizer("Lamb", {"min_coeff": 2.0, "max_coeff": 1.0})
    assert [i.path for i in issues] == ["optimizer.params.min_coeff"]
    assert "max_coeff" in issues[0].message
    assert check_optimizer("Lamb", {"amsgrad": True})[0].path == "optimizer.params.amsgrad"
