"""Placement and shard layout for parameter servers: pure functions, no processes."""

from __future__ import annotations

import random

import pytest
import torch

from trident.parameter_server.sharding import assign_servers, fingerprint, shard_layouts


@pytest.mark.parametrize("placement", ["round_robin", "balanced"])
@pytest.mark.parametrize("seed", range(20))
def test_no_server_holds_more_than_its_share_plus_one_tensor(placement, seed):
    rng = random.Random(seed)
    numels = [rng.choice([1, 7, 64, 300, 4096, 50_000]) for _ in range(rng.randint(4, 40))]
    servers = rng.randint(1, 4)
    owner = assign_servers(numels, servers, placement)
    share = sum(numels) / servers
    for s in range(servers):
        mine = [n for n, o in zip(numels, owner) if o == s]
        assert mine, f"server {s} got nothing"
        # a server only takes a tensor while it is at or below its share
        assert sum(mine) <= share + max(mine), (s, sum(mine), share, max(mine))


def test_round_robin_interleaves_and_balanced_is_tighter():
    numels = [100, 10, 100, 10, 100, 10, 1000]
    assert assign_servers(numels, 2, "round_robin")[:4] == [0, 1, 0, 1]
    loads = {p: [sum(n for n, o in zip(numels, assign_servers(numels, 2, p)) if o == s) for s in range(2)]
             for p in ("round_robin", "balanced")}
    assert max(loads["balanced"]) <= max(loads["round_robin"])
    assert sorted(loads["balanced"]) == [330, 1000]  # the big tensor alone, the rest together


def test_assignment_errors_name_the_key():
    with pytest.raises(ValueError, match=r"parameter_server.servers = 3 but the model has only 2"):
        assign_servers([5, 5], 3, "balanced")
    with pytest.raises(ValueError, match=r"parameter_server.placement must be one of round_robin, balanced"):
        assign_servers([5, 5], 1, "random")


def test_shard_layout_buckets_cover_each_shard_back_to_front():
    shapes = [torch.Size([4, 8]), torch.Size([8]), torch.Size([8, 8]), torch.Size([3])]
    owner = [0, 1, 0, 0]
    layouts = shard_layouts(shapes, owner, 2, bucket_size=40)
    first = layouts[0]
    assert first.tensors == (0, 2, 3) and first.numel == 32 + 64 + 3
    # reverse order: the last tensor (backward's first gradient) starts the buffer
    assert first.offsets == (67, 3, 0)
    covered = sorted((b.start, b.end) for b in first.buckets)
    assert covered[0][0] == 0 and covered[-1][1] == first.numel
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:]))
    flat = torch.arange(first.numel, dtype=torch.float32)
    views = first.views(flat)
    assert [tuple(v.shape) for v in views] == [(4, 8), (8, 8), (3,)] and views[2][0].item() == 0
    assert layouts[1].tensors == (1,) and len(layouts[1].buckets) == 1


def test_fingerprint_sees_every_difference():
    names, shapes = ["a", "b"], [torch.Size([2, 3]), torch.Size([4])]
    base = fingerprint(names, shapes, [0, 1], 100)
    assert base == fingerprint(names, shapes, [0, 1], 100) and base < 2 ** 52
    assert base != fingerprint(names, [torch.Size([3, 2]), torch.Size([4])], [0, 1], 100)
    assert base != fingerprint(names, shapes, [1, 0], 100)
    assert base != fingerprint(names, shapes, [0, 1], 101)
