"""MoE routing without processes: capacity, priority order, drops, weights, aux and z losses
against hand-computed values, and the layer against a per-token loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from trident.moe import MoE
from trident.moe import routing


def _softmax(row):
    z = sum(math.exp(v) for v in row)
    return [math.exp(v) / z for v in row]


def test_capacity_formula():
    assert routing.capacity(64, 4, 2, 1.0, 4) == 32          # ceil(64 / 4 x 1.0 x 2)
    assert routing.capacity(10, 4, 1, 1.0, 4) == 4           # ceil(2.5) = 3, raised to min_capacity
    assert routing.capacity(10, 4, 1, 1.25, 0) == 4          # ceil(3.125)


def test_top1_hand_checked_drop_aux_and_z_loss():
    logits = torch.tensor([[2.0, 0.0], [0.0, 1.0], [1.0, 0.0], [3.0, 0.0]], requires_grad=True)
    gates, idx = routing.top_k(logits, 1)
    counts = routing.choice_counts(idx, 2).unsqueeze(0)
    r = routing.route(logits, gates, idx, counts, 0, capacity_=2)
    # expert 0 is chosen by tokens 0, 2, 3: capacity 2 keeps 0 and 2 and drops 3
    assert r.experts.tolist() == [0, 0, 1] and r.tokens.tolist() == [0, 2, 1]
    assert r.kept.tolist() == [[2, 1]]
    g = [_softmax(row) for row in logits.tolist()]
    assert r.weights.tolist() == pytest.approx([g[0][0], g[2][0], g[1][1]], rel=1e-6)
    me = [sum(row[e] for row in g) / 4 for e in range(2)]
    ce = [3 / 4, 1 / 4]
    assert r.l_aux.item() == pytest.approx(2 * (me[0] * ce[0] + me[1] * ce[1]), rel=1e-6)
    z = sum(math.log(sum(math.exp(v) for v in row)) ** 2 for row in logits.tolist()) / 4
    assert r.l_z.item() == pytest.approx(z, rel=1e-6)


def test_top2_second_choices_queue_after_all_first_choices():
    # 3 tokens, 2 experts, k = 2: first choices e0, e0, e1; second choices e1, e1, e0
    logits = torch.tensor([[1.0, 0.0], [2.0, 0.5], [0.0, 1.0]])
    gates, idx = routing.top_k(logits, 2)
    counts = routing.choice_counts(idx, 2).unsqueeze(0)
    r = routing.route(logits, gates, idx, counts, 0, capacity_=2)
    # e0: first choices of tokens 0, 1 fill it; token 2's second choice is dropped.
    # e1: token 2's first choice, then token 0's second; token 1's second is dropped.
    assert sorted(zip(r.experts.tolist(), r.tokens.tolist())) == [(0, 0), (0, 1), (1, 0), (1, 2)]
    w = {(e, t): v for e, t, v in zip(r.experts.tolist(), r.tokens.tolist(), r.weights.tolist())}
    assert w[(0, 1)] == pytest.approx(1.0) and w[(1, 2)] == pytest.approx(1.0)  # lone kept choice renormalised
    g0 = _softmax([1.0, 0.0])
    assert w[(0, 0)] == pytest.approx(g0[0]) and w[(1, 0)] == pytest.approx(g0[1])


def test_split_token_set_drops_like_one_set():
    """Two 'ranks' with half the tokens each, given the gathered counts, keep exactly what one
    process keeps (global priority order)."""
    torch.manual_seed(0)
    logits = torch.randn(24, 4)
    for k in (1, 2):
        gates, idx = routing.top_k(logits, k)
        whole = routing.route(logits, gates, idx, routing.choice_counts(idx, 4).unsqueeze(0), 0, capacity_=5)
        halves = [(logits[:12], 0), (logits[12:], 12)]
        counts = torch.stack([routing.choice_counts(routing.top_k(h, k)[1], 4) for h, _ in halves])
        kept = set()
        for g, (h, base) in enumerate(halves):
            hg, hi = routing.top_k(h, k)
            r = routing.route(h, hg, hi, counts, g, capacity_=5)
            kept |= {(e, t + base) for e, t in zip(r.experts.tolist(), r.tokens.tolist())}
            assert r.kept.sum(0).tolist() == whole.kept[0].tolist()
        assert kept == set(zip(whole.experts.tolist(), whole.tokens.tolist()))


def _loop_reference(layer: MoE, x: torch.Tensor) -> torch.Tensor:
    """Per-token DeepSpeed semantics (dropless): sum over the k best experts of gate x expert(x),
    gates renormalised over the k when k > 1."""
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        g = torch.softmax(layer.gate(x[n:n + 1]), -1)[0]
        top = torch.topk(g, layer.k).indices
        w = g[top] / g[top].sum() if layer.k > 1 else g[top]
        for e, wt in zip(top.tolist(), w):
            out[n] += wt * layer.experts.expert(e)(x[n:n + 1])[0]
    return out


@pytest.mark.parametrize("k", [1, 2])
def test_layer_matches_per_token_loop(k):
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    layer = MoE(8, expert, num_experts=4, k=k, drop_tokens=False)
    x = torch.randn(10, 8)
    out, aux, counts = layer(x)
    torch.testing.assert_close(out, _loop_reference(layer, x), rtol=1e-5, atol=1e-6)
    assert counts.sum().item() == 10 * k and aux.dim() == 0
    w = [layer.experts.expert(e)[0].weight for e in range(4)]
    assert all(not torch.equal(w[0], other) for other in w[1:])  # experts start different


@pytest.mark.parametrize("kwargs,match", [
    (dict(num_experts=6, ep_size=4), "not divisible by ep_size=4"),
    (dict(num_experts=4, k=5), "k=5 must be an integer in \\[1, num_experts=4\\]"),
    (dict(num_experts=4, capacity_factor=0.0), "capacity_factor=0.0 must be > 0"),
    (dict(num_experts=4, eval_capacity_factor=-1.0), "eval_capacity_factor=-1.0 must be > 0"),
])
def test_bad_input_one_clear_error_each(kwargs, match):
    with pytest.raises(ValueError, match=match):
        MoE(8, nn.Linear(8, 8), **kwargs)


def test_model_config_rejects_k_above_experts():
    from trident.config import load_config
    from trident.config.errors import ConfigError
    with pytest.raises(ConfigError, match="k=3 is larger than num_experts=2"):
        load_config({"train_micro_batch_size_per_gpu": 1, "model": {"moe": {"num_experts": 2, "k": 3}}})


def test_config_rejects_experts_not_divisible_by_ep():
    from trident.config import load_config
    from trident.config.errors import ConfigError
    with pytest.raises(ConfigError, match="6 is not divisible by expert_parallel.size=4"):
        load_config({"train_micro_batch_size_per_gpu": 1, "expert_parallel": {"size": 4},
                     "model": {"moe": {"num_experts": 6, "k": 2}}})
    cfg = load_config({"train_micro_batch_size_per_gpu": 1, "expert_parallel": {"size": 2},
                       "model": {"moe": {"num_experts": 4, "k": 1}}})
    assert cfg.expert_parallel.size == 2 and cfg.model.moe.num_experts == 4
