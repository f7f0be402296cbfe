"""`deepspeed.ops.adagrad.DeepSpeedCPUAdagrad`: DeepSpeed's update (g += wd * p; s += g^2; p -= lr g/(sqrt(s)+eps))."""
import torch

import trident as deepspeed


def test_cpu_adagrad_steps_as_deepspeed_defines_it():
    torch.manual_seed(0)
    p = torch.nn.Parameter(torch.randn(5))
    ref, s = p.detach().clone(), torch.zeros(5)
    opt = deepspeed.ops.adagrad.DeepSpeedCPUAdagrad([p], lr=0.1, eps=1e-8, weight_decay=0.01)
    for _ in range(3):
        g = torch.randn(5)
        p.grad = g.clone()
        opt.step()
        g = g + 0.01 * ref
        s += g * g
        ref -= 0.1 * g / (s.sqrt() + 1e-8)
    torch.testing.assert_close(p.detach(), ref, rtol=1e-6, atol=1e-7)
