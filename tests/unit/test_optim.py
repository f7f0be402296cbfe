"""Optimizer factory: DeepSpeed's type names and Adam semantics, params, and Lion's update rule."""

import pytest
import torch

from trident.config import ConfigError, OptimizerConfig
from trident.optim import Lion, build_optimizer, check_optimizer, resolve_optimizer_config


def params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(3, 4, generator=g)), torch.nn.Parameter(torch.randn(4, generator=g))]


def build(type_: str, **kw) -> torch.optim.Optimizer:
    return build_optimizer(OptimizerConfig(type=type_, params=kw), params())


@pytest.mark.parametrize("type_,params_,cls", [
    ("Adam", {}, torch.optim.AdamW),                        # DeepSpeed: adam_w_mode defaults to true
    ("adam", {"adam_w_mode": False}, torch.optim.Adam),     # classic Adam, L2 in the gradient
    ("AdamW", {"adam_w_mode": False}, torch.optim.AdamW),   # AdamW is always decoupled
    ("ADAMW", {}, torch.optim.AdamW),
    ("sgd", {"lr": 0.1, "momentum": 0.9}, torch.optim.SGD),
    ("Adagrad", {}, torch.optim.Adagrad),
    ("lion", {}, Lion),
])
def test_type_names_are_case_insensitive_and_map_like_deepspeed(type_, params_, cls):
    assert type(build(type_, **params_)) is cls


def test_adam_type_decays_weights_decoupled():
    """One step of type "Adam" with weight decay equals torch's AdamW, not torch's Adam."""
    def step(make):
        ps = params()
        opt = make(ps)
        for p in ps:
            p.grad = torch.full_like(p, 0.5)
        opt.step()
        return torch.cat([p.detach().flatten() for p in ps])

    kw = dict(lr=0.1, weight_decay=0.5)
    ours = step(lambda ps: build_optimizer(OptimizerConfig(type="Adam", params=kw), ps))
    assert torch.equal(ours, step(lambda ps: torch.optim.AdamW(ps, **kw)))
    assert not torch.allclose(ours, step(lambda ps: torch.optim.Adam(ps, **kw)))


def test_weight_decay_defaults():
    assert build("AdamW").defaults["weight_decay"] == 0.0  # FusedAdam's default
    assert build("AdamW", torch_adam=True).defaults["weight_decay"] == 0.01  # torch.optim.AdamW's default
    assert build("Adam", torch_adam=True, adam_w_mode=False).defaults["weight_decay"] == 0.0
    resolved = resolve_optimizer_config(OptimizerConfig(type="adamw", params={"torch_adam": True}))
    assert resolved.type == "AdamW" and resolved.params["weight_decay"] == 0.01


def test_params_are_passed_with_deepspeed_names():
    opt = build("AdamW", lr=3e-4, betas=[0.8, 0.95], eps=1e-6, weight_decay=0.1, amsgrad=True)
    d = opt.defaults
    assert (d["lr"], d["betas"], d["eps"], d["weight_decay"], d["amsgrad"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1, True)
    sgd = build("SGD", lr=0.2, momentum=0.9, nesterov=True, weight_decay=0.01).defaults
    assert (sgd["lr"], sgd["momentum"], sgd["nesterov"], sgd["weight_decay"]) == (0.2, 0.9, True, 0.01)
    assert build("Adagrad", lr_decay=0.1).defaults["lr_decay"] == 0.1


def test_cpu_parameters_use_the_fused_cpu_kernels():
    """torch's fused CPU kernels: 5-7x its foreach path here (bench/cpu_optimizer.py)."""
    for name in ("AdamW", "Adam", "SGD", "Adagrad"):
        assert build(name).defaults["fused"] is True, name


def test_param_groups_are_accepted():
    a, b = params()
    opt = build_optimizer(OptimizerConfig(type="SGD", params={"lr": 0.1}),
                          [{"params": [a]}, {"params": iter([b]), "lr": 0.5}])
    assert [g["lr"] for g in opt.param_groups] == [0.1, 0.5]
    assert opt.param_groups[1]["params"] == [b]


def test_no_optimizer_section_explains_both_fixes():
    with pytest.raises(ConfigError, match="pass optimizer= to trident.initialize, or add an `optimizer` section"):
        build_optimizer(None, params())


def test_build_checks_the_params_too():
    with pytest.raises(ConfigError, match="optimizer.params.lr: expected a non-negative number, got -0.1"):
        build("SGD", lr=-0.1)


def test_check_optimizer_lists_every_problem():
    issues = check_optimizer("AdamW", {"lr": -1, "betas": [0.9], "epsilon": 1e-8})
    assert sorted(i.path for i in issues) == ["optimizer.params.betas", "optimizer.params.epsilon",
                                              "optimizer.params.lr"]
    assert check_optimizer("AdamW", {"lr": 1e-3}) == []
    [issue] = check_optimizer("Adamm", {})
    assert issue.path == "optimizer.type" and "did you mean 'Adam'?" in issue.message


def lion_reference(p, grads, lr, beta1, beta2, wd):
    """Lion written out from the paper's formulas, one tensor at a time."""
    m = torch.zeros_like(p)
    for g in grads:
        c = beta1 * m + (1 - beta1) * g
        p = p * (1 - lr * wd) - lr * torch.sign(c)
        m = beta2 * m + (1 - beta2) * g
    return p, m


def test_lion_matches_its_formula():
    torch.manual_seed(0)
    start = torch.randn(5, dtype=torch.float64)
    grads = [torch.randn(5, dtype=torch.float64) for _ in range(4)]
    p = torch.nn.Parameter(start.clone())
    opt = Lion([p], lr=0.01, betas=(0.9, 0.99), weight_decay=0.1)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    expected_p, expected_m = lion_reference(start, grads, 0.01, 0.9, 0.99, 0.1)
    torch.testing.assert_close(p.detach(), expected_p, rtol=0, atol=1e-15)
    torch.testing.assert_close(opt.state[p]["exp_avg"], expected_m, rtol=0, atol=1e-15)


def test_lion_update_size_is_lr_per_element():
    p = torch.nn.Parameter(torch.zeros(4))
    opt = Lion([p], lr=0.5)
    p.grad = torch.tensor([3.0, -0.001, 0.0, 100.0])
    opt.step()
    assert p.detach().tolist() == [-0.5, 0.5, 0.0, -0.5]  # sign(0) = 0: no update


def test_lion_skips_params_without_grad_and_rejects_bad_args():
    p = torch.nn.Parameter(torch.ones(2))
    Lion([p]).step()
    assert p.detach().tolist() == [1.0, 1.0]
    with pytest.raises(ValueError, match="Lion needs lr > 0"):
        Lion([p], lr=0)
