"""Split backward (zero-bubble schedules): the input pass leaves linear weights alone, the weight
pass completes them, and the result is the ordinary gradient."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from trident.pipeline.weight_grad import WeightGradStore, defer_weight_grads


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.fc = nn.Linear(8, 16)
        self.norm = nn.LayerNorm(16)
        self.out = nn.Linear(16, 8, bias=False)

    def forward(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = self.out(self.norm(F.gelu(self.fc(self.emb(idx) + x))))
        return F.linear(h, self.emb.weight)  # tied output projection


def test_deferred_weight_gradients_equal_the_ordinary_ones():
    torch.manual_seed(0)
    net = Net()
    idx, x = torch.randint(0, 11, (3, 5)), torch.randn(3, 5, 8)
    net(idx, x.clone().requires_grad_()).square().mean().backward()
    expected = {n: p.grad.clone() for n, p in net.named_parameters()}
    net.zero_grad(set_to_none=True)
    hooks_fired = []
    for name, p in net.named_parameters():
        p.register_post_accumulate_grad_hook(lambda _, name=name: hooks_fired.append(name))

    store = WeightGradStore()
    xin = x.clone().requires_grad_()
    with defer_weight_grads(store):
        loss = net(idx, xin).square().mean()
    loss.backward()  # the input pass
    assert xin.grad is not None
    assert net.fc.weight.grad is None and net.out.weight.grad is None and net.fc.bias.grad is None
    assert net.norm.weight.grad is not None  # not a linear layer: done in the input pass
    assert len(store) == 3  # fc, out, and the tied projection
    store.flush()  # the weight pass
    assert len(store) == 0
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, expected[name], msg=name)
    assert sorted(set(hooks_fired)) == sorted(expected)


def test_computed_weights_and_no_grad_are_not_deferred():
    lin = nn.Linear(4, 4)
    store = WeightGradStore()
    with defer_weight_grads(store):
        F.linear(torch.randn(2, 4), lin.weight * 2).sum().backward()  # a computed (non-leaf) weight
        with torch.no_grad():
            lin(torch.randn(2, 4))
    assert len(store) == 0 and lin.weight.grad is not None


def test_a_first_layer_on_inputs_without_grad_still_gets_its_weight_gradient():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    x = torch.randn(5, 4)  # data: requires no grad, and every weight is deferred
    net(x).square().sum().backward()
    expected = [p.grad.clone() for p in net.parameters()]
    net.zero_grad(set_to_none=True)
    store = WeightGradStore()
    with defer_weight_grads(store):
        loss = net(x).square().sum()
    loss.backward()
    assert all(p.grad is None for p in net.parameters()) and len(store) == 2
    store.flush()
    for p, e in zip(net.parameters(), expected):
        torch.testing.assert_close(p.grad, e)
