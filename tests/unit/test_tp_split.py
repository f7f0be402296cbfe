"""Tensor-parallel pieces that need no processes: shard arithmetic, state-dict split / merge,
plan resolution and matching, the RNG tracker and the dropout masks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from trident.parallel.rng import MODEL_PARALLEL, RNGTracker, unit_seed
from trident.tensor_parallel import (
    PRESETS,
    Column,
    Row,
    SequenceParallelDropout,
    ShardSpec,
    merge_state_dicts,
    split_state_dict,
    unit_dropout_mask,
)
from trident.tensor_parallel.plan import matches, resolve_plan


def test_shard_and_merge_round_trip_with_stride_and_padding():
    full = torch.arange(24.0).view(6, 4)
    spec = ShardSpec(0, 6, 2)
    assert [s.tolist() for s in (spec.shard(full, 0), spec.shard(full, 1))] == [full[:3].tolist(), full[3:].tolist()]
    fused = ShardSpec(0, 6, 2, stride=3)  # blocks [0,1] [2,3] [4,5]: rank 0 takes rows 0, 2, 4
    assert fused.shard(full, 0)[:, 0].tolist() == [0.0, 8.0, 16.0]
    padded = ShardSpec(1, 4, 3, pad=True)  # 4 columns -> 6 over 3 ranks, 2 zero columns at the end
    shards = [padded.shard(full, r) for r in range(3)]
    assert padded.padded_size == 6 and shards[2].tolist() == [[0.0, 0.0]] * 6
    for s in (spec, fused, padded):
        assert torch.equal(s.merge([s.shard(full, r) for r in range(s.tp_size)]), full)


def test_shard_spec_errors_name_the_sizes():
    with pytest.raises(ValueError, match="size 10 of dim 0 is not divisible by tp=4"):
        ShardSpec(0, 10, 4)
    with pytest.raises(ValueError, match="tp=2 x 3 fused blocks = 6"):
        ShardSpec(0, 9, 2, stride=3)
    with pytest.raises(ValueError, match="dim 0 of the tensor is 5, expected 6"):
        ShardSpec(0, 6, 2).shard(torch.zeros(5), 0)


def test_split_and_merge_state_dicts():
    full = {"w": torch.randn(8, 3), "b": torch.randn(3)}
    specs = {"w": ShardSpec(0, 8, 4)}
    shards = [split_state_dict(full, specs, r) for r in range(4)]
    assert shards[1]["w"].shape == (2, 3) and torch.equal(shards[3]["b"], full["b"])
    merged = merge_state_dicts(shards, specs)
    assert all(torch.equal(merged[k], full[k]) for k in full)
    shards[2]["b"] += 1e-7
    with pytest.raises(ValueError, match="replicated tensor 'b' differs between tp rank 0 and tp rank 2"):
        merge_state_dicts(shards, specs)


def test_plan_resolution_and_patterns():
    assert resolve_plan({"fc1": "column", "fc2": Row()}) == {"fc1": Column(), "fc2": Row()}
    assert resolve_plan("gpt2")["attn.c_attn"] == Column(stride=3)
    assert set(PRESETS) == {"gpt2", "llama"}
    with pytest.raises(ValueError, match="'colwise' is not a style; use one of"):
        resolve_plan({"fc1": "colwise"})
    with pytest.raises(ValueError, match="'gpt3' is not a preset; presets: \\['gpt2', 'llama'\\]"):
        resolve_plan("gpt3")
    assert matches("fc1", "net.fc1") and matches("fc1", "fc1") and not matches("fc1", "net.fc10")
    assert matches("h.*.attn.c_proj", "transformer.h.3.attn.c_proj") and not matches("attn.c_proj", "mlp.c_proj")
    assert not matches("a.b.c", "b.c")


def test_tracker_streams_fork_and_default_region():
    a, b = RNGTracker(7, tp_rank=0), RNGTracker(7, tp_rank=1)
    draw = lambda t: torch.rand(4, generator=t.generator())  # noqa: E731
    assert not torch.equal(draw(a), draw(b))  # model-parallel streams differ per tp rank
    torch.manual_seed(3)
    expected_default = torch.rand(4)
    torch.manual_seed(3)
    with a.fork():
        inside = torch.rand(4)
    assert torch.equal(torch.rand(4), expected_default)  # the default stream did not see the fork
    with a.fork():
        assert not torch.equal(torch.rand(4), inside)  # the stream advanced
    with pytest.raises(ValueError, match="already exists"):
        a.add(MODEL_PARALLEL, 1)


def test_tracker_states_replay_and_unit_streams():
    t = RNGTracker(7)
    gens = t.unit_generators("attn", range(2, 4))
    states = t.get_states()
    first = [torch.rand(3, generator=g) for g in gens]
    t.set_states(states)
    assert all(torch.equal(torch.rand(3, generator=g), f) for g, f in zip(gens, first))
    # unit u's stream is the same whichever tracker (tp rank) holds it
    other = RNGTracker(7, tp_rank=3).unit_generators("attn", range(0, 4))
    assert torch.equal(torch.rand(3, generator=other[2]), first[0])
    assert unit_seed(7, "attn", 2) != unit_seed(7, "attn", 3) != unit_seed(7, "mlp", 2)
    with pytest.raises(KeyError, match="unknown RNG streams"):
        t.set_states({"nope": states[MODEL_PARALLEL]})


def test_checkpoint_contexts_make_recomputation_replay_the_masks():
    t = RNGTracker(0)
    w = torch.randn(8, requires_grad=True)

    def fn(x):
        return x * torch.rand(8, generator=t.generator()).lt(0.5)

    def grad(checkpoint: bool, context_fn=None):
        w.grad = None
        if not checkpoint:
            fn(w * 1.0).sum().backward()
        else:
            kwargs = {"context_fn": context_fn} if context_fn else {}
            torch.utils.checkpoint.checkpoint(fn, w * 1.0, use_reentrant=False, **kwargs).sum().backward()
        return w.grad.clone()

    start = t.get_states()
    plain = grad(False)
    t.set_states(start)
    assert torch.equal(grad(True, t.checkpoint_contexts), plain)
    t.set_states(start)
    assert not torch.equal(grad(True), plain)  # without the contexts the recomputation draws anew


def test_unit_dropout_mask_is_per_unit():
    gens = RNGTracker(1).unit_generators("h", range(4))
    mask = unit_dropout_mask((2, 4, 5, 5), 1, gens, 0.5)
    assert set(mask.unique().tolist()) <= {0.0, 2.0}
    again = unit_dropout_mask((2, 2, 5, 5), 1, RNGTracker(1).unit_generators("h", range(2, 4)), 0.5)
    assert torch.equal(mask[:, 2:], again)  # units 2 and 3 alone draw what they drew among all four
    with pytest.raises(ValueError, match="has 3 units but 4 generators"):
        unit_dropout_mask((2, 3), 1, gens, 0.5)


def test_sequence_parallel_dropout_is_a_slice_of_full_dropout():
    x = torch.randn(2, 8, 6)
    torch.manual_seed(4)
    full = nn.Dropout(0.3)(x)
    for rank in range(4):
        torch.manual_seed(4)
        sp = SequenceParallelDropout(0.3, SimpleNamespace(tp_size=4, tp_rank=rank))
        assert torch.equal(sp(x.chunk(4, dim=1)[rank]), full.chunk(4, dim=1)[rank])
    assert torch.equal(sp.eval()(x), x)
