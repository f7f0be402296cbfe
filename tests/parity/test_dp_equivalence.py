"""Data parallelism trains to the same losses and weights as one process (fp32, rtol 1e-5).

The serial reference is plain PyTorch in the test process: one forward over the whole global
batch per step, AdamW, torch's clip_grad_norm_. The parallel run is trident on N gloo ranks,
each rank feeding its own micro-batches of the same global batch.
"""

from __future__ import annotations

import functools

import pytest
import torch

import trident
from trident.models.gpt import GPT, GPTConfig
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import (SerialRun, assert_losses_close, assert_norms_close, assert_state_close,
                                    optimizer_section, train_serial)

STEPS = 20
# No biases: the key bias gets a zero gradient in exact arithmetic (softmax ignores a shift),
# so its gradient is pure rounding noise, which Adam normalises up to full-size steps.
MODEL = dict(vocab_size=61, seq_len=16, n_layer=2, n_head=2, d_model=32, dropout=0.0, bias=False)
LR = 3e-3
OPT_LR = {"adamw": LR, "sgd": 0.5}
SGD_CLIP = 0.05  # below the gradient norm on every step of every SGD case


def make_model() -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**MODEL))


def make_tokens(global_batch: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, MODEL["vocab_size"], (STEPS * global_batch, MODEL["seq_len"] + 1), generator=g)


def config(micro: int, gas: int, clip: float, precision: str = "fp32", optimizer: str = "adamw") -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "optimizer": optimizer_section(optimizer, OPT_LR[optimizer]),
        "gradient_clipping": clip,
        "bf16": {"enabled": precision == "bf16"},
        "communication_data_type": "fp32",  # gradients summed in fp32 (DeepSpeed's default in bf16 is bf16)
        # small buckets so several all-reduces overlap with backward
        "zero_optimization": {"stage": 0, "reduce_bucket_size": 5000},
        "steps_per_print": 0,
    }


@functools.lru_cache(maxsize=None)
def serial_reference(global_batch: int, clip: float, optimizer: str = "adamw") -> SerialRun:
    data = make_tokens(global_batch)
    batches = [(b[:, :-1], b[:, 1:]) for b in data.split(global_batch)]
    return train_serial(make_model(), batches, optimizer, OPT_LR[optimizer], clip)


def train_dp(micro: int, gas: int, clip: float, precision: str = "fp32", optimizer: str = "adamw"):
    """Runs on every rank: trident data parallel over the whole world."""
    mesh = cached_mesh()
    engine, _, _, _ = trident.initialize(model=make_model(), config=config(micro, gas, clip, precision, optimizer),
                                         mesh=mesh)
    losses, norms = train_steps(engine, mesh, micro, gas)
    weights = {k: v.detach().float().clone() for k, v in engine.module.state_dict().items()}
    return losses, weights, norms


def train_steps(engine, mesh, micro: int, gas: int) -> tuple[list[float], list[float | None]]:
    """STEPS optimizer steps on this rank's share of each global batch; the per-step losses and
    global gradient norms."""
    global_batch = micro * gas * mesh.dp_size
    losses, norms = train_range(engine, mesh, make_tokens(global_batch), 0, STEPS, micro, global_batch)
    assert engine.global_steps == STEPS
    return losses, norms


def train_range(engine, mesh, data, first: int, last: int, micro: int, global_batch: int):
    """Optimizer steps first..last-1, each on this dp rank's micro-batches of a global batch of
    `data` rows; the per-step losses and global gradient norms."""
    gas = global_batch // (micro * mesh.dp_size)
    losses, norms = [], []
    for step in range(first, last):
        for k in range(gas):
            start = step * global_batch + (mesh.dp_rank * gas + k) * micro
            batch = data[start:start + micro]
            engine.backward(engine(batch[:, :-1], batch[:, 1:]))
            engine.step()
        losses.append(engine.last_loss)
        norms.append(engine.get_global_grad_norm())
    return losses, norms


def mean_losses(results) -> list[float]:
    per_rank = [r[0] for r in results]
    return [sum(step) / len(step) for step in zip(*per_rank)]


def check_clipped(results, ref: SerialRun) -> None:
    """SGD runs: clipping was active on every step, and every rank's global gradient norm equals
    the serial one (rel 1e-6) on every step."""
    assert max(ref.clip_coefs) < 1.0, f"clipping inactive on some step: {ref.clip_coefs}"
    for r in results:
        assert_norms_close(r[2], ref.norms, rtol=1e-6)


@pytest.mark.parametrize("world,micro,gas,clip", [
    (2, 4, 1, 0.0),
    (4, 2, 1, 0.0),
    (2, 2, 2, 0.0),   # accumulation inside data parallelism
    (2, 4, 1, 0.05),  # clipping active on most steps
])
def test_dp_matches_serial(world, micro, gas, clip):
    ref = serial_reference(micro * gas * world, clip)
    results = run_on_ranks(world, train_dp, micro, gas, clip)
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    for _, weights, _ in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)


@pytest.mark.parametrize("world,micro,gas", [(2, 4, 1), (2, 2, 2), (4, 2, 1)])
def test_dp_sgd_with_active_clipping_matches_serial_norm_for_norm(world, micro, gas):
    ref = serial_reference(micro * gas * world, SGD_CLIP, "sgd")
    results = run_on_ranks(world, train_dp, micro, gas, SGD_CLIP, "fp32", "sgd")
    check_clipped(results, ref)
    assert_losses_close(mean_losses(results), ref.losses, rtol=1e-5)
    for _, weights, _ in results:
        assert_state_close(weights, ref.weights, rtol=1e-5)


def test_accumulation_equals_large_micro_batch():
    """micro 2 x gas 4 == micro 8 x gas 1 on one rank, with clipping on."""
    ref = serial_reference(8, 0.05)
    (a_losses, a_weights, _), = run_on_ranks(1, train_dp, 2, 4, 0.05)
    (b_losses, b_weights, _), = run_on_ranks(1, train_dp, 8, 1, 0.05)
    assert_losses_close(a_losses, b_losses, rtol=1e-5)
    assert_state_close(a_weights, b_weights, rtol=1e-5)
    assert_losses_close(a_losses, ref.losses, rtol=1e-5)
    assert_state_close(a_weights, ref.weights, rtol=1e-5)


def test_bf16_dp_matches_bf16_accumulation_and_tracks_fp32():
    """bf16 with fp32 master weights: dp=2 x micro 4 against one rank with micro 4 x gas 2.

    Both runs compute the same bf16 micro-batches (halving a loss is exact in any float
    format) and sum their gradients in fp32, so they agree to fp32 rounding (rtol 1e-5).
    Against fp32 serial training only the loss is compared, within 2%: bf16 keeps 8
    significant bits, and Adam turns that noise into different (equally good) steps.
    """
    results = run_on_ranks(2, train_dp, 4, 1, 0.0, "bf16")
    (acc_losses, acc_weights, _), = run_on_ranks(1, train_dp, 4, 2, 0.0, "bf16")
    assert_losses_close(mean_losses(results), acc_losses, rtol=1e-5)
    for _, weights, _ in results:
        assert_state_close(weights, acc_weights, rtol=1e-5)
    assert_losses_close(mean_losses(results), serial_reference(8, 0.0).losses, rtol=2e-2)
