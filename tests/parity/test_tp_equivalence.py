"""The tensor-parallel GPT trains to the same losses and weights as one process (fp32, rtol 1e-5).

Every run builds the model from the same seed and trains 20 AdamW steps on the same batches
with a plain loop. Without dropout the reference is the plain GPT (no mesh) in the test
process. With dropout the reference is one process running the mesh-built GPT at tp=1: its
attention dropout draws each head's mask from that head's own stream, which is what makes
the masks independent of the tp size (trident.parallel.rng); the plain GPT's fused attention
draws its masks differently. The tp ranks' shards are merged back (split.merge_state_dicts,
which also checks that replicated weights are identical on every tp rank) and compared with
the reference weights tensor by tensor.
"""

from __future__ import annotations

import functools

import pytest
import torch

from trident.comm.logger import CommsLogger
from trident.models.gpt import GPT, GPTConfig
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close

STEPS = 20
BATCH = 4
# At lr 3e-3 a few weights with rounding-level gradients (~1e-8) take Adam steps that differ
# between summation orders and the drift reaches ~1e-5 by step 20; at 1e-3 it stays below 2e-6.
LR = 1e-3
# vocab 61 is padded at tp=2 and tp=4. No biases: the key bias gets a zero gradient in exact
# arithmetic, so its gradient is rounding noise that Adam would scale up to full-size steps.
MODEL = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=4, d_model=32, bias=False)


def make_tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * BATCH, MODEL["seq_len"] + 1), generator=g)


def train(model: GPT) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = make_tokens()
    losses = []
    for step in range(STEPS):
        batch = data[step * BATCH:(step + 1) * BATCH]
        loss = model(batch[:, :-1], batch[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def train_tp(tp: int, sequence_parallel: bool, dropout: float):
    """On every rank of a tp-only mesh: losses, this rank's state dict and the shard specs."""
    mesh = cached_mesh(tp=tp)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**MODEL, dropout=dropout), mesh, sequence_parallel=sequence_parallel)
    losses = train(model)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, shard_specs(model)


@functools.lru_cache(maxsize=None)
def reference(dropout: float) -> tuple[list[float], dict[str, torch.Tensor]]:
    if dropout == 0.0:
        torch.manual_seed(0)
        model = GPT(GPTConfig(**MODEL))
        return train(model), {k: v.detach().clone() for k, v in model.state_dict().items()}
    (losses, state, _), = run_on_ranks(1, train_tp, 1, False, dropout)
    return losses, state


@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("tp", [2, 4])
def test_tp_gpt_matches_one_process(tp, sequence_parallel, dropout):
    ref_losses, ref_state = reference(dropout)
    if dropout:
        assert ref_losses != reference(0.0)[0]  # the masks are live
    results = run_on_ranks(tp, train_tp, tp, sequence_parallel, dropout)
    losses = [r[0] for r in results]
    assert all(rank_losses == losses[0] for rank_losses in losses)  # the loss is all-reduced: one value
    assert_losses_close(losses[0], ref_losses, rtol=1e-5)
    merged = merge_state_dicts([r[1] for r in results], results[0][2])
    assert_state_close(merged, ref_state, rtol=1e-5)


def count_gpt_comms(sequence_parallel: bool, bias: bool) -> dict[str, tuple[int, int]]:
    """(calls, bytes) per op of one training step of the GPT at tp=2."""
    mesh = cached_mesh(tp=2)
    logger = CommsLogger(enabled=True)
    torch.manual_seed(0)
    model = GPT(GPTConfig(**{**MODEL, "bias": bias}), mesh, sequence_parallel=sequence_parallel, logger=logger)
    batch = make_tokens()[:BATCH]
    model(batch[:, :-1], batch[:, 1:]).backward()
    return {op: (s.calls, s.bytes) for op, s in logger.totals().items()}


def test_communication_per_step():
    """2 + 2 all-reduces per block, and the same with all-gather / reduce-scatter under SP."""
    layers, d, rows = MODEL["n_layer"], MODEL["d_model"], BATCH * MODEL["seq_len"]
    act = rows * d * 4  # one full activation [B, T, d] in fp32
    loss_bytes = rows * 4 + 3 * rows * 4  # cross-entropy: the row max, then (sum-exp, target, sum) per row
    # per block 2 forward (attn.proj, mlp.proj) + 2 backward (attn.qkv, mlp.fc input gradients);
    # plus the embedding's forward sum, lm_head's input gradient and the loss's two
    plain = run_on_ranks(2, count_gpt_comms, False, False)
    for counts in plain:
        assert counts == {"all_reduce": (4 * layers + 4, (4 * layers + 2) * act + loss_bytes)}
    # SP: per block 2 all-gathers forward (qkv, fc inputs) and 2 backward (from attn.proj, mlp.proj);
    # the reduce-scatters mirror them; + the embedding (reduce-scatter / all-gather) and lm_head
    # (all-gather / reduce-scatter). All-reduces: the loss's 2, plus one per replicated parameter
    # used on sequence shards (ln_1, ln_2 per block, ln_f, wpe; weights and biases).
    for bias, replicated in ((False, [d] * (2 * layers + 1) + [MODEL["seq_len"] * d]),
                             (True, [d] * (6 * layers + 2) + [MODEL["seq_len"] * d])):
        for counts in run_on_ranks(2, count_gpt_comms, True, bias):
            assert counts == {"all_gather": (4 * layers + 2, (4 * layers + 2) * act),
                              "reduce_scatter": (4 * layers + 2, (4 * layers + 2) * act),
                              "all_reduce": (2 + len(replicated), loss_bytes + 4 * sum(replicated))}
