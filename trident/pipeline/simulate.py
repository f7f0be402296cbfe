"""Check and simulate schedules: per-instruction costs in, every stage's timeline out.

The model of execution is the executor's: a stage runs its instructions in order; a run of
adjacent transfers is one batch, whose sends are posted at once and never wait, and which
ends when all of its receives have arrived, and no sooner than `post` (the time a stage
spends issuing a batch). A receive matches the k-th send on its channel (sender, receiver,
kind: activations and gradients travel separately), and arrives `p2p` time units after that
send was posted. A stage waits only in receives, so a schedule
deadlocks exactly when the simulation cannot finish (`ScheduleError` names who waits on
what).

From the timeline come each stage's idle time and bubble fraction (idle / makespan, the
makespan running from 0 to the end of the last instruction on any stage), and, from the
instruction order alone, the peak number of micro-batch activations a stage keeps alive.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Sequence, Union

from trident.pipeline.instructions import (
    BACKWARD,
    COMM,
    RECVS,
    STEP,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicroBatch,
    MicroInstruction,
    OptimizerStep,
    RecvActivation,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    SendActivation,
    SendGrad,
    channel_kind,
    peer,
    virtual_stage,
)


class ScheduleError(ValueError):
    """A schedule is malformed or deadlocks."""


@dataclass(frozen=True)
class Costs:
    """Time of each kind of instruction on a stage (any unit); transfers are free by default.

    `p2p` is a transfer's latency (from posting the send to the end of the receive), `post`
    the time a stage spends issuing one batch of transfers.
    """

    forward: float = 1.0
    backward: float = 2.0
    backward_input: float = 1.0
    backward_weight: float = 1.0
    load: float = 0.0
    p2p: float = 0.0
    post: float = 0.0
    step: float = 0.0

    def of(self, instr: Instruction) -> float:
        """Duration of a non-transfer instruction."""
        if isinstance(instr, Forward):
            return self.forward
        if isinstance(instr, Backward):
            return self.backward
        if isinstance(instr, BackwardInput):
            return self.backward_input
        if isinstance(instr, BackwardWeight):
            return self.backward_weight
        if isinstance(instr, LoadMicroBatch):
            return self.load
        if isinstance(instr, STEP):
            return self.step
        raise TypeError(f"no cost for instruction {instr!r}")


CostModel = Union[Costs, Sequence[Union[Costs, Sequence[Costs]]]]
"""One Costs for every stage, or one per stage: a Costs, or a list with one per model chunk."""


@dataclass(frozen=True)
class Span:
    """One instruction on the timeline; a receive's span includes its wait."""

    instr: Instruction
    start: float
    end: float


@dataclass
class Timeline:
    """Every stage's spans in program order, and the quantities derived from them."""

    spans: list[list[Span]]
    peak_live: list[int] = field(default_factory=list)

    @property
    def stages(self) -> int:
        return len(self.spans)

    @property
    def makespan(self) -> float:
        return max((s[-1].end for s in self.spans if s), default=0.0)

    def busy(self, stage: int) -> float:
        """Time `stage` spends in instructions other than receives."""
        return sum(sp.end - sp.start for sp in self.spans[stage] if not isinstance(sp.instr, RECVS))

    def idle(self, stage: int) -> float:
        return self.makespan - self.busy(stage)

    def bubble_fraction(self, stage: int | None = None) -> float:
        """Idle share of the makespan on `stage`, or the mean over stages when None."""
        if self.makespan == 0:
            return 0.0
        if stage is None:
            return sum(self.idle(s) for s in range(self.stages)) / (self.stages * self.makespan)
        return self.idle(stage) / self.makespan


def peak_live_activations(program: Sequence[Instruction]) -> int:
    """Most (micro-batch, chunk) activations alive at once: from the forward to the end of the
    backward (to the weight pass W when the backward is split, since W still reads them)."""
    live = peak = 0
    for instr in program:
        if isinstance(instr, Forward):
            live += 1
            peak = max(peak, live)
        elif isinstance(instr, (Backward, BackwardWeight)):
            live -= 1
    return peak


def _costs_of(costs: CostModel, stage: int) -> list[Costs]:
    """The Costs of each chunk of `stage` (one entry when every chunk costs the same)."""
    if isinstance(costs, Costs):
        return [costs]
    if len(costs) <= stage:
        raise ValueError(f"costs has {len(costs)} entries but the schedule has stage {stage}; "
                         f"give one Costs (or one list of Costs per chunk) per stage, or a single Costs")
    mine = costs[stage]
    return [mine] if isinstance(mine, Costs) else list(mine)


