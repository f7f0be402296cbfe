"""ZeRO stages 1-3 train to the same losses and weights as one process (fp32, rtol 1e-5).

Same serial reference as tests/parity/test_dp_equivalence.py: plain PyTorch on the whole global
batch, AdamW, torch's clip_grad_norm_. Small buckets and sub-groups so that every code path
with several units, several reduce-scatters in flight and a stepped-in-pieces optimizer runs.
"""

from __future__ import annotations

import pytest

import trident
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close
from tests.parity.test_dp_equivalence import (OPT_LR, SGD_CLIP, check_clipped, make_model, mean_losses,
                                             serial_reference, train_steps)
from trident.testing.parity import optimizer_section


def zero_config(stage: int, micro: int, gas: int, clip: float, optimizer: str = "adamw", **zero) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
        "gradient_clipping": clip,
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000, "allgather_bucket_size": 5000,
                              "sub_group_size": 2000, "stage3_param_persistence_threshold": 100,
                              "stage3_prefetch_bucket_size": 4000, **zero},
        "steps_per_print": 0,
    }


def train_zero(stage: int, micro: int, gas: int, clip: float, zero: dict, optimizer: str = "adamw"):
    mesh = cached_mesh()
    engine, _, _, _ = trident.initialize(model=make_model(), config=zero_config(stage, micro, gas, clip, optimizer,
                                                                                **zero), mesh=mesh)
    losses, norms = train_steps(engine, mesh, micro, gas)
    weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
    return losses, weights, norms


CASES = [(2, 4, 1, 0.0), (4, 2, 1, 0.05), (2, 2, 2, 0.05)]


@pytest.mark.parametrize("stage", [1, 2, 3])
@pytest.mark.parametrize("world,micro,gas,clip", CASES)
def test_zero_matches_serial(stage, world, micro, gas, clip):
    ref = serial_reference(micro * gas * world, clip)
    results = run_on_ranks(world, train_zero, stage, micro, gas, clip, {})
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    for _, weights, _ in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)


@pytest.mark.parametrize("stage,zero", [
    (1, {}), (2, {}),
    (3, {}),                                              # layer norms persistent (whole on every rank)
    (3, {"stage3_param_persistence_threshold": 0}),      # every parameter partitioned
])
@pytest.mark.parametrize("world,micro,gas", [(2, 2, 2), (4, 2, 1)])
def test_zero_sgd_with_active_clipping_matches_serial_norm_for_norm(stage, zero, world, micro, gas):
    """Each gradient element counted once: shards, padding and persistent parameters alike."""
    ref = serial_reference(micro * gas * world, SGD_CLIP, "sgd")
    results = run_on_ranks(world, train_zero, stage, micro, gas, SGD_CLIP, zero, "sgd")
    check_clipped(results, ref)
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    for _, weights, _ in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)


@pytest.mark.parametrize("stage,zero", [
    (1, {"reduce_scatter": False, "overlap_comm": False}),
    (2, {"contiguous_gradients": False, "round_robin_gradients": True}),
    (2, {"reduce_scatter": False, "overlap_comm": False, "sub_group_size": 100_000}),
    (3, {"stage3_prefetch_bucket_size": 0, "stage3_max_reuse_distance": 0, "contiguous_gradients": False,
         "reduce_scatter": False}),
    (3, {"stage3_max_live_parameters": 0, "reduce_bucket_size": 100_000, "overlap_comm": False}),
])
def test_zero_switches_keep_the_maths(stage, zero):
    ref = serial_reference(8, 0.05)
    results = run_on_ranks(2, train_zero, stage, 4, 1, 0.05, zero)
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    for _, weights, _ in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)
