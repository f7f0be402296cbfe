"""Compare a parallel run's records with the serial run's, and write `trident verify`'s report.

A tensor *differs* when ||a - b|| > rtol * ||b|| + floor; the report gives that relative error
and the max absolute difference. Outputs whose shapes differ between the runs (a
column-parallel layer's output is a shard) are skipped.

Two checks need more than a plain relative error, because some values are rounding noise in
exact arithmetic: a gradient that is zero in exact arithmetic (attention's key bias) is noise
in both runs, so parameter gradients get a floor of 1e-6 of the step's whole gradient norm;
and Adam turns such noise into full-size updates, so the parameters after a step are compared
by their update (after - before), with the looser UPDATE_RTOL. The gradient check (data
parallelism) catches finer differences; the update check is what ZeRO stages get.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trident.tools.verify_record import RunRecord

# Order of checks within a step: a difference found earlier explains those after it.
_KINDS = ("output", "output gradient", "parameter gradient", "parameter update")
UPDATE_RTOL = 1e-2
_FLOOR = 1e-6


def default_rtol(dtype: torch.dtype) -> float:
    """fp32: summation order only (1e-4); bf16 / fp16: their rounding (2e-2)."""
    return 1e-4 if dtype == torch.float32 else 2e-2


def _errors(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    a, b = a.double(), b.double()
    diff = torch.linalg.vector_norm(a - b).item()
    ref = torch.linalg.vector_norm(b).item()
    maxdiff = (a - b).abs().max().item() if b.numel() else 0.0
    return (diff / ref if ref > 0 else diff), maxdiff


@dataclass
class Finding:
    """The first difference one rank sees: (step, kind index) orders findings across ranks."""

    step: int
    kind: int
    module: str
    detail: str
    rank: int

    def describe(self) -> str:
        return (f"first divergence at step {self.step + 1}: the {_KINDS[self.kind]} of module {self.module} "
                f"({self.detail}, seen on rank {self.rank})")


def _first_tensor_diff(ours: dict, ref: dict, keys, rtol: float, floor: float = 0.0) -> tuple | None:
    """(key, relative error, max abs diff) of the first of `keys` whose tensors differ."""
    for key in keys:
        a, b = ours.get(key), ref.get(key)
        if a is None or b is None or a.shape != b.shape:
            continue
        diff = torch.linalg.vector_norm(a.double() - b.double()).item()
        if diff > rtol * torch.linalg.vector_norm(b.double()).item() + floor:
            rel, maxdiff = _errors(a, b)
            return key, rel, maxdiff
    return None


def _total_norm(tensors: dict) -> float:
    return sum(torch.linalg.vector_norm(t.double()).item() ** 2 for t in tensors.values()) ** 0.5


def _updates(params: list[dict], s: int) -> dict:
    return {n: t - params[s][n] for n, t in params[s + 1].items() if n in params[s]}


def compare(par: RunRecord, ser: RunRecord, rank: int, rtol: float) -> dict:
    """This rank's summary: per-step parameter max differences and its first Finding (or None)."""
    steps, finding = [], None
    for s in range(len(par.losses)):
        after, ref = par.params[s + 1], ser.params[s + 1]
        params = {n: _errors(t, ref[n])[1] for n, t in after.items() if n in ref}
        steps.append(params)
        if finding is None:
            finding = _step_finding(par, ser, s, rank, rtol)
    return {"rank": rank, "params": steps, "finding": finding}


def _step_finding(par: RunRecord, ser: RunRecord, s: int, rank: int, rtol: float) -> Finding | None:
    fwd = [k for k in ser.outputs if k[0] == s]           # execution order of the serial run
    found = _first_tensor_diff(par.outputs, ser.outputs, fwd, rtol)
    if found:
        (_, m, name, call), rel, md = found
        return Finding(s, 0, name, f"micro-batch {m}, call {call}: relative error {rel:.2e}, max abs diff {md:.2e}",
                       rank)
    bwd = [k for k in ser.grads if k[0] == s]             # the order backward produced them
    found = _first_tensor_diff(par.grads, ser.grads, bwd, rtol)
    if found:
        (_, m, name, call), rel, md = found
        return Finding(s, 1, name, f"micro-batch {m}, call {call}: relative error {rel:.2e}, max abs diff {md:.2e}",
                       rank)
    order = list(ser.owner)                               # parameters in module order
    checks = [(3, _updates(par.params, s), _updates(ser.params, s), UPDATE_RTOL)]
    if s < len(par.grads_at_step) and par.grads_at_step[s]:
        checks.insert(0, (2, par.grads_at_step[s], ser.grads_at_step[s], rtol))
    for kind, ours, ref, tol in checks:
        found = _first_tensor_diff(ours, ref, order, tol, _FLOOR * _total_norm(ref))
        if found:
            name, rel, md = found
            return Finding(s, kind, par.owner.get(name, ser.owner.get(name, "?")),
                           f"{name}: relative error {rel:.2e}, max abs diff {md:.2e}", rank)
    return None


def _rel(a: float | None, b: float | None) -> str:
    if a is None or b is None:
        return "n/a"
    return f"{abs(a - b) / max(abs(b), 1e-12):.1e}"


def report(par: RunRecord, ser: RunRecord, summaries: list[dict], layout: str, rtol: float) -> tuple[str, bool]:
    """The printed report and whether the runs agree (no finding on any rank)."""
    lines = [f"trident verify: {layout} against one process, {len(ser.losses)} step(s), rtol {rtol:g}",
             f"{'step':>4}  {'loss':>12} {'serial':>12} {'rel':>8}  {'grad norm':>12} {'serial':>12} {'rel':>8}  "
             f"worst parameter"]
    for s, (loss, ref) in enumerate(zip(par.losses, ser.losses)):
        worst = max(((md, n) for summ in summaries for n, md in summ["params"][s].items()), default=(0.0, "-"))
        norm, ref_norm = par.norms[s], ser.norms[s]
        lines.append(f"{s + 1:>4}  {loss:>12.6f} {ref:>12.6f} {_rel(loss, ref):>8}  "
                     f"{_fmt(norm):>12} {_fmt(ref_norm):>12} {_rel(norm, ref_norm):>8}  {worst[1]} {worst[0]:.2e}")
    lines.append("max |parallel - serial| per parameter over all steps and ranks:")
    names = list(ser.owner)
    for name in names:
        md = max(summ["params"][s].get(name, 0.0) for summ in summaries for s in range(len(summ["params"])))
        lines.append(f"  {name:<40} {md:.3e}")
    findings = [summ["finding"] for summ in summaries if summ["finding"] is not None]
    if findings:
        first = min(findings, key=lambda f: (f.step, f.kind, f.rank))
        lines.append("MISMATCH: " + first.describe())
    else:
        lines.append("OK: the layout matches one process within rtol.")
    return "\n".join(lines), not findings


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.6f}"
