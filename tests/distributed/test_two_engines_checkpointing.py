"""Two engines in one process with different activation-checkpointing sections do not share
settings: each model owns the settings its config made, so building and training the second
engine changes nothing in the first. Each engine, built and trained interleaved with the other,
gives the losses it gives built alone, counts only its own checkpointed calls (profile), keeps
its own contiguous slots and, under tp=2, partitions its kept inputs exactly when its own
section says so. The process-wide settings of `trident.checkpointing.configure` stay untouched."""

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
STEPS = 3
ROWS = 2  # micro-batch


def train_together(tp: int, sections: list[dict | None]) -> list[dict]:
    """Build one engine per section (all before any training, so a later initialize could
    clobber an earlier one's settings), then train them a step each in turn. Per engine: its
    losses, bytes kept at the end of each forward, profiled calls, whether its kept inputs are
    partitioned, and the id of the settings its model uses."""
    mesh = cached_mesh(tp=tp)
    checkpointing.reset()
    engines = []
    for section in sections:
        cfg = {"train_micro_batch_size_per_gpu": ROWS, "steps_per_print": 0,
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "tensor_parallel": {"size": tp}}
        if section is not None:
            cfg["activation_checkpointing"] = section
        torch.manual_seed(0)
        engine, *_ = trident.initialize(model=GPT(CFG), config=cfg, mesh=mesh)
        engines.append(engine)
    data = [torch.Generator().manual_seed(1 + mesh.dp_rank) for _ in engines]
    out = [{"losses": [], "kept": []} for _ in engines]
    for step in range(STEPS):
        for engine, g, rec in zip(engines, data, out):
            torch.manual_seed(100 + step)  # dropout draws the same whatever the other engine drew
            idx = torch.randint(0, CFG.vocab_size, (ROWS, CFG.seq_len + 1), generator=g)
            tracker = LiveTensorBytes({p.untyped_storage().data_ptr() for p in engine.module.parameters()})
            with tracker:
                loss = engine(idx[:, :-1], idx[:, 1:])
                rec["kept"].append(tracker.live)
                engine.backward(loss)
            engine.step()
            rec["losses"].append(engine.last_loss)
    for engine, rec in zip(engines, out):
        own = activation.settings_of(engine.module)
        rec.update(calls=own.timings["calls"], partitioned=own.partition_group is not None, settings=id(own))
    out.append({"process_wide_configured": checkpointing.is_configured()})
    checkpointing.reset()
    return out


ALL_BLOCKS = [r"blocks\.\d+"]
# Three blocks checkpointed, one forward alive at a time: exactly 3 slots. Sharing the other
# engine's single slot would fail with "number_checkpoints=1 is too small".
THREE_SLOTS = {"layers": ALL_BLOCKS, "cpu_checkpointing": True, "contiguous_memory_optimization": True,
               "number_checkpoints": 3, "profile": True}
ONE_SLOT = {"layers": [r"blocks\.1"], "contiguous_memory_optimization": True, "number_checkpoints": 1,
            "profile": True}


@pytest.mark.parametrize("other", [ONE_SLOT, None, {"layers": ALL_BLOCKS, "every": 2}],
                         ids=["other-one-slot", "other-no-section", "other-selective-process-wide"])
def test_two_engines_keep_their_own_settings(other):
    """tp=1: engine A (cpu + contiguous 3 slots + profile, every block) next to B."""
    (together,) = run_on_ranks(1, train_together, 1, [THREE_SLOTS, other])
    (alone_a,) = run_on_ranks(1, train_together, 1, [THREE_SLOTS])
    (alone_b,) = run_on_ranks(1, train_together, 1, [other])
    a, b, process = together
    assert a["losses"] == alone_a[0]["losses"]
    assert b["losses"] == alone_b[0]["losses"]
    assert a["calls"] == 3 * STEPS  # its own blocks only, every step
    assert b["calls"] == (STEPS if other is ONE_SLOT else 0)
    assert a["settings"] != b["settings"]
    assert not process["process_wide_configured"]


def test_partitioned_engine_next_to_an_unpartitioned_one_under_tp2():
    """tp=2: A partitions its kept inputs over tp (and keeps them on the host); B checkpoints
    every second block with the process-wide (default) settings, unpartitioned."""
    a_section = {"layers": ALL_BLOCKS, "partition_activations": True, "cpu_checkpointing": True, "profile": True}
    b_section = {"layers": ALL_BLOCKS, "every": 2}
    together = run_on_ranks(2, train_together, 2, [a_section, b_section])
    alone_a = run_on_ranks(2, train_together, 2, [a_section])
    alone_b = run_on_ranks(2, train_together, 2, [b_section])
    # Tolerance: the vocab-parallel cross-entropy's small all-reduced tensors (4 fp32 per token)
    # are released by gloo's thread at a moment that races the count.
    race = 4 * ROWS * CFG.seq_len * 4
    for (a, b, process), (ref_a, _), (ref_b, _) in zip(together, alone_a, alone_b):
        assert a["losses"] == ref_a["losses"] and b["losses"] == ref_b["losses"]
        assert a["partitioned"] and not b["partitioned"]
        assert a["calls"] == 3 * STEPS and b["calls"] == 0
        assert a["settings"] != b["settings"]
        assert not process["process_wide_configured"]
        for kept, ref in zip(a["kept"] + b["kept"], ref_a["kept"] + ref_b["kept"]):
            assert abs(kept - ref) <= race
