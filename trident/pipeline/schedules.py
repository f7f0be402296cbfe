"""Pipeline schedules as pure functions: (stages, micro_batches, stage) -> that stage's instructions.

Each schedule first fixes the order of compute on a stage (forwards F, backwards B, and for
zero-bubble schedules input-gradient b and weight-gradient W passes); `_lower` then adds the
data loads and the point-to-point transfers around them, and the step at the end
(ReduceTiedGrads, ReduceGrads, OptimizerStep):

    RecvActivation  before a forward that is not on the first virtual stage
    SendActivation  after  a forward that is not on the last virtual stage
    RecvGrad        before a backward that is not on the last virtual stage
    SendGrad        after  a backward that is not on the first virtual stage

Transfers that end up next to each other run as one batch (e.g. 1F1B's "send activation,
receive gradient"). Sends never wait; a stage only waits for its receives. So a schedule is
deadlock-free exactly when the simulator (`trident.pipeline.simulate`) can run every stage to
the end, which the tests check for every schedule, stage count and micro-batch count.

With p stages and m micro-batches, and equal costs on every stage:

    gpipe     all forwards, then all backwards.   bubble (p-1)/(m+p-1), m activations alive
    1f1b      p-s-1 warm-up forwards on stage s, then one forward / one backward.
              bubble (p-1)/(m+p-1), at most p activations alive
    interleaved_1f1b  v chunks per rank, each 1/v of the layers: the warm-up shrinks to
              chunks of the work. bubble (p-1)/(v m+p-1) for m >= p (micro-batches go
              round in rounds of at least p; fewer wait for their own wrap-around)
    zb_h1     1F1B with the backward split into b (to the input) and W (to the weights);
              stage s keeps up to s weight passes pending and runs them when it would
              otherwise wait. With forward, b and W equally long and m >= p, the idle
              time is a third of 1F1B's (Qi et al. 2023, "Zero Bubble Pipeline
              Parallelism", ZB-H1); at most p activations alive.
"""

from __future__ import annotations

from typing import Callable

from trident.pipeline.instructions import (
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicroBatch,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    virtual_stage,
)

Op = tuple[str, int, int]  # ("F" | "B" | "b" | "W", micro, chunk)

_COMPUTE = {"F": Forward, "B": Backward, "b": BackwardInput, "W": BackwardWeight}


