"""ZeRO-Offload and ZeRO-Infinity train to the same losses and weights as one process (fp32).

Each offload setting moves where the masters, optimizer states and (stage 3) parameter shards
live, never the maths: dp=2, 20 steps, the serial reference of test_dp_equivalence, rtol 1e-5.
Small `sub_group_size` and `buffer_count` so that several sub-groups and units are swapped,
read ahead and written behind on every step.
"""

from __future__ import annotations

import pytest

import trident
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close
from tests.parity.test_dp_equivalence import SGD_CLIP, check_clipped, make_model, mean_losses, serial_reference, train_steps
from tests.parity.test_zero_equivalence import zero_config


def offload_sections(optimizer: str, param: str, path: str) -> dict:
    out = {"offload_optimizer": {"device": optimizer, "pipeline_read": True, "pipeline_write": True,
                                 "buffer_count": 2},
           "offload_param": {"device": param, "buffer_count": 3}}
    for section in out.values():
        if section["device"] == "nvme":
            section["nvme_path"] = path
    return out


def train_offloaded(stage: int, optimizer: str, param: str, path: str, update: str = "adamw"):
    mesh = cached_mesh()
    clip = SGD_CLIP if update == "sgd" else 0.05
    cfg = zero_config(stage, 4, 1, clip, update, **offload_sections(optimizer, param, path))
    engine, _, _, _ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    try:
        losses, norms = train_steps(engine, mesh, 4, 1)
        weights = {k: v.float() for k, v in engine.consolidated_state_dict().items()}
        placed = engine.reducer.placement_bytes()
    finally:
        engine.reducer.close()
    return losses, weights, norms, placed


@pytest.mark.parametrize("stage,optimizer,param", [
    (1, "cpu", "none"), (2, "cpu", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"),
    (2, "nvme", "none"), (3, "nvme", "none"), (3, "nvme", "nvme"),
])
def test_offload_matches_serial(stage, optimizer, param, tmp_path):
    ref = serial_reference(8, 0.05)
    results = run_on_ranks(2, train_offloaded, stage, optimizer, param, str(tmp_path))
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    for _, weights, _, placed in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)
        if optimizer == "nvme" or param == "nvme":
            assert placed["nvme"] > 0
        else:
            assert placed["host"] > 0 and placed["nvme"] == 0
    assert list(tmp_path.iterdir()) == []  # swap files and locks removed by close()


@pytest.mark.parametrize("stage,optimizer,param", [(2, "cpu", "none"), (3, "nvme", "nvme")])
def test_offload_sgd_with_active_clipping_matches_serial_norm_for_norm(stage, optimizer, param, tmp_path):
    ref = serial_reference(8, SGD_CLIP, "sgd")
    results = run_on_ranks(2, train_offloaded, stage, optimizer, param, str(tmp_path), "sgd")
    check_clipped(results, ref)
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    for _, weights, _, _ in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)
