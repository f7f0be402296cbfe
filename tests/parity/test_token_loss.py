"""Token-weighted loss (`data.loss_normalization`): packed and bucketed batches train the same
whatever the micro-batch split, under accumulation, data, tensor, pipeline and context
parallelism.

Rows hold different numbers of counted tokens: packed rows lose the target of each document's
last token (-100 at the boundary) and may end in padding, bucketed rows end in padding (-100), and the rows of one half
of every global batch (one dp rank's share) count far fewer tokens than the other's (more than
2x apart). The serial reference is plain PyTorch on the whole global batch, whose loss is GPT's
mean over every counted token of it; every layout must match it step for step (losses, and for
clipped SGD the gradient norms) and in the final weights, with clipped SGD + momentum and AdamW,
to 1e-6. The mean of the micro-batches' means (`"micro_batch"`) is off by 1e-3 here.
"""

from __future__ import annotations

import functools

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.models.gpt_pipe import gpt_pipe, gpt_state_dict, gpt_shard_specs, load_gpt_state_dict
from trident.tensor_parallel import merge_state_dicts, shard_specs
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (assert_losses_close, assert_norms_close, assert_state_close, optimizer_section,
                                    train_serial)

MODEL = dict(vocab_size=64, seq_len=32, n_layer=2, n_head=2, d_model=32, dropout=0.0)
GLOBAL, STEPS, CLIP = 16, 4, 0.05
RTOL = {"sgd": 1e-6, "adamw": 1e-5}
"""Clipped SGD moves every weight by exactly the normalization's factor: 1e-6. AdamW divides by
each entry's own second moment, which turns the rounding of near-zero gradient entries (summed in
another order) into visible steps at ~1.5e-6 even for one process with one micro-batch: the
suite's usual 1e-5 there."""
LR = {"sgd": 0.5, "adamw": 3e-3}
ADAM_EPS = 1e-6
"""Some bias gradients are near 1e-8: with Adam's default eps their rounding noise (the
token-weighted gradient is the same sum, added in another order) would become visible steps."""


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