def _check(stages: int, micro_batches: int, stage: int, virtual_stages: int = 1) -> None:
    for name, value in (("stages", stages), ("micro_batches", micro_batches),
                        ("virtual_stages", virtual_stages)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < stages:
        raise ValueError(f"stage must be an integer in [0, {stages}) for {stages} stages, got {stage!r}")


def _lower(order: list[Op], stages: int, micro_batches: int, stage: int, virtual_stages: int = 1,
           train: bool = True) -> list[Instruction]:
    """Wrap a compute order in loads, transfers and (when training) the step."""
    last_vs = stages * virtual_stages - 1
    # The data loader feeds the first virtual stage (inputs) and the last (labels); a rank
    # loads a micro-batch once, before the first forward that needs it.
    load_chunk = 0 if stage == 0 else virtual_stages - 1 if stage == stages - 1 else None
    out: list[Instruction] = []
    for kind, micro, chunk in order:
        vs = virtual_stage(stage, chunk, stages)
        if kind == "F":
            if chunk == load_chunk:
                out.append(LoadMicroBatch(micro))
            if vs > 0:
                out.append(RecvActivation(micro, chunk))
            out.append(Forward(micro, chunk))
            if vs < last_vs:
                out.append(SendActivation(micro, chunk))
        elif kind in ("B", "b"):
            if vs < last_vs:
                out.append(RecvGrad(micro, chunk))
            out.append(_COMPUTE[kind](micro, chunk))
            if vs > 0:
                out.append(SendGrad(micro, chunk))
        else:
            out.append(_COMPUTE[kind](micro, chunk))
    if train:
        out += [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]
    return out


def gpipe(stages: int, micro_batches: int, stage: int) -> list[Instruction]:
    """GPipe (Huang et al. 2019): every forward, then every backward."""
    _check(stages, micro_batches, stage)
    order = [("F", m, 0) for m in range(micro_batches)] + [("B", m, 0) for m in range(micro_batches)]
    return _lower(order, stages, micro_batches, stage)


def _one_f_one_b_order(stages: int, micro_batches: int, stage: int) -> list[Op]:
    warmup = min(stages - stage - 1, micro_batches)
    order: list[Op] = [("F", m, 0) for m in range(warmup)]
    for k in range(micro_batches - warmup):
        order += [("F", warmup + k, 0), ("B", k, 0)]
    order += [("B", m, 0) for m in range(micro_batches - warmup, micro_batches)]
    return order


def one_f_one_b(stages: int, micro_batches: int, stage: int) -> list[Instruction]:
    """1F1B (PipeDream-Flush, Narayanan et al. 2021): same bubble as GPipe, p activations.

    Stage s runs p - s - 1 forwards ahead, then alternates one forward and one backward, so
    a micro-batch's activations are freed p - s steps after they were made.
    """
    _check(stages, micro_batches, stage)
    return _lower(_one_f_one_b_order(stages, micro_batches, stage), stages, micro_batches, stage)


def _rounds(stages: int, micro_batches: int) -> list[range]:
    """Micro-batches split into rounds of at least `stages` (all of them when fewer), sizes
    as even as possible, larger rounds first."""
    n = max(1, micro_batches // stages)
    size, extra = divmod(micro_batches, n)
    bounds = [0]
    for r in range(n):
        bounds.append(bounds[-1] + size + (r < extra))
    return [range(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _interleaved_units(stages: int, micro_batches: int, virtual_stages: int, backward: bool) -> list[tuple[int, int]]:
    """(micro, chunk) in the order every rank runs them: round by round, each round through
    every chunk (in reverse for backward) before the next round starts."""
    units = []
    for group in _rounds(stages, micro_batches):
        chunks = reversed(range(virtual_stages)) if backward else range(virtual_stages)
        units += [(m, c) for c in chunks for m in group]
    return units


def interleaved_1f1b(stages: int, micro_batches: int, stage: int, virtual_stages: int = 2) -> list[Instruction]:
    """Interleaved 1F1B (Narayanan et al. 2021): `virtual_stages` model chunks per rank.

    Each rank holds every stages-th slice of the layers, so a micro-batch visits every rank
    v times and the warm-up and cool-down are made of chunk-sized (1/v) pieces of work.
    Every rank runs forwards in the same (micro, chunk) order, and backwards likewise, which
    keeps each channel's sends and receives in the same order on both ends. With one chunk
    it is 1F1B.
    """
    _check(stages, micro_batches, stage, virtual_stages)
    if virtual_stages == 1:
        return one_f_one_b(stages, micro_batches, stage)
    fwd = _interleaved_units(stages, micro_batches, virtual_stages, backward=False)
    bwd = _interleaved_units(stages, micro_batches, virtual_stages, backward=True)
    total = len(fwd)
    first_round = len(_rounds(stages, micro_batches)[0])
    warmup = min(total, (stages - stage - 1) * 2 + (virtual_stages - 1) * first_round)
    order: list[Op] = [("F", m, c) for m, c in fwd[:warmup]]
    for k in range(total - warmup):
        order += [("F", *fwd[warmup + k]), ("B", *bwd[k])]
    order += [("B", m, c) for m, c in bwd[total - warmup:]]
    return _lower(order, stages, micro_batches, stage, virtual_stages)


def zb_h1(stages: int, micro_batches: int, stage: int) -> list[Instruction]:
    """ZB-H1 (Qi et al. 2023): 1F1B with each backward split into b (input) and W (weights).

    The input-gradient passes b form the critical path between stages; weight passes W
    only have to happen before the optimizer step. Stage s therefore lets up to s weight
    passes wait, which fills the cool-down where 1F1B idles, while its live activations
    (p - s before b, s more before W) stay at most p, as in 1F1B.
    """
    _check(stages, micro_batches, stage)
    n_f = min(stages - stage, micro_batches)
    order: list[Op] = [("F", m, 0) for m in range(n_f)]
    n_w = 0
    for n_b in range(1, micro_batches + 1):
        order.append(("b", n_b - 1, 0))
        if n_b - n_w > stage:
            order.append(("W", n_w, 0))
            n_w += 1
        if n_f < micro_batches:
            order.append(("F", n_f, 0))
            n_f += 1
    order += [("W", m, 0) for m in range(n_w, micro_batches)]
    return _lower(order, stages, micro_batches, stage)


def forward_only(stages: int, micro_batches: int, stage: int, virtual_stages: int = 1) -> list[Instruction]:
    """Evaluation: every micro-batch forward through every chunk, no backward, no step."""
    _check(stages, micro_batches, stage, virtual_stages)
    units = _interleaved_units(stages, micro_batches, virtual_stages, backward=False)
    return _lower([("F", m, c) for m, c in units], stages, micro_batches, stage, virtual_stages, train=False)


SCHEDULES: dict[str, Callable[..., list[Instruction]]] = {
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
}


def build_schedule(name: str, stages: int, micro_batches: int, stage: int,
                   virtual_stages: int = 1) -> list[Instruction]:
    """The instructions of `stage` under the schedule called `name` (a key of SCHEDULES)."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r} is unknown; choose one of {', '.join(SCHEDULES)}")
    if name == "interleaved_1f1b":
        return interleaved_1f1b(stages, micro_batches, stage, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"virtual_stages={virtual_stages} needs schedule 'interleaved_1f1b' (got {name!r}); "
                         f"set virtual_stages to 1 or switch the schedule")
    return SCHEDULES[name](stages, micro_batches, stage)


def build_all(name: str, stages: int, micro_batches: int, virtual_stages: int = 1) -> list[list[Instruction]]:
    """Every stage's instructions, stage 0 first."""
    return [build_schedule(name, stages, micro_batches, s, virtual_stages) for s in range(stages)]
