"""Dropout under tensor parallelism: the same masks on every tp rank outside the split region,
different ones inside it, and recomputation (activation checkpointing) replaying them."""

from __future__ import annotations

import pytest
import torch
import torch.utils.checkpoint
from torch import nn

from trident.models.gpt import GPT, GPTConfig
from trident.parallel.rng import RNGTracker
from trident.testing.distributed import cached_mesh, run_on_ranks

MODEL = dict(vocab_size=29, seq_len=8, n_layer=2, n_head=4, d_model=16, dropout=0.3, bias=False)


class Checkpointed(nn.Module):
    """Runs `block` under torch.utils.checkpoint; `tracker` (or None) replays its streams."""

    def __init__(self, block: nn.Module, tracker: RNGTracker | None):
        super().__init__()
        self.block, self.tracker = block, tracker

    def forward(self, x):
        extra = {"context_fn": self.tracker.checkpoint_contexts} if self.tracker else {}
        return torch.utils.checkpoint.checkpoint(self.block, x, use_reentrant=False, **extra)


def grads_with(sequence_parallel: bool, mode: str) -> dict[str, torch.Tensor]:
    """One step's gradients of the tp=2 GPT, blocks run plainly or checkpointed."""
    mesh = cached_mesh(tp=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL), mesh, sequence_parallel=sequence_parallel)
    if mode != "plain":
        tracker = model.rng_tracker if mode == "replay" else None
        model.blocks = nn.ModuleList(Checkpointed(b, tracker) for b in model.blocks)
    idx = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_len"] + 1), generator=torch.Generator().manual_seed(1))
    model(idx[:, :-1], idx[:, 1:]).backward()
    return {name.replace("block.", ""): p.grad.clone() for name, p in model.named_parameters()}


def masks_by_region() -> dict[str, torch.Tensor]:
    """The embedding's dropout (default region) and one attention head mask (split region)."""
    mesh = cached_mesh(tp=2)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL), mesh)
    idx = torch.randint(0, MODEL["vocab_size"], (2, MODEL["seq_len"]), generator=torch.Generator().manual_seed(1))
    head_mask = torch.rand(8, generator=model.blocks[0].attn.head_rng[0])
    return {"embedding_out": model.embed(idx).detach(), "first_local_head": head_mask}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_recomputation_replays_dropout(sequence_parallel):
    plain = run_on_ranks(2, grads_with, sequence_parallel, "plain")
    replay = run_on_ranks(2, grads_with, sequence_parallel, "replay")
    fresh = run_on_ranks(2, grads_with, sequence_parallel, "fresh")
    for p, r, f in zip(plain, replay, fresh):
        assert p.keys() == r.keys()
        for name in p:
            torch.testing.assert_close(r[name], p[name], rtol=1e-6, atol=0, msg=name)
        # without the tracker's contexts the attention masks are drawn anew in recomputation
        assert any(not torch.allclose(f[n], p[n]) for n in p if "attn.qkv" in n)


def test_default_region_agrees_and_split_region_differs_across_tp_ranks():
    r0, r1 = run_on_ranks(2, masks_by_region)
    assert torch.equal(r0["embedding_out"], r1["embedding_out"])
    assert (r0["embedding_out"] == 0).any()  # dropout was active
    assert not torch.equal(r0["first_local_head"], r1["first_local_head"])  # heads 0 and 2: own streams
