"""trident's CPU optimizer (ZeRO-Offload's step): DeepSpeedCPUAdam's constructor on torch's fused
CPU kernel; same steps and state as torch.optim.Adam / AdamW, and what the factory builds."""

from __future__ import annotations

import pytest
import torch

from trident.config import load_config
from trident.optim import CPUAdam, build_optimizer


def steps(opt_factory, n: int = 20) -> tuple[torch.Tensor, dict]:
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(257, 3))
    opt = opt_factory([p])
    g = torch.Generator().manual_seed(1)
    for _ in range(n):
        p.grad = torch.randn(p.shape, generator=g)
        opt.step()
    return p.detach(), opt.state[p]


@pytest.mark.parametrize("adamw_mode,reference", [(True, torch.optim.AdamW), (False, torch.optim.Adam)])
@pytest.mark.parametrize("amsgrad", [False, True])
def test_matches_torch_adam_and_adamw(adamw_mode, reference, amsgrad):
    kw = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad)
    ours, our_state = steps(lambda ps: CPUAdam(ps, adamw_mode=adamw_mode, **kw))
    ref, ref_state = steps(lambda ps: reference(ps, foreach=False, **kw))
    torch.testing.assert_close(ours, ref, rtol=1e-6, atol=1e-7)
    assert set(our_state) == set(ref_state)  # step, exp_avg, exp_avg_sq (+ max_exp_avg_sq): torch's names
    torch.testing.assert_close(our_state["exp_avg_sq"], ref_state["exp_avg_sq"], rtol=1e-6, atol=1e-9)


def test_bias_correction_off_is_refused():
    with pytest.raises(ValueError, match="bias_correction=False is not supported"):
        CPUAdam([torch.nn.Parameter(torch.zeros(2))], bias_correction=False)


def test_state_dict_round_trips_with_torch_adamw():
    _, _ = steps(lambda ps: CPUAdam(ps, lr=1e-2), n=3)
    p = torch.nn.Parameter(torch.ones(4))
    p.grad = torch.ones(4)
    ours = CPUAdam([p], lr=1e-2)
    ours.step()
    q = torch.nn.Parameter(torch.ones(4))
    theirs = torch.optim.AdamW([q], lr=1e-2)
    theirs.load_state_dict(ours.state_dict())
    assert theirs.state[q]["step"] == 1 and torch.equal(theirs.state[q]["exp_avg"], ours.state[p]["exp_avg"])


@pytest.mark.parametrize("device,expected", [("cpu", CPUAdam), ("nvme", CPUAdam), ("none", torch.optim.AdamW)])
def test_factory_builds_cpu_adam_under_offload(device, expected, tmp_path):
    cfg = load_config({"train_micro_batch_size_per_gpu": 1,
                       "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                       "zero_optimization": {"stage": 2, "offload_optimizer": {"device": device,
                                                                              "nvme_path": str(tmp_path)}}})
    opt = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(3))],
                          offload=cfg.zero_optimization.offload_optimizer.device != "none")
    assert type(opt) is expected
    assert opt.defaults["fused"]  # torch's fused CPU kernel either way
