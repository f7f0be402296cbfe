"""Activation checkpointing under tensor parallelism (2 gloo ranks): partitioned inputs (each tp
rank keeps half, all-gathered for the rerun) and host-kept inputs give the same losses and
gradients as no checkpointing, with dropout replayed across the per-head streams, and each rank
keeps 1/tp of the layer inputs."""

from __future__ import annotations

import pytest
import torch

from trident import checkpointing
from trident.models.gpt import GPT, GPTConfig
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.memory import LiveTensorBytes

CFG = GPTConfig(vocab_size=64, seq_len=32, n_layer=3, n_head=4, d_model=64, dropout=0.1)


def tp_run(settings: dict | None, measure: bool = False):
    mesh = cached_mesh(tp=2)
    checkpointing.reset()
    torch.manual_seed(0)
    model = GPT(CFG, mesh)
    if settings is not None:
        checkpointing.configure(mesh, **settings)
        checkpointing.apply_activation_checkpointing(model, [r"blocks\.\d+"])
    g = torch.Generator().manual_seed(1)
    losses, kept = [], None
    for _ in range(2):
        idx = torch.randint(0, CFG.vocab_size, (4, CFG.seq_len + 1), generator=g)
        tracker = LiveTensorBytes({p.untyped_storage().data_ptr() for p in model.parameters()})
        with tracker:
            loss = model(idx[:, :-1], idx[:, 1:])
            kept = tracker.live
            loss.backward()
        losses.append(loss.item())
    checkpointing.reset()
    return losses, {n: p.grad.clone() for n, p in model.named_parameters()}, kept


@pytest.mark.parametrize("settings", [dict(partition_activations=True),
                                      dict(partition_activations=True, cpu_checkpointing=True,
                                           contiguous_memory_optimization=True, number_checkpoints=3)],
                         ids=["partitioned", "partitioned+cpu+contiguous"])
def test_partitioned_checkpointing_matches_no_checkpointing(settings):
    plain = run_on_ranks(2, tp_run, None)
    ac = run_on_ranks(2, tp_run, settings)
    for (losses, grads, _), (ref_losses, ref_grads, _) in zip(ac, plain):
        assert losses == ref_losses
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=0, atol=0, msg=name)


def test_each_tp_rank_keeps_half_of_the_layer_inputs():
    whole = run_on_ranks(2, tp_run, {})
    split = run_on_ranks(2, tp_run, dict(partition_activations=True))
    inputs = CFG.n_layer * 4 * CFG.seq_len * CFG.d_model * 4  # n_layer x (b s h) fp32
    for (_, _, kept_whole), (_, _, kept_split) in zip(whole, split):
        assert kept_whole - kept_split == pytest.approx(inputs / 2, rel=0.02)
