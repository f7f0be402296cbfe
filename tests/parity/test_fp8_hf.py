"""`fp8` on an unmodified `transformers` GPT-2, whose linear layers are Conv1D (y = x W + b, W
stored in x out), which torchao does not convert: trident's Float8Conv1D runs them in float8
with the numbers torchao's Float8Linear gives the same layer written as nn.Linear (weight W^T).

2 ranks, SGD with momentum, fp32, emulated, against torchao's conversion of that nn.Linear model
in one process running each rank's rows in turn: losses and weights within 1e-6 (measured
1.3e-7). Stage 0 with clipping active; ZeRO-3 without: its clip coefficient, from a norm summed
over shards, differs from one process's in the last bit, and FP8 turns such a bit into a whole
float8 step wherever a value sits at a rounding midpoint (measured: losses equal for two steps,
then 5e-5 apart, a bias 1.6e-2 off after five; FP8 itself moves the weights 7e-2). ZeRO-3's
clipping is held to 1e-5 by the tests without FP8."""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

from tests.parity.test_tp_hf import BATCH, make, tokens, train_rows
from trident.config import load_config
from trident.engine.full_state import full_state_dict
from trident.precision.fp8 import float8_config
from trident.precision.fp8_conv1d import is_conv1d
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import assert_losses_close, assert_state_close, optimizer_section, train_serial

LR, CLIP = 0.5, 0.05
FP8 = {"enabled": True, "recipe": "tensorwise", "emulate": True}


def as_linear(model: nn.Module) -> tuple[nn.Module, set[str]]:
    """A copy of `model` with each Conv1D an nn.Linear holding W^T; and the Conv1D weights' names."""
    model = copy.deepcopy(model)
    names = set()
    for name, m in list(model.named_modules()):
        if is_conv1d(m):
            linear = nn.Linear(m.nx, m.nf)
            linear.weight, linear.bias = nn.Parameter(m.weight.detach().t().clone()), m.bias
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, linear)
            names.add(f"{name}.weight")
    return model, names


class EachRanksRows(nn.Module):
    """One process running each dp rank's rows of a batch in turn, their losses averaged: dynamic
    float8 scales come from each micro-batch's own amax, as on the ranks."""

    def __init__(self, inner: nn.Module, ranks: int) -> None:
        super().__init__()
        self.inner, self.ranks = inner, ranks

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        return sum(self.inner(rows) for rows in batch.chunk(self.ranks)) / self.ranks


def serial(model: nn.Module, clip: float, conv: set[str] = frozenset()):
    """SGD with momentum (and clipping) over 2 ranks' rows in one process; weights named and laid
    out as the engine's (Conv1D weights transposed back)."""
    run = train_serial(EachRanksRows(model, 2), [(b,) for b in tokens().split(BATCH)], "sgd", LR, clip)
    weights = {k.removeprefix("inner."): v for k, v in run.weights.items()}
    run.weights = {k: v.t() if k in conv else v for k, v in weights.items()}
    return run


@functools.lru_cache(maxsize=None)
def reference(clip: float):
    """torchao's conversion of the nn.Linear form of the same GPT-2."""
    from torchao.float8 import convert_to_float8_training
    model, conv = as_linear(make("gpt2"))
    convert_to_float8_training(model, config=float8_config(load_config({"fp8": FP8}).fp8))
    return serial(model, clip, conv)


def train(stage: int, fp8: dict = FP8, clip: float = CLIP):
    cfg = {"gradient_clipping": clip, "optimizer": optimizer_section("sgd", LR), "zero_optimization": {"stage": stage},
           "fp8": fp8}
    engine, losses, _ = train_rows("gpt2", cfg, cached_mesh())
    return losses, {k: v.float() for k, v in full_state_dict(engine).items()}, engine.fp8_report


@pytest.mark.parametrize("stage,clip", [(0, CLIP), (3, 0.0)])
def test_gpt2_conv1d_layers_run_in_float8_as_torchao_runs_their_linear_form(stage, clip):
    ref = reference(clip)
    assert clip == 0.0 or max(ref.clip_coefs) < 1.0
    results = run_on_ranks(2, train, stage, FP8, clip)
    assert_losses_close([sum(s) / 2 for s in zip(*[r[0] for r in results])], ref.losses, rtol=1e-6)
    for _, weights, report in results:
        assert_state_close(weights, ref.weights, rtol=1e-6)
        assert {f"lm.transformer.h.{i}.{m}" for i in range(2)
                for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj")} <= set(report.converted)
    plain = serial(make("gpt2"), clip)
    assert max((plain.weights[k] - ref.weights[k]).abs().max() for k in ref.weights) > 1e-4  # FP8 is visible