class _Sim:
    """State of the event-driven run; `advance` moves one stage as far as it can go."""

    def __init__(self, programs: Sequence[Sequence[Instruction]], costs: CostModel) -> None:
        self.programs = programs
        self.costs = [_costs_of(costs, s) for s in range(len(programs))]
        self.ptr = [0] * len(programs)
        self.clock = [0.0] * len(programs)
        self.spans: list[list[Span]] = [[] for _ in programs]
        self.posted: dict[tuple, tuple[float, tuple[int, int]]] = {}  # (channel, k) -> (time, message)
        self.count: Counter = Counter()  # (channel, "send"|"recv") -> messages so far
        self.pending: dict[int, list[tuple[Instruction, tuple]]] = {}  # stage -> receives posted, waiting

    def advance(self, s: int) -> bool:
        moved = False
        prog = self.programs[s]
        while self.ptr[s] < len(prog):
            instr = prog[self.ptr[s]]
            if isinstance(instr, COMM):
                if not self._batch(s):
                    return moved
            else:
                start = self.clock[s]
                self.clock[s] = start + self._cost(s, instr).of(instr)
                self.spans[s].append(Span(instr, start, self.clock[s]))
                self.ptr[s] += 1
            moved = True
        return moved

    def _batch(self, s: int) -> bool:
        """Post the batch at ptr (once), then complete it if every receive has arrived."""
        prog, stages, t = self.programs[s], len(self.programs), self.clock[s]
        end = self.ptr[s]
        while end < len(prog) and isinstance(prog[end], COMM):
            end += 1
        if s not in self.pending:
            self.pending[s] = []
            for instr in prog[self.ptr[s]:end]:
                other, other_chunk = peer(instr, s, stages)
                if isinstance(instr, RECVS):
                    channel = (other, s, channel_kind(instr))
                    k = self._next(channel, "recv")
                    self.pending[s].append((instr, (channel, k)))
                else:
                    channel = (s, other, channel_kind(instr))
                    k = self._next(channel, "send")
                    self.posted[(channel, k)] = (t, (instr.micro, other_chunk))
        waiting = self.pending[s]
        if any(key not in self.posted for _, key in waiting):
            return False
        post = self._cost(s, prog[self.ptr[s]]).post
        done = t + post
        for instr, key in waiting:
            sent_at, message = self.posted[key]
            if message != (instr.micro, instr.chunk):
                raise ScheduleError(
                    f"stage {s}: {instr} receives on channel {key[0]} message #{key[1]}, which the sender "
                    f"sent for (micro, chunk) {message}: sends and receives on a channel are out of order")
            done = max(done, sent_at + self._cost(s, instr).p2p)
        posting = t  # the batch's posting time goes to its first send (busy, not waiting)
        for instr in prog[self.ptr[s]:end]:
            if isinstance(instr, RECVS):
                self.spans[s].append(Span(instr, t, done))
            else:
                self.spans[s].append(Span(instr, posting, t + post))
                posting = t + post
        self.clock[s] = done
        self.ptr[s] = end
        del self.pending[s]
        return True

    def _cost(self, s: int, instr: Instruction) -> Costs:
        per_chunk = self.costs[s]
        chunk = instr.chunk if isinstance(instr, MicroInstruction) else 0
        return per_chunk[chunk] if len(per_chunk) > 1 else per_chunk[0]

    def _next(self, channel: tuple, side: str) -> int:
        k = self.count[(channel, side)]
        self.count[(channel, side)] += 1
        return k

    def stuck(self) -> str:
        lines = []
        for s, prog in enumerate(self.programs):
            if self.ptr[s] < len(prog):
                waits = [str(i) for i, key in self.pending.get(s, []) if key not in self.posted]
                lines.append(f"stage {s} waits at instruction {self.ptr[s]} ({prog[self.ptr[s]]}) for "
                             + (", ".join(waits) or "nothing posted"))
        return "; ".join(lines)


