"""3D parallelism end to end: pipeline x data x tensor parallelism with ZeRO-1 on the dp axis,
1F1B, tied input/output embeddings across the first and last stage, sequence parallelism and
activation checkpointing (partitioned over tp), trains to the same losses and weights as one
process (fp32, rtol 1e-5, 10 steps).

The model is the reference GPT written as a PipelineModule whose layers are tensor-parallel
natively (`gpt_pipe(..., mesh=mesh, sequence_parallel=True)`), loaded with the serial GPT's
initial weights; the serial reference is the plain GPT in the test process on the whole global
batch. 2x2x2 needs 8 ranks (marked `eight_ranks`); 1x2x2 and 2x1x2 run on 4.
"""

from __future__ import annotations

import pytest

import trident
from trident.recompute import activation
from trident.models.gpt import GPTConfig
from trident.models.gpt_pipe import gpt_pipe, gpt_shard_specs, gpt_state_dict, load_gpt_state_dict
from trident.testing.distributed import cached_mesh, run_on_ranks
from tests.parity.test_pp_equivalence import OPT_LR, SGD_CLIP, MODEL, make_gpt, make_tokens, pipe_steps
from trident.testing.parity import optimizer_section, precision_sections
from tests.parity.test_pp_equivalence import check as pp_check

STEPS = 10
MICRO = 2
GLOBAL = 8   # sequences per optimizer step under every layout
CLIP = 0.05


def train_3d(pp: int, tp: int, sequence_parallel: bool, recompute: bool, optimizer: str = "adamw",
             precision: str = "fp32"):
    """Runs on every rank: dp = world / (pp tp). Returns losses, this rank's weights under GPT's
    names, their tp specs, the rank's (pp, dp, tp) coordinates, the gradient norms and whether the
    checkpointed inputs were partitioned."""
    mesh = cached_mesh(pp=pp, tp=tp)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, pp, partition_method="uniform", stage_id=mesh.pp_rank, mesh=mesh,
                    sequence_parallel=sequence_parallel, activation_checkpoint_interval=1 if recompute else 0)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    gas = GLOBAL // (MICRO * mesh.dp_size)
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": gas,
        "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
        "gradient_clipping": SGD_CLIP if optimizer == "sgd" else CLIP, "steps_per_print": 0,
        "zero_optimization": {"stage": 1},
        "pipeline": {"stages": pp, "schedule": "1f1b", "partition_method": "uniform"},
        "tensor_parallel": {"size": tp, "sequence_parallel": sequence_parallel},
        "activation_checkpointing": {"partition_activations": recompute and tp > 1,
                                     "cpu_checkpointing": recompute},
        **precision_sections(precision),
    }
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    losses, norms = pipe_steps(engine, mesh, make_tokens(GLOBAL), STEPS, MICRO, GLOBAL)
    weights = {k: v.detach().float().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    specs = gpt_shard_specs(pipe, cfg)
    partitioned = activation.settings_of(pipe).partition_group is not None
    return losses, weights, specs, (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), norms, partitioned


def check(results, optimizer: str = "adamw") -> None:
    pp_check(results, GLOBAL, SGD_CLIP if optimizer == "sgd" else CLIP, steps=STEPS, optimizer=optimizer)


@pytest.mark.eight_ranks
def test_2x2x2_zero1_1f1b_tied_sp_checkpointing_matches_serial():
    check(run_on_ranks(8, train_3d, 2, 2, True, True, timeout=600))


@pytest.mark.parametrize("pp,tp,sp", [(1, 2, True), (2, 2, False)], ids=["1x2x2-sp", "2x1x2-partitioned"])
def test_smaller_3d_layouts_match_serial(pp, tp, sp):
    """1x2x2: dp 2 x tp 2 on one stage, sequence parallel; 2x1x2: two stages of tp 2, no data
    parallelism, the checkpointed layer inputs partitioned over tp (replicated without SP)."""
    results = run_on_ranks(4, train_3d, pp, tp, sp, True)
    assert all(r[5] != sp for r in results)  # partitioned exactly when the inputs are replicated over tp
    check(results)


@pytest.mark.parametrize("pp,tp,sp", [(1, 2, True), (2, 2, False)], ids=["1x2x2-sp", "2x1x2"])
def test_3d_sgd_with_active_clipping_matches_serial_norm_for_norm(pp, tp, sp):
    """ZeRO-1 shards over dp, tp slices, stages and the tied table: each element counted once."""
    check(run_on_ranks(4, train_3d, pp, tp, sp, True, "sgd"), "sgd")
