"""`trident doctor --gpu` / `make gpu-check`: trident's parallel paths checked on the GPUs of this machine.

The checks are data: a name, the fewest GPUs it needs, and a body that runs on every rank of a
fresh process group (one rank per GPU, NCCL; see `rank_launch`). `plan_checks` decides from the
number of visible GPUs which checks run and on how many ranks; `run_checks` runs them and
prints one line per check:

    PASS dp equivalence: dp=4: weights rel err 2.1e-07, grad norms rel err 9.8e-08 over 5 steps (bar 1e-04)
    SKIP tp=2 equivalence: needs 2 GPUs, 1 visible

A check uses every visible GPU its layout can: dp over all of them, tp=2 or pp=2 with dp over
the rest (an odd GPU left out). On one GPU the single-rank paths run. Without CUDA every check
is skipped; the bodies' logic can still run on CPU ranks over gloo (`device_type="cpu"`), where
the CUDA-only measurements skip themselves.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import Callable, Sequence, TextIO

import torch

from trident.tools.gpu_common import FAIL, PASS, SKIP, Outcome
from trident.tools.gpu_device import accelerator, memory, offload, overlap, planner_step_time
from trident.tools.gpu_equivalence import bf16_training, equivalence, pipeline_equivalence, process_group
from trident.tools.rank_launch import RankError, run_ranks


@dataclass(frozen=True)
class Check:
    """One check: `body(device)` runs on every rank; it needs at least `gpus` GPUs and a number of
    ranks that is a multiple of `multiple` (its layout's model-parallel size)."""

    name: str
    gpus: int
    body: Callable[[torch.device], Outcome]
    multiple: int = 1

    def ranks(self, visible: int) -> int:
        """How many of `visible` GPUs the check uses: all that its layout can divide."""
        return visible - visible % self.multiple


CHECKS: tuple[Check, ...] = (
    Check("process group", 1, process_group),
    Check("dp equivalence", 1, equivalence),
    Check("zero-3 equivalence", 1, functools.partial(equivalence, stage=3)),
    Check("tp=2 equivalence", 2, functools.partial(equivalence, tp=2), multiple=2),
    Check("pp=2 equivalence", 2, functools.partial(pipeline_equivalence, pp=2), multiple=2),
    Check("bf16 training", 1, bf16_training),
    Check("pinned offload", 1, offload),
    Check("comm overlaps backward", 2, overlap),
    Check("memory_breakdown vs allocator", 1, memory),
    Check("planner step time", 1, planner_step_time),
    Check("deepspeed accelerator", 1, accelerator),
)


@dataclass(frozen=True)
class Planned:
    """A check with the ranks it runs on, or the reason it is skipped (then `ranks` is 0)."""

    check: Check
    ranks: int
    skip: str | None = None


@dataclass(frozen=True)
class Result:
    name: str
    status: str
    detail: str

    def line(self) -> str:
        return f"{self.status} {self.name}: {self.detail}"


def visible_gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def plan_checks(gpus: int, checks: Sequence[Check] = CHECKS) -> list[Planned]:
    """Which checks run on `gpus` visible GPUs, each on how many ranks; the rest with a reason."""
    planned = []
    for check in checks:
        if gpus < check.gpus:
            planned.append(Planned(check, 0, f"needs {check.gpus} GPU{'s' if check.gpus > 1 else ''}, "
                                             f"{gpus} visible"))
        else:
            planned.append(Planned(check, check.ranks(gpus)))
    return planned


def combine(name: str, outcomes: Sequence[Outcome]) -> Result:
    """One result from every rank's outcome: the first failing rank's, else rank 0's (SKIP only
    when every rank skipped)."""
    for rank, outcome in enumerate(outcomes):
        if outcome.status == FAIL:
            return Result(name, FAIL, f"rank {rank}: {outcome.detail}")
    if all(o.status == SKIP for o in outcomes):
        return Result(name, SKIP, outcomes[0].detail)
    return Result(name, PASS, outcomes[0].detail)


def run_one(planned: Planned, device_type: str, launch: Callable = run_ranks, err: TextIO | None = None) -> Result:
    """Run one planned check on fresh ranks; an exception on any rank is a FAIL (traceback to `err`)."""
    check = planned.check
    if planned.skip is not None:
        return Result(check.name, SKIP, planned.skip)
    try:
        outcomes = launch(check.body, planned.ranks, device_type)
    except RankError as e:
        print(f"--- {check.name} ---\n{e}", file=err or sys.stderr)
        last = str(e).strip().splitlines()[-1]
        return Result(check.name, FAIL, f"{planned.ranks} rank(s): {last}")
    return combine(check.name, outcomes)


def run_checks(gpus: int | None = None, checks: Sequence[Check] = CHECKS, device_type: str = "cuda",
               only: Sequence[str] = (), launch: Callable = run_ranks, out: TextIO | None = None,
               err: TextIO | None = None) -> list[Result]:
    """Plan and run `checks` for `gpus` devices (default: the visible GPUs), printing each line as
    it finishes. `only` keeps the checks whose name contains one of its strings."""
    gpus = visible_gpus() if gpus is None else gpus
    selected = [c for c in checks if not only or any(s in c.name for s in only)]
    if not selected:
        raise ValueError(f"no check matches {list(only)}; checks: {', '.join(c.name for c in checks)}")
    results = []
    for planned in plan_checks(gpus, selected):
        result = run_one(planned, device_type, launch, err)
        print(result.line(), file=out or sys.stdout, flush=True)
        results.append(result)
    return results


def summary(results: Sequence[Result]) -> str:
    counts = {s: sum(r.status == s for r in results) for s in (PASS, FAIL, SKIP)}
    return f"{counts[PASS]} passed, {counts[FAIL]} failed, {counts[SKIP]} skipped"


def exit_code(results: Sequence[Result]) -> int:
    """1 when any check failed, else 0 (skips are not failures)."""
    return 1 if any(r.status == FAIL for r in results) else 0
