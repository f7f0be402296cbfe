"""Serial-versus-parallel comparison with per-tensor reports.

A parity failure should say which tensor drifted and by how much, not just "not close":
`assert_state_close` lists every tensor's relative error (||a - b|| / ||b||) and max abs
difference, worst first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Container, Iterable, Mapping, Sequence

import torch

from trident.optim.muon import Muon, flag_muon_params


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    denom = torch.linalg.vector_norm(b).item()
    diff = torch.linalg.vector_norm(a - b).item()
    return diff / denom if denom > 0 else diff


def assert_losses_close(actual: Sequence[float], expected: Sequence[float], rtol: float = 1e-5) -> None:
    """Every step's loss within `rtol` relative error; the message lists the worst steps."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} losses vs {len(expected)} expected")
    errs = [abs(a - e) / max(abs(e), 1e-12) for a, e in zip(actual, expected)]
    bad = [(i, a, e, r) for i, (a, e, r) in enumerate(zip(actual, expected, errs)) if r > rtol]
    if bad:
        lines = "\n".join(f"  step {i + 1}: {a:.8f} vs {e:.8f} (rel {r:.2e})" for i, a, e, r in bad[:10])
        raise AssertionError(f"{len(bad)} of {len(errs)} losses differ by more than rtol={rtol}:\n{lines}")


def state_report(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor]) -> list[tuple]:
    """(name, relative error, max abs diff) per tensor, worst first."""
    missing = set(expected) ^ set(actual)
    if missing:
        raise AssertionError(f"tensor names differ: {sorted(missing)}")
    rows = []
    for name, e in expected.items():
        a = actual[name]
        if a.shape != e.shape:
            raise AssertionError(f"{name}: shape {tuple(a.shape)} vs expected {tuple(e.shape)}")
        maxdiff = (a.detach().double() - e.detach().double()).abs().max().item() if e.numel() else 0.0
        rows.append((name, relative_error(a, e), maxdiff))
    return sorted(rows, key=lambda r: -r[1])


def assert_state_close(actual: Mapping[str, torch.Tensor], expected: Mapping[str, torch.Tensor],
                       rtol: float = 1e-5) -> None:
    """Every tensor within `rtol` relative (norm-wise) error of its reference."""
    rows = state_report(actual, expected)
    if rows and rows[0][1] > rtol:
        lines = "\n".join(f"  {n}: rel {r:.2e}, max abs diff {m:.2e}" for n, r, m in rows[:10])
        raise AssertionError(f"weights differ beyond rtol={rtol} (worst first):\n{lines}")


# -- the serial reference ------------------------------------------------------------------------

PARITY_OPTIMIZERS = ("adamw", "sgd", "muon")
"""Parity runs train with AdamW and with SGD + momentum. Adam is blind to a uniform scale of the
gradient (up to eps), so a wrong norm, loss-scale or averaging factor passes an Adam-only test;
SGD with clipping that is active on every step turns any such error into a different update.
Muon (AdamW for non-matrices) is not scale-invariant either: its Newton-Schulz step divides by
the Frobenius norm, but its momentum sums scaled gradients of different steps."""

SGD_MOMENTUM = 0.9
ADAMW_WEIGHT_DECAY = 0.01


def optimizer_section(kind: str, lr: float, eps: float | None = None) -> dict:
    """The DeepSpeed-style `optimizer` section of a parity run's config. `eps`: AdamW's, when a
    model has gradient entries near 1e-8, whose rounding noise Adam's default eps would
    normalise into visible steps."""
    if kind == "adamw":
        params = {"lr": lr, "weight_decay": ADAMW_WEIGHT_DECAY, **({"eps": eps} if eps is not None else {})}
        return {"type": "AdamW", "params": params}
    if kind == "sgd":
        return {"type": "SGD", "params": {"lr": lr, "momentum": SGD_MOMENTUM}}
    if kind == "muon":
        return {"type": "Muon", "params": {"lr": lr, "weight_decay": ADAMW_WEIGHT_DECAY}}
    raise ValueError(f"parity optimizer {kind!r}: expected one of {PARITY_OPTIMIZERS}")


