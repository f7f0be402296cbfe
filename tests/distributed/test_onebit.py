"""The 1-bit compressed all-reduce (trident.compression.onebit) on real gloo groups, against its
formula written out per segment, and the bad-input errors of the 1-bit optimizers."""

from __future__ import annotations

import math

import pytest
import torch

import trident
from trident.comm.logger import CommsLogger
from trident.compression.onebit import CompressedAllReduce, pack_signs, unpack_signs
from trident.config.errors import ConfigError
from trident.testing.distributed import cached_mesh, run_on_ranks

NUMELS = [5, 64, 37, 1]  # uneven, one smaller than a byte, one below every rank's share
CALLS = 3


def rank_input(rank: int, call: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 * call + rank)
    return [torch.randn(n, generator=g) * (s + 1) for s, n in enumerate(NUMELS)]


def sgn(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, 1.0, -1.0)


def reference(world: int) -> list[list[torch.Tensor]]:
    """The paper's two-level compression with error feedback, one segment at a time, computed
    for every rank from everyone's inputs; returns each call's averaged segments."""
    unit = 8 * world
    padded = [max(unit, math.ceil(n / unit) * unit) for n in NUMELS]
    worker = [[torch.zeros(p) for p in padded] for _ in range(world)]
    server = [[torch.zeros(p // world) for p in padded] for _ in range(world)]
    results = []
    for call in range(CALLS):
        out = []
        for s, (n, p) in enumerate(zip(NUMELS, padded)):
            c = p // world
            compressed = []
            for r in range(world):
                x = torch.zeros(p)
                x[:n] = rank_input(r, call)[s]
                x += worker[r][s]
                scale = x.norm() / math.sqrt(p)
                worker[r][s] = x - scale * sgn(x)
                compressed.append(scale * sgn(x))
            chunks = []
            for owner in range(world):
                y = sum(compressed[r][owner * c:(owner + 1) * c] for r in range(world)) / world
                y = y + server[owner][s]
                scale = y.norm() / math.sqrt(c)
                server[owner][s] = y - scale * sgn(y)
                chunks.append(scale * sgn(y))
            out.append(torch.cat(chunks)[:n])
        results.append(out)
    return results


def run_compressed(world: int) -> tuple[list[list[torch.Tensor]], dict]:
    mesh = cached_mesh()
    log = CommsLogger(enabled=True)
    comm = CompressedAllReduce(NUMELS, mesh.dp_group, torch.device("cpu"), logger=log)
    outs = []
    for call in range(CALLS):
        tensors = rank_input(mesh.dp_rank, call)
        comm(tensors)
        outs.append([t.clone() for t in tensors])
    return outs, {op: (s.calls, s.bytes) for op, s in log.totals().items()}


@pytest.mark.parametrize("world", [2, 4])
def test_compressed_allreduce_matches_its_formula(world):
    expected = reference(world)
    per_rank = run_on_ranks(world, run_compressed, world)
    for outs, _ in per_rank:
        for call in range(CALLS):
            for got, want in zip(outs[call], expected[call]):
                torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    _, ops = per_rank[0]
    padded_bits = sum(max(8 * world, math.ceil(n / (8 * world)) * 8 * world) for n in NUMELS) // 8
    # per call, two messages: the signs once to their owner (all-to-all), the owners' signs to
    # everyone (all-gather), each with one fp32 scale per segment and rank
    scales = world * 4 * len(NUMELS)
    assert ops["all_to_all"] == (CALLS, CALLS * (padded_bits + scales))
    assert ops["all_gather"] == (CALLS, CALLS * (padded_bits + scales))


def test_pack_signs_is_one_bit_per_element_and_round_trips():
    x = torch.tensor([0.5, -1.0, 0.0, -0.0, 3.0, -2.0, 1e-9, -1e-9] * 3)
    packed = pack_signs(x)
    assert packed.dtype == torch.uint8 and packed.numel() == x.numel() // 8
    assert packed[0].item() == 0b10111010  # x >= 0 sets the bit, first element in the high bit
    torch.testing.assert_close(unpack_signs(packed), torch.where(x >= 0, 1.0, -1.0))


def test_one_rank_is_the_identity():
    comm = CompressedAllReduce([3, 9], None, torch.device("cpu"))
    tensors = [torch.randn(3), torch.randn(9)]
    before = [t.clone() for t in tensors]
    comm(tensors)
    for a, b in zip(tensors, before):
        assert torch.equal(a, b)


# -- bad input ---------------------------------------------------------------------------------

def build_with(optimizer: dict, stage: int) -> str:
    model = torch.nn.Linear(4, 2)
    cfg = {"train_micro_batch_size_per_gpu": 1, "optimizer": optimizer, "zero_optimization": {"stage": stage}}
    try:
        trident.initialize(model=model, config=cfg, mesh=cached_mesh())
    except ConfigError as err:
        return str(err)
    return "no error"


@pytest.mark.parametrize("kind", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_onebit_optimizer_under_zero3_names_the_stage(kind):
    message = run_on_ranks(2, build_with, {"type": kind, "params": {}}, 3)[0]
    assert "zero_optimization.stage" in message and "stage 0 only, got 3" in message, message


def test_negative_freeze_step_is_refused():
    message = run_on_ranks(2, build_with, {"type": "OneBitAdam", "params": {"freeze_step": -1}}, 0)[0]
    assert "optimizer.params.freeze_step" in message and "-1" in message, message
