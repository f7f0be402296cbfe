"""Tensor parallelism through `trident.initialize`, by config alone, and composed with data
parallelism and ZeRO on the dp axis: same losses and (merged) weights as one process."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import trident
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close
from tests.parity.test_dp_equivalence import (OPT_LR, SGD_CLIP, check_clipped, make_model, mean_losses,
                                             serial_reference, train_steps)
from trident.testing.parity import optimizer_section, precision_sections


class PlainMLP(nn.Module):
    """Written without trident: two linear layers named fc1 and fc2."""

    def __init__(self, d_in: int = 12, hidden: int = 32, d_out: int = 6):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, d_out)

    def forward(self, x, y):
        return nn.functional.mse_loss(self.fc2(torch.relu(self.fc1(x))), y)


def mlp_data(n: int):
    g = torch.Generator().manual_seed(2)
    return torch.randn(n, 12, generator=g), torch.randn(n, 6, generator=g)


def train_mlp(tp: int, steps: int = 20):
    mesh = cached_mesh(tp=tp) if tp > 1 else cached_mesh()
    torch.manual_seed(0)
    cfg = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 0, "gradient_clipping": 0.5,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "tensor_parallel": {"size": tp, "plan": {"fc1": "column", "fc2": "row"} if tp > 1 else None}}
    engine, *_ = trident.initialize(model=PlainMLP(), config=cfg, mesh=mesh)
    x, y = mlp_data(8 * steps)
    losses = []
    for step in range(steps):
        engine.backward(engine(x[step * 8:(step + 1) * 8], y[step * 8:(step + 1) * 8]))
        engine.step()
        losses.append(engine.last_loss)
    return losses, {k: v.detach().clone() for k, v in engine.module.state_dict().items()}, shard_specs(engine.module)


def test_plain_mlp_trains_under_tp_by_config_alone():
    (ref_losses, ref_weights, _), = run_on_ranks(1, train_mlp, 1)
    results = run_on_ranks(2, train_mlp, 2)
    for losses, _, _ in results:
        assert_losses_close(losses, ref_losses, rtol=1e-5)
    merged = merge_state_dicts([w for _, w, _ in results], results[0][2])
    assert_state_close(merged, ref_weights, rtol=1e-5)


def train_gpt(tp: int, stage: int, micro: int, clip: float, sequence_parallel: bool = False,
              optimizer: str = "adamw", precision: str = "fp32"):
    mesh = cached_mesh(tp=tp)
    cfg = {"train_micro_batch_size_per_gpu": micro, "steps_per_print": 0, "gradient_clipping": clip,
           "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
           "tensor_parallel": {"size": tp, "sequence_parallel": sequence_parallel},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": 3000}, **precision_sections(precision)}
    engine, *_ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    losses, norms = train_steps(engine, mesh, micro, 1)
    return losses, {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}, \
        shard_specs(engine.module), mesh.dp_rank, mesh.tp_rank, norms


def check_gpt(results, ref) -> None:
    by_dp = {}
    for losses, weights, specs, dp_rank, tp_rank, _ in results:
        by_dp.setdefault(dp_rank, {})[tp_rank] = (losses, weights, specs)
    assert_losses_close(mean_losses([by_dp[d][0] for d in sorted(by_dp)]), ref.losses, rtol=1e-5)
    for d, per_tp in by_dp.items():
        merged = merge_state_dicts([per_tp[t][1] for t in sorted(per_tp)], per_tp[0][2])
        assert_state_close(merged, ref.weights, rtol=1e-5)


@pytest.mark.parametrize("stage,sequence_parallel", [(0, False), (1, False), (2, False), (3, False), (1, True)])
def test_gpt_dp2_x_tp2_with_zero_matches_serial(stage, sequence_parallel):
    check_gpt(run_on_ranks(4, train_gpt, 2, stage, 4, 0.05, sequence_parallel), serial_reference(8, 0.05))


@pytest.mark.parametrize("tp,stage,sequence_parallel", [(2, 0, False), (2, 0, True), (2, 3, False)])
def test_gpt_tp_sgd_with_active_clipping_matches_serial_norm_for_norm(tp, stage, sequence_parallel):
    """tp-split weights counted slice by slice, tp-replicated layer norms once (with sequence
    parallelism their gradients are partial sums that must be reduced first)."""
    ref = serial_reference(8, SGD_CLIP, "sgd")
    world = 4 if stage else tp
    results = run_on_ranks(world, train_gpt, tp, stage, 8 * tp // world, SGD_CLIP, sequence_parallel, "sgd")
    check_clipped([(None, None, r[5]) for r in results], ref)
    check_gpt(results, ref)