PARITY_PRECISIONS = ("fp32", "bf16", "fp16")
FP16_INITIAL_SCALE_POWER = 21
"""fp16 parity runs start the dynamic loss scale at 2**21, above what the tiny parity GPTs'
gradients fit in fp16 (they fit at 2**18 to 2**20), so the first steps overflow and are skipped;
hysteresis 1 halves the scale on every overflow. (DeepSpeed's default 2**16 never overflows on
these models, so it would not exercise the skipping.)"""


def precision_sections(precision: str) -> dict:
    """The `bf16` and `fp16` config sections of a parity run in `precision` (fp32, bf16 or fp16)."""
    if precision not in PARITY_PRECISIONS:
        raise ValueError(f"parity precision {precision!r}: expected one of {PARITY_PRECISIONS}")
    return {"bf16": {"enabled": precision == "bf16"},
            "fp16": {"enabled": precision == "fp16", "initial_scale_power": FP16_INITIAL_SCALE_POWER,
                     "hysteresis": 1}}


def torch_optimizer(kind: str, params, lr: float, eps: float | None = None) -> torch.optim.Optimizer:
    """The plain-PyTorch optimizer that `optimizer_section(kind, lr, eps)` describes."""
    if kind == "adamw":
        return torch.optim.AdamW(params, lr=lr, weight_decay=ADAMW_WEIGHT_DECAY, eps=1e-8 if eps is None else eps)
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=SGD_MOMENTUM)
    if kind == "muon":
        return Muon(params, lr=lr, weight_decay=ADAMW_WEIGHT_DECAY)
    raise ValueError(f"parity optimizer {kind!r}: expected one of {PARITY_OPTIMIZERS}")


@dataclass
class SerialRun:
    """A single-process training run: per-step losses, gradient norms (before clipping, in float64)
    and clip coefficients (1.0 when clipping is off or inactive), and the final state dict."""

    losses: list[float] = field(default_factory=list)
    norms: list[float] = field(default_factory=list)
    clip_coefs: list[float] = field(default_factory=list)
    weights: dict[str, torch.Tensor] = field(default_factory=dict)


def train_serial(model: torch.nn.Module, batches: Iterable[tuple], optimizer: str, lr: float, clip: float,
                 schedule: Callable[[torch.optim.Optimizer], Any] | None = None,
                 skip: Container[int] = (), eps: float | None = None) -> SerialRun:
    """Plain PyTorch: one `model(*batch)` loss per step over the whole global batch, the exact norm
    of all (unique) parameters' gradients, torch's clip rule (max / (norm + 1e-6) when < 1).

    The steps (0-based) in `skip` only record their loss, as an fp16 run skips a step whose
    gradient overflowed: no update, no schedule step; their norm is NaN."""
    if optimizer == "muon":
        flag_muon_params(model)  # what the engine does for a config-built Muon
    opt = torch_optimizer(optimizer, model.parameters(), lr, eps)
    sched = schedule(opt) if schedule is not None else None
    run = SerialRun()
    for step, batch in enumerate(batches):
        if step in skip:
            with torch.no_grad():
                run.losses.append(model(*batch).item())
            run.norms.append(math.nan)
            run.clip_coefs.append(1.0)
            continue
        loss = model(*batch)
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        coef = clip / (norm + 1e-6) if clip > 0 and clip / (norm + 1e-6) < 1.0 else 1.0
        if coef != 1.0:
            for g in grads:
                g.mul_(coef)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad()
        run.losses.append(loss.item())
        run.norms.append(norm)
        run.clip_coefs.append(coef)
    run.weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return run


def assert_norms_close(actual: Sequence[float | None], expected: Sequence[float], rtol: float = 1e-6) -> None:
    """Every step's global gradient norm (engine.get_global_grad_norm()) within `rtol` of the
    serial one: clipping multiplies every update by max_norm / norm, so a norm off by x is an
    update off by x."""
    if len(actual) != len(expected):
        raise AssertionError(f"{len(actual)} gradient norms vs {len(expected)} expected")
    errs = [abs(a - e) / e if a is not None else math.inf for a, e in zip(actual, expected)]
    bad = [(i, a, e, r) for i, (a, e, r) in enumerate(zip(actual, expected, errs)) if r > rtol]
    if bad:
        lines = "\n".join(f"  step {i + 1}: {a} vs {e:.10f} (rel {r:.2e})" for i, a, e, r in bad[:10])
        raise AssertionError(f"{len(bad)} of {len(errs)} gradient norms differ by more than rtol={rtol}:\n{lines}")