def simulate(programs: Sequence[Sequence[Instruction]], costs: CostModel = Costs()) -> Timeline:
    """Run every stage's program against `costs` (one Costs, or one per stage)."""
    sim = _Sim(programs, costs)
    while any([sim.advance(s) for s in range(len(programs))]):
        pass
    if any(sim.ptr[s] < len(p) for s, p in enumerate(programs)):
        raise ScheduleError(f"the schedule deadlocks: {sim.stuck()}")
    return Timeline(sim.spans, [peak_live_activations(p) for p in programs])


def check_schedule(programs: Sequence[Sequence[Instruction]], micro_batches: int, virtual_stages: int = 1,
                   train: bool = True) -> None:
    """Raise ScheduleError unless every stage's program is well formed and the whole runs.

    Well formed: each (micro-batch, chunk) is forwarded once and, when training, backpropagated
    once (whole, or split into input and weight passes, in that order); each transfer a
    virtual stage needs appears once, receives before the compute that reads them and sends
    after the compute that makes them; data is loaded once per micro-batch on the stages that
    read it; a training step ends with ReduceTiedGrads, ReduceGrads, OptimizerStep. Runs:
    every send meets its receive in order and no stage waits forever (see `simulate`).
    """
    stages = len(programs)
    for s, prog in enumerate(programs):
        problems = _stage_problems(prog, s, stages, micro_batches, virtual_stages, train)
        if problems:
            raise ScheduleError(f"stage {s} of {stages}: " + "; ".join(problems[:5]))
    simulate(programs, Costs())


def _stage_problems(prog: Sequence[Instruction], s: int, stages: int, micro_batches: int,
                    virtual_stages: int, train: bool) -> list[str]:
    where: dict[Instruction, list[int]] = defaultdict(list)
    for i, instr in enumerate(prog):
        where[instr].append(i)
    problems = []

    def once(instr: Instruction, wanted: bool) -> int | None:
        n = len(where.get(instr, []))
        if n != (1 if wanted else 0):
            problems.append(f"{type(instr).__name__}{instr} appears {n} times, expected {int(wanted)}")
            return None
        return where[instr][0] if wanted else None

    def before(a: int | None, b: int | None, what: str) -> None:
        if a is not None and b is not None and a >= b:
            problems.append(what)

    last_vs = stages * virtual_stages - 1
    split = any(isinstance(i, (BackwardInput, BackwardWeight)) for i in prog)
    load_chunk = 0 if s == 0 else virtual_stages - 1 if s == stages - 1 else None
    for m in range(micro_batches):
        for c in range(virtual_stages):
            vs = virtual_stage(s, c, stages)
            f = once(Forward(m, c), True)
            b = once((BackwardInput if split else Backward)(m, c), train)
            w = once(BackwardWeight(m, c), train and split)
            before(f, b, f"backward of micro {m} chunk {c} before its forward")
            before(b, w, f"weight pass of micro {m} chunk {c} before its input pass")
            if c == load_chunk:
                before(once(LoadMicroBatch(m, 0), True), f, f"micro {m} is used before it is loaded")
            before(once(RecvActivation(m, c), vs > 0), f, f"forward {m}.{c} before its input arrives")
            before(f, once(SendActivation(m, c), vs < last_vs), f"activation {m}.{c} sent before computed")
            before(once(RecvGrad(m, c), train and vs < last_vs), b, f"backward {m}.{c} before its gradient")
            before(b, once(SendGrad(m, c), train and vs > 0), f"gradient {m}.{c} sent before computed")
    if load_chunk is None and any(isinstance(i, LoadMicroBatch) for i in prog):
        problems.append("loads data but holds neither the first nor the last virtual stage")
    tail = [i for i in prog if isinstance(i, STEP)]
    expected = [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()] if train else []
    if tail != expected or (train and list(prog[-3:]) != expected):
        problems.append(f"step instructions {[str(i) for i in tail]} must be {[str(i) for i in expected]} at the end")
    known = set(BACKWARD) | set(COMM) | {Forward, LoadMicroBatch} | set(STEP)
    unknown = [i for i in prog if type(i) not in known]
    if unknown:
        problems.append(f"unknown instructions {unknown[:3]}")
    wrong = [i for i in prog if isinstance(i, MicroInstruction)
             and not (0 <= i.micro < micro_batches and 0 <= i.chunk < virtual_stages)]
    if wrong:
        problems.append(f"instructions outside micro-batches [0, {micro_batches}) or chunks "
                        f"[0, {virtual_stages}): {[str(i) for i in wrong[:3]]}")
    return problems
