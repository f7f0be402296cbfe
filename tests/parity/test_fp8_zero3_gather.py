"""`fp8.all_gather` (ZeRO-3 gathers Float8Linear weights as float8 bytes) against torchao's own
single-process conversion, and the bytes it moves.

Each weight shard is cast with the scale of the whole weight (one all-reduce of the shards'
amaxes), so the gathered bytes are torchao's cast of the whole weight and the runs agree to
1e-6 (2 gloo ranks, fp32, SGD with momentum and active gradient clipping; the reference is
tests/parity/test_fp8_equivalence.py's, each rank's micro-batch in turn in one process).
Measured: equal; scaling each shard by its own amax instead puts the losses 1e-4 away.
"""

from __future__ import annotations

import pytest
import torch

import trident
from tests.parity.test_fp8_equivalence import FP8, STEPS, config, make_model, mean_losses, run_steps
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close

MOMENTUM, CLIP = 0.9, 0.5
GATHER = {**FP8, "all_gather": True}


def gather_config(all_gather: bool, recompute: bool, persistence: int, reuse: int, bf16: bool = False) -> dict:
    cfg = config(3, GATHER if all_gather else FP8, recompute)
    return {**cfg, "bf16": {"enabled": bf16}, "optimizer": {"type": "SGD", "params": {"lr": cfg["optimizer"]["params"]["lr"], "momentum": MOMENTUM}},
            "gradient_clipping": CLIP, "comms_logger": {"enabled": True},
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": persistence,
                                  "stage3_max_reuse_distance": reuse}}


def train(all_gather: bool, recompute: bool = False, persistence: int = 0, reuse: int = 1_000_000_000,
          bf16: bool = False):
    """Losses, whole weights, gradient norms, bytes by collective, and the units gathered
    in float8 (their padded element counts)."""
    mesh = cached_mesh()
    engine, *_ = trident.initialize(model=make_model(), config=gather_config(all_gather, recompute, persistence, reuse, bf16),
                                    mesh=mesh)
    engine.comms_logger.reset()
    losses, norms = run_steps(engine, mesh)
    traffic = {op: s.bytes for op, s in engine.comms_logger.totals().items()}  # over STEPS steps
    coord = engine.strategy.coordinator
    fp8_units = sorted(coord.numel(k) for k in coord.fp8.modules) if coord.fp8 is not None else []
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return losses, weights, norms, traffic, fp8_units


def train_both(bf16: bool = False):
    return train(True, reuse=0, bf16=bf16), train(False, reuse=0, bf16=bf16)  # each unit released after its forward


def check(results, ref):
    ref_losses, ref_weights = ref.losses, ref.weights
    assert_losses_close(mean_losses(results), ref_losses, rtol=1e-6)
    for r in results:
        assert min(r[2]) > CLIP  # clipping is active on every step
        for k in ref_weights:
            torch.testing.assert_close(r[1][k], ref_weights[k], rtol=1e-6, atol=1e-6)


def test_fp8_all_gather_matches_torchao_and_moves_a_quarter_of_the_fp32_bytes():
    """Every weight partitioned (persistence 0) and released after its forward (reuse distance
    0): gathered in float8 in forward and again in backward. The FP8 run's all-gathers move 3 bytes per element per gather less than the fp32
    run's for the 8 converted weights (forward and backward: 2 gathers per step), and its
    all-reduces 4 bytes per converted weight more (one amax each, one collective per step)."""
    ref = reference_with_clipping()
    both = run_on_ranks(2, train_both)
    check([fp8 for fp8, _ in both], ref)
    check([plain for _, plain in both], ref)  # the comparison run is the same computation
    fp8, plain = both[0]
    assert len(fp8[4]) == 8 and plain[4] == []
    saved = plain[3]["all_gather"] - fp8[3]["all_gather"]
    assert saved == STEPS * 3 * 2 * sum(fp8[4]), (saved, fp8[4])
    assert fp8[3].get("all_reduce", 0) - plain[3].get("all_reduce", 0) == STEPS * 4 * len(fp8[4])


@pytest.mark.parametrize("recompute,persistence", [(True, 0), (False, 100_000)])
def test_fp8_all_gather_with_recompute_and_persistent_weights(recompute, persistence):
    """Activation checkpointing (the forward's float8 gathers again in the recompute), and
    weights below the persistence threshold (gathered in float8 once after each step and kept)."""
    results = run_on_ranks(2, train, True, recompute, persistence)
    check(results, reference_with_clipping())
    assert all(len(r[4]) == 8 for r in results)


def reference_with_clipping():
    from tests.parity.test_fp8_equivalence import reference
    return reference(2, FP8, MOMENTUM, CLIP)


def test_fp8_all_gather_in_bf16_is_bitwise_the_bf16_gather_and_halves_its_bytes():
    """bf16 weights: the same run with the weights gathered in bf16 and cast whole by torchao
    (fp8.all_gather false) gives the same losses and weights bit for bit; the gathers of the
    converted weights move 1 byte per element instead of 2."""
    fp8, plain = run_on_ranks(2, train_both, True)[0]
    assert fp8[0] == plain[0]
    for k in plain[1]:
        assert torch.equal(fp8[1][k], plain[1][k]), k
    assert plain[3]["all_gather"] - fp8[3]["all_gather"] == STEPS * 1 * 2 * sum(fp8[4])
