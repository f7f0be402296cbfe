"""Context-parallel attention against unsplit attention, on 2 and 4 gloo ranks.

Every rank draws the same full q, k, v (and document ids), takes its cp shard, runs
`trident.context_parallel.attention`, and compares its output and input gradients with the
matching shard of unsplit causal attention (SDPA, fp32, relative error <= 1e-5). The same
workers count the attended (query, key) entries per rank (load balance) and the bytes the
comms logger saw against the ring's and Ulysses' formulas.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from trident.comm.logger import CommsLogger
from trident.context_parallel import ContextParallel, attention
from trident.context_parallel.layout import document_mask
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import relative_error

B, H, D = 2, 4, 8


def _reference(q, k, v, docs):
    if k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if docs is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    pos = torch.arange(q.shape[2])
    return F.scaled_dot_product_attention(q, k, v, attn_mask=document_mask(pos, pos, True, docs, docs))


def _check(method: str, ulysses_size: int | None, seq: int, kv_heads: int, packed: bool):
    mesh = cached_mesh(cp=torch.distributed.get_world_size())
    logger = CommsLogger(enabled=True, prof_all=True)
    cp = ContextParallel.from_mesh(mesh, method, ulysses_size, logger)
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, seq, D, generator=gen)
    k = torch.randn(B, kv_heads, seq, D, generator=gen)
    v = torch.randn(B, kv_heads, seq, D, generator=gen)
    grad = torch.randn(B, H, seq, D, generator=gen)
    docs = None
    if packed:  # documents of uneven lengths crossing chunk and rank boundaries
        cuts = torch.tensor([0] * 5 + [1] * (seq // 2) + [2] * (seq - 5 - seq // 2))
        docs = torch.stack([cuts, torch.zeros(seq, dtype=torch.long)])
    full = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = _reference(*full, docs)
    ref.backward(grad)
    local = [cp.shard(t, dim=2).requires_grad_(True) for t in (q, k, v)]
    logger.reset()
    out = attention(*local, causal=True, doc_ids=cp.shard(docs, dim=1) if docs is not None else None, cp=cp)
    out.backward(cp.shard(grad, dim=2))
    errors = {"out": relative_error(out, cp.shard(ref, dim=2))}
    for name, mine, whole in zip("qkv", local, full):
        errors["d" + name] = relative_error(mine.grad, cp.shard(whole.grad, dim=2))
    totals = {op: (s.calls, s.bytes) for op, s in logger.totals().items()}
    return errors, dict(cp.stats), totals


CASES = [
    ("ring", None, 16, 4, False),
    ("ring", None, 16, 2, True),
    ("ulysses", None, 16, 4, False),
    ("ulysses", None, 16, 4, True),
]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("method,ulysses,seq,kv_heads,packed", CASES)
def test_attention_matches_unsplit(world, method, ulysses, seq, kv_heads, packed):
    results = run_on_ranks(world, _check, method, ulysses, seq, kv_heads, packed)
    for rank, (errors, _, _) in enumerate(results):
        bad = {k: e for k, e in errors.items() if e > 1e-5}
        assert not bad, f"rank {rank}: {bad}"


def test_hybrid_matches_unsplit():
    results = run_on_ranks(4, _check, "hybrid", 2, 16, 4, True)
    for rank, (errors, _, _) in enumerate(results):
        assert max(errors.values()) <= 1e-5, f"rank {rank}: {errors}"


@pytest.mark.parametrize("world", [2, 4])
def test_ring_load_balance_and_bytes(world):
    """Every rank attends the same number of (query, key) entries under the causal mask, and
    sends (C-1) key/value blocks forward, (C-1) blocks plus C gradient blocks backward."""
    seq, kv_heads = 32, 4
    results = run_on_ranks(world, _check, "ring", None, seq, kv_heads, False)
    entries = [stats["score_elements"] for _, stats, _ in results]
    assert max(entries) / min(entries) - 1 < 0.05, entries
    chunk = seq // (2 * world)
    # per rank: two chunks, each attending every earlier chunk fully and its own chunk causally
    assert entries[0] == B * H * (2 * world - 1 + 2 * (chunk + 1) / (2 * chunk)) * chunk * chunk
    block = 2 * B * kv_heads * (seq // world) * D * 4  # k and v of one rank, fp32
    for _, _, totals in results:
        assert totals["send"] == (2 * (world - 1) + world, 2 * (world - 1) * block + world * block), totals


def test_ulysses_bytes():
    """Four all-to-alls forward (q, k, v in; out back) and four backward, each moving a rank's
    whole [B, H, T/C, D] tensor."""
    world, seq = 2, 16
    results = run_on_ranks(world, _check, "ulysses", None, seq, 4, False)
    tensor = B * H * (seq // world) * D * 4
    for _, _, totals in results:
        assert totals["all_to_all"] == (8, 8 * tensor), totals


def _bad_inputs():
    cp = ContextParallel.from_mesh(cached_mesh(cp=2), "ulysses")
    q = torch.randn(1, 3, 4, D)
    with pytest.raises(ValueError, match="splits heads over 2 ranks.*3 heads"):
        attention(q, q, q, cp=cp)
    with pytest.raises(ValueError, match="not divisible by 2 x context_parallel.size = 4"):
        cp.shard(torch.zeros(1, 6))
    return True


def test_heads_not_divisible_for_ulysses():
    assert all(run_on_ranks(2, _bad_inputs))


def _doc_gathers(method: str, ulysses_size: int | None) -> tuple[int, int]:
    """All-gathers of document ids over three layers' attention in one forward, then over one
    more layer after the ids changed in place (a new batch written into the same tensor)."""
    mesh = cached_mesh(cp=torch.distributed.get_world_size())
    logger = CommsLogger(enabled=True, prof_all=True)
    cp = ContextParallel.from_mesh(mesh, method, ulysses_size, logger)
    q = cp.shard(torch.randn(B, H, 16, D, generator=torch.Generator().manual_seed(3)), dim=2)
    docs = cp.shard(torch.tensor([[0] * 6 + [1] * 10] * B), dim=1)
    for _ in range(3):
        attention(q, q, q, doc_ids=docs, cp=cp)
    once = logger.totals()["all_gather_list"].calls
    docs.add_(1)
    attention(q, q, q, doc_ids=docs, cp=cp)
    return once, logger.totals()["all_gather_list"].calls - once


@pytest.mark.parametrize("method,ulysses", [("ring", None), ("ulysses", None), ("hybrid", 2)])
def test_document_ids_are_gathered_once_per_forward(method, ulysses):
    world = 4 if method == "hybrid" else 2
    phases = 2 if method == "hybrid" else 1  # hybrid: inside the Ulysses group, then over the ring
    for once, again in run_on_ranks(world, _doc_gathers, method, ulysses):
        assert (once, again) == (phases, phases)