@functools.lru_cache(maxsize=None)
def batches(kind: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches of GLOBAL rows: (inputs, targets with -100 where nothing counts)."""
    g = torch.Generator().manual_seed(7)
    seq = MODEL["seq_len"]
    out = []
    for _ in range(STEPS):
        tokens = torch.randint(0, MODEL["vocab_size"], (GLOBAL, seq + 1), generator=g)
        targets = tokens[:, 1:].clone()
        for row in range(GLOBAL):
            sparse = row >= GLOBAL // 2  # the second half of the batch counts far fewer tokens
            if kind == "packed":  # documents of 12 tokens; the sparse half: short ones, then the row's padding
                length = int(torch.randint(2, 5, (), generator=g)) if sparse else 12
                targets[row, length - 1::length] = -100
                if sparse:
                    targets[row, int(torch.randint(8, 16, (), generator=g)):] = -100
            else:  # bucketed: a document, then padding
                length = int(torch.randint(3, 9, (), generator=g)) if sparse else int(torch.randint(24, seq + 1, (), generator=g))
                targets[row, length - 1:] = -100
        out.append((tokens[:, :-1], targets))
    return out


def counts(kind: str) -> list[tuple[int, int]]:
    """Counted tokens of each half of each global batch."""
    half = GLOBAL // 2
    return [(int((y[:half] != -100).sum()), int((y[half:] != -100).sum())) for _, y in batches(kind)]


@functools.lru_cache(maxsize=None)
def reference(kind: str, optimizer: str):
    return train_serial(make_model(), batches(kind), optimizer, LR[optimizer], CLIP, eps=ADAM_EPS)


def config(optimizer: str, micro: int, gas: int, **sections) -> dict:
    return {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 0,
            "gradient_clipping": CLIP, "optimizer": optimizer_section(optimizer, LR[optimizer], eps=ADAM_EPS),
            "data": {"loss_normalization": "tokens"}, **sections}


def train_flat(kind: str, optimizer: str, micro: int, gas: int, tp: int = 1, cp: int = 1):
    """Runs on every rank: the GPT under dp (x tp or x cp), `micro` x `gas` rows per dp rank."""
    mesh = cached_mesh(tp=tp, cp=cp)
    torch.manual_seed(0)  # a tp model draws the whole weights from the seed, then keeps its slices
    model = GPT(GPTConfig(**MODEL), mesh) if tp > 1 else make_model()
    sections = {"tensor_parallel": {"size": tp}, "context_parallel": {"size": cp}}
    engine, *_ = trident.initialize(model=model, config=config(optimizer, micro, gas, **sections), mesh=mesh)
    losses, norms, tokens = [], [], []
    for step in range(STEPS):
        x, y = batches(kind)[step]
        per = GLOBAL // mesh.dp_size
        x, y = x[mesh.dp_rank * per:][:per], y[mesh.dp_rank * per:][:per]
        for k in range(gas):
            engine.backward(engine(x[k * micro:(k + 1) * micro], y[k * micro:(k + 1) * micro]))
            engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
        tokens.append(engine.tokens_in_step)
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return losses, norms, tokens, weights, shard_specs(engine.module), mesh.tp_rank


def train_pipe(kind: str, optimizer: str, micro: int, micro_batches: int):
    """Runs on every rank: the GPT as 2 pipeline stages (1F1B), the global batch in micro-batches."""
    mesh = cached_mesh(pp=2)
    cfg = GPTConfig(**MODEL)
    pipe = gpt_pipe(cfg, 2, partition_method="uniform", stage_id=mesh.pp_rank)
    load_gpt_state_dict(pipe, make_model().state_dict(), cfg)
    sections = {"pipeline": {"stages": 2, "schedule": "1f1b", "partition_method": "uniform"}}
    engine, *_ = trident.initialize(model=pipe, config=config(optimizer, micro, micro_batches, **sections), mesh=mesh)
    losses, norms, tokens = [], [], []
    for step in range(STEPS):
        x, y = batches(kind)[step]
        losses.append(float(engine.train_batch(iter([(x[k:k + micro], y[k:k + micro]) for k in range(0, GLOBAL, micro)]))))
        norms.append(engine.get_global_grad_norm())
        tokens.append(engine.tokens_in_step)
    return losses, norms, tokens, {k: v.float() for k, v in gpt_state_dict(pipe, cfg).items()}, gpt_shard_specs(pipe, cfg), 0


LAYOUTS = {
    # name: (world, runner, args)
    "1x16": (1, train_flat, dict(micro=16, gas=1)),
    "1x8x2": (1, train_flat, dict(micro=8, gas=2)),
    "2x8": (2, train_flat, dict(micro=8, gas=1)),
    "2x4x2": (2, train_flat, dict(micro=4, gas=2)),
    "tp2": (2, train_flat, dict(micro=8, gas=2, tp=2)),
    "cp2": (2, train_flat, dict(micro=8, gas=2, cp=2)),
    "pp2": (2, train_pipe, dict(micro=4, micro_batches=4)),
}


def check(kind: str, optimizer: str, results) -> None:
    ref, rtol = reference(kind, optimizer), RTOL[optimizer]
    totals = [a + b for a, b in counts(kind)]
    for losses, norms, tokens, _, _, _ in results:
        assert_losses_close(losses, ref.losses, rtol=rtol)
        assert tokens == totals, (tokens, totals)
        if optimizer == "sgd":
            assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
            assert_norms_close(norms, ref.norms, rtol=rtol)
    shards = {tp_rank: (weights, specs) for *_, weights, specs, tp_rank in results}
    if len(shards) > 1:  # tp: merge the slices
        weights = merge_state_dicts([shards[r][0] for r in sorted(shards)], shards[0][1])
    else:  # dp / cp replicas hold the same weights, pipeline stages their own
        weights = {k: v for *_, w, _, _ in results for k, v in w.items()}
    assert_state_close(weights, ref.weights, rtol=rtol)


def test_the_data_has_ragged_counts():
    for kind in ("packed", "bucketed"):
        assert all(a > 2 * b for a, b in counts(kind)), counts(kind)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("kind", ["packed", "bucketed"])
def test_token_weighted_loss_is_independent_of_the_split(kind, layout, optimizer):
    world, runner, args = LAYOUTS[layout]
    check(kind, optimizer, run_on_ranks(world, runner, kind, optimizer, **args))


def test_the_mean_of_micro_batch_means_is_what_would_differ():
    """The same 2-rank run with `"micro_batch"`: its losses are off by more than 1e-4 on this data."""
    losses, tokens = run_on_ranks(2, train_flat_micro_batch, "packed", "sgd")[0]
    ref = reference("packed", "sgd")
    assert max(abs(a - b) / abs(b) for a, b in zip(losses, ref.losses)) > 1e-4
    assert tokens is None


def train_flat_micro_batch(kind: str, optimizer: str):
    """Runs on every rank: 2 dp ranks x 8 rows with `data.loss_normalization: "micro_batch"`."""
    mesh = cached_mesh()
    cfg = config(optimizer, 8, 1)
    cfg["data"] = {"loss_normalization": "micro_batch"}
    engine, *_ = trident.initialize(model=make_model(), config=cfg, mesh=mesh)
    losses = []
    for step in range(STEPS):
        x, y = batches(kind)[step]
        engine.backward(engine(x[mesh.dp_rank * 8:][:8], y[mesh.dp_rank * 8:][:8]))
        engine.step()
        losses.append(sum(_all(engine.last_loss)) / mesh.dp_size)
    return losses, engine.tokens_in_step


def _all(value: float) -> list[float]:
    import torch.distributed as dist
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out
