"""Activation checkpointing under tensor parallelism (2 gloo ranks): partitioned inputs (each tp
rank keeps half, all-gathered for the rerun) and host-kept inputs give the same losses and
gradients as no checkpointing, with dropout replayed across the per-head streams, and each rank
keeps 1/tp of the layer inputs. Through trident.initialize, the config section alone (tp=2, or
dp=2 with ZeRO-3 gathering parameters again for the rerun) trains to the same losses."""

from __future__ import annotations

import pytest
import torch

import trident
from trident import checkpointing
from trident.recompute import activation
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
    # Tolerance: the vocab-parallel cross-entropy all-reduces row maxima and three sums per token
    # (4 fp32 per token); gloo's thread drops its hold on them at a moment that races the count.
    race = 4 * 4 * CFG.seq_len * 4
    for (_, _, kept_whole), (_, _, kept_split) in zip(whole, split):
        assert abs(kept_whole - kept_split - inputs / 2) <= race


AC_SECTION = {"layers": [r"blocks\.\d+"], "every": 2}


def engine_run(tp: int, stage: int, section: dict | None):
    """Losses of 3 steps through trident.initialize, and the modules the config wrapped."""
    mesh = cached_mesh(tp=tp)
    checkpointing.reset()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "tensor_parallel": {"size": tp}, "zero_optimization": {"stage": stage}}
    if section is not None:
        cfg["activation_checkpointing"] = section
    engine, *_ = trident.initialize(model=GPT(CFG), config=cfg, mesh=mesh)
    wrapped = [n for n, m in engine.module.named_modules() if getattr(m, "_trident_checkpointed", False)]
    g = torch.Generator().manual_seed(1 + mesh.dp_rank)
    losses = []
    for _ in range(3):
        idx = torch.randint(0, CFG.vocab_size, (2, CFG.seq_len + 1), generator=g)
        engine.backward(engine(idx[:, :-1], idx[:, 1:]))
        engine.step()
        losses.append(engine.last_loss)
    partitioned = activation.settings_of(engine.module).partition_group is not None
    checkpointing.reset()
    return losses, wrapped, partitioned


@pytest.mark.parametrize("tp,stage,section", [
    (2, 1, dict(AC_SECTION, partition_activations=True, cpu_checkpointing=True)),
    (1, 3, AC_SECTION)], ids=["tp2-partitioned-cpu-zero1", "dp2-zero3"])
def test_config_section_through_initialize_keeps_losses(tp, stage, section):
    plain = run_on_ranks(2, engine_run, tp, stage, None)
    ac = run_on_ranks(2, engine_run, tp, stage, section)
    for (losses, wrapped, partitioned), (ref_losses, ref_wrapped, _) in zip(ac, plain):
        assert wrapped == ["blocks.0", "blocks.2"] and ref_wrapped == []
        assert partitioned == (tp > 1)
        assert losses == ref_losses


def settings_after_initializes():
    """What each of three initializes of one model leaves, after a user's configure: without
    the section, with it, and without it again. Per initialize: (the process-wide settings
    are still the user's, the model uses them, its cpu_checkpointing, its profile)."""
    checkpointing.reset()
    mesh = cached_mesh()
    base = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    seen = []
    user = checkpointing.configure(mesh, cpu_checkpointing=True)
    model = GPT(CFG)
    for section in (None, {"profile": True}, None):
        cfg = dict(base, activation_checkpointing=section) if section else base
        engine, *_ = trident.initialize(model=model, config=cfg, mesh=mesh)
        current = activation.settings_of(engine.module)
        seen.append((activation.settings() is user, current is user, current.cpu_checkpointing, current.profile))
    checkpointing.reset()
    return seen


def test_initialize_keeps_user_settings_and_clears_its_own():
    (seen,) = run_on_ranks(1, settings_after_initializes)
    assert seen == [(True, True, True, False), (True, False, False, True), (True, True, True, False)]
