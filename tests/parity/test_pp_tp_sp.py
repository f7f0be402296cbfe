"""The natively tensor-parallel pipeline GPT (`gpt_pipe(..., mesh=mesh, sequence_parallel=...)`)
trains to the same losses and weights as one process (fp32, rtol 1e-5).

Unlike test_pp_equivalence's tp case (a name plan over a plain pipeline, embeddings replicated),
here the token table is split by vocabulary and shared by the first and last stage, the loss is
the vocabulary-parallel cross-entropy, and with sequence parallelism the activations passed
between layers and between stages are each tp rank's slice of the sequence. Every run loads the
serial GPT's initial weights through `load_gpt_state_dict` (each tensor sliced by its tp_spec).
"""

from __future__ import annotations

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe, gpt_shard_specs, gpt_state_dict, load_gpt_state_dict
from trident.tensor_parallel import merge_state_dicts
from trident.testing.distributed import cached_mesh, run_on_ranks
from tests.parity.test_pp_equivalence import OPT_LR, SGD_CLIP, MODEL, check, make_gpt, make_tokens, pipe_steps
from trident.testing.parity import optimizer_section

STEPS = 6
MICRO = 2
MICRO_BATCHES = 4
CLIP = 0.05  # active on most steps: a tied or tp-split weight counted wrongly changes every update


def train_pp_tp(pp: int, tp: int, sequence_parallel: bool, optimizer: str = "adamw"):
    """Runs on every rank (dp = 1): returns losses, this rank's weights under GPT's names, their
    tp specs, (pp, dp, tp), the gradient norms and the shape of the activation the first stage
    passes on."""
    mesh = cached_mesh(pp=pp, tp=tp)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, pp, partition_method="uniform", stage_id=mesh.pp_rank, mesh=mesh,
                    sequence_parallel=sequence_parallel)
    load_gpt_state_dict(pipe, make_gpt().state_dict(), cfg)
    data = make_tokens(MICRO * MICRO_BATCHES)
    sent = None
    if pp > 1 and mesh.pp_rank == 0:
        with torch.no_grad():
            sent = tuple(pipe.run_chunk(0, data[:MICRO, :-1]).shape)
    config = {
        "train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": MICRO_BATCHES,
        "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
        "gradient_clipping": SGD_CLIP if optimizer == "sgd" else CLIP, "steps_per_print": 0,
        "pipeline": {"stages": pp, "schedule": "1f1b", "partition_method": "uniform"},
        "tensor_parallel": {"size": tp, "sequence_parallel": sequence_parallel},
    }
    engine, *_ = trident.initialize(model=pipe, config=config, mesh=mesh)
    losses, norms = pipe_steps(engine, mesh, data, STEPS, MICRO, MICRO * MICRO_BATCHES)  # dp = 1
    weights = {k: v.detach().float().clone() for k, v in gpt_state_dict(pipe, cfg).items()}
    specs = gpt_shard_specs(pipe, cfg)
    return losses, weights, specs, (mesh.pp_rank, mesh.dp_rank, mesh.tp_rank), norms, sent


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["no-sp", "sp"])
def test_pp2_tp2_tied_vocab_parallel_matches_serial(sequence_parallel):
    results = run_on_ranks(4, train_pp_tp, 2, 2, sequence_parallel)
    check(results, MICRO * MICRO_BATCHES, CLIP, steps=STEPS)
    seq = MODEL["seq_len"] // (2 if sequence_parallel else 1)
    assert [r[5] for r in results if r[3][0] == 0] == [(MICRO, seq, MODEL["d_model"])] * 2


def test_pp2_tp2_sp_sgd_with_active_clipping_matches_serial_norm_for_norm():
    """The vocabulary-split tied table (two stages, two slices each) counted once, slice by slice;
    the sequence-parallel layer norms' partial gradients reduced before they are counted."""
    check(run_on_ranks(4, train_pp_tp, 2, 2, True, "sgd"), MICRO * MICRO_BATCHES, SGD_CLIP, steps=STEPS,
          optimizer="sgd")


def test_pp1_tp2_sequence_parallel_matches_serial():
    check(run_on_ranks(2, train_pp_tp, 1, 2, True), MICRO * MICRO_BATCHES, CLIP, steps=STEPS)


def _untied_pipe(tp: int):
    """Runs on every rank: the untied tp pipe on one stage, loaded from a serial GPT; returns its
    weights under GPT's names, their tp specs and the serial weights."""
    cfg = GPTConfig(**{**MODEL, "tie_embeddings": False})
    pipe = gpt_pipe(cfg, 1, partition_method="uniform", stage_id=0, mesh=cached_mesh(tp=tp))
    torch.manual_seed(0)
    full = GPT(cfg).state_dict()
    load_gpt_state_dict(pipe, full, cfg)
    weights = {g: t.clone() for g, t in gpt_state_dict(pipe, cfg).items()}
    return weights, gpt_shard_specs(pipe, cfg), full


def test_untied_head_is_column_split_with_padded_vocab_and_round_trips():
    (w0, specs, full), (w1, _, _) = run_on_ranks(2, _untied_pipe, 2)
    assert specs["lm_head.weight"].tp_size == 2 and specs["embed.wte.weight"].tp_size == 2
    padded = -(-MODEL["vocab_size"] // 2) * 2
    assert w0["lm_head.weight"].shape == (padded // 2, MODEL["d_model"])
    merged = merge_state_dicts([w0, w1], specs)
    assert merged.keys() == full.keys()
    for key, tensor in full.items():
        torch.testing.assert_close(merged[key], tensor, rtol=0, atol=0)
