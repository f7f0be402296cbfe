"""MoE on real gloo ranks: all-to-all bytes per layer against the formula, the layer built
with a mesh, and the routing statistics every rank agrees on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from trident.comm.logger import CommsLogger
from trident.moe import MoE, expert_stats
from trident.testing.distributed import cached_mesh, run_on_ranks

HIDDEN, TOKENS, EXPERTS = 8, 16, 4


def even_tokens(k: int) -> torch.Tensor:
    """Token n's best expert is n mod E and its second best n + 1 mod E: every rank sends
    each expert the same number of rows."""
    x = torch.zeros(TOKENS, HIDDEN)
    n = torch.arange(TOKENS)
    x[n, n % EXPERTS] = 5.0
    if k > 1:
        x[n, (n + 1) % EXPERTS] = 2.0
    return x


def all_to_all_bytes(ep: int, k: int):
    mesh = cached_mesh(ep=ep)
    logger = CommsLogger(enabled=True)
    torch.manual_seed(0)
    layer = MoE(HIDDEN, nn.Linear(HIDDEN, HIDDEN), num_experts=EXPERTS, ep_size=ep, k=k, drop_tokens=False,
                mesh=mesh, logger=logger)
    with torch.no_grad():
        layer.gate.wg.weight.copy_(torch.eye(EXPERTS, HIDDEN))
    x = even_tokens(k).requires_grad_()
    out, aux, counts = layer(x)
    forward = logger.totals()["all_to_all"].bytes
    out.square().sum().backward()
    total = logger.totals()["all_to_all"].bytes
    return forward, total - forward, counts.tolist(), expert_stats(layer)


@pytest.mark.parametrize("ep,k", [(2, 1), (2, 2), (4, 2)])
def test_all_to_all_bytes_per_layer_equal_the_formula(ep, k):
    results = run_on_ranks(ep, all_to_all_bytes, ep, k)
    expected = 2 * TOKENS * HIDDEN * k * 4 * (ep - 1) // ep  # dispatch + combine, fp32
    for forward, backward, counts, stats in results:
        assert forward == expected
        assert backward == expected
        assert sum(counts) == TOKENS * k
    assert all(r[3] == results[0][3] for r in results)  # every rank reports the same global load
    assert results[0][3][""]["dropped_share"] == 0.0


class Regressor(nn.Module):
    """A user model around DeepSpeed-style `MoE(...)`: returns its loss plus the aux loss."""

    def __init__(self, mesh=None, ep: int = 1):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(HIDDEN, nn.Sequential(nn.Linear(HIDDEN, 16), nn.GELU(), nn.Linear(16, HIDDEN)),
                       num_experts=EXPERTS, ep_size=ep, k=2, capacity_factor=1.0, min_capacity=0, mesh=mesh,
                       aux_loss_coef=0.01, z_loss_coef=0.001)

    def forward(self, x, y):
        out, aux, _ = self.moe(self.inp(x))
        return nn.functional.mse_loss(out, y) + aux


def regression_data(step: int, rows: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(rows, HIDDEN, generator=g), torch.randn(rows, HIDDEN, generator=g)


def train_regressor(ep: int, steps: int):
    import trident
    mesh = cached_mesh(ep=ep)
    cfg = {"train_micro_batch_size_per_gpu": TOKENS, "steps_per_print": 0, "gradient_clipping": 0.05,
           "expert_parallel": {"size": ep}, "optimizer": {"type": "SGD", "params": {"lr": 0.5, "momentum": 0.9}}}
    engine, *_ = trident.initialize(model=Regressor(mesh, ep), config=cfg, mesh=mesh)
    losses = []
    for step in range(steps):
        x, y = regression_data(step, TOKENS * ep)
        mine = slice(mesh.ep_rank * TOKENS, (mesh.ep_rank + 1) * TOKENS)
        engine.backward(engine(x[mine], y[mine]))
        engine.step()
        losses.append(engine.last_loss)
    return losses, {k: v.clone() for k, v in engine.module.state_dict().items()}


def test_user_model_with_moe_built_on_the_mesh_trains_like_one_process():
    """MoE(..., ep_size=2, mesh=mesh) in a plain model: the same experts, losses and weights as
    one process holding all of them (SGD with active clipping)."""
    from trident.testing.parity import assert_losses_close, assert_state_close, train_serial
    steps = 4
    ref = train_serial(Regressor(), [regression_data(s, 2 * TOKENS) for s in range(steps)], "sgd", 0.5, 0.05)
    assert max(ref.clip_coefs) < 1.0, ref.clip_coefs
    results = run_on_ranks(2, train_regressor, 2, steps)
    assert_losses_close([sum(s) / 2 for s in zip(*(r[0] for r in results))], ref.losses, rtol=1e-5)
    for _, weights in results:
        assert_state_close(weights, {k: ref.weights[k] for k in weights}, rtol=1e-5)
