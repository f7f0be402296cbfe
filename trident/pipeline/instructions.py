"""The instructions a pipeline stage executes: tiny frozen records, no behaviour.

A schedule (`trident.pipeline.schedules`) is a list of these per stage; the executor maps each
type to a handler, the simulator to a cost. Every micro-batch instruction names the micro-batch
and the model chunk it concerns: with interleaving, rank `stage` holds `virtual_stages` chunks,
and chunk c of rank s is virtual stage c * stages + s of the model (a rank holds every
stages-th slice of the layers):

    virtual stage:  0    1    2    3    4    5        stages=3, virtual_stages=2
    rank:           0    1    2    0    1    2
    chunk:          0    0    0    1    1    1

Activations flow from virtual stage k to k + 1, gradients from k + 1 back to k.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Instruction:
    """Base of every instruction."""

    def __str__(self) -> str:
        return type(self).__name__


@dataclass(frozen=True)
class MicroInstruction(Instruction):
    """An instruction about one micro-batch on one model chunk of this stage."""

    micro: int
    chunk: int = 0

    label = "?"

    def __str__(self) -> str:
        return f"{self.label}{self.micro}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class LoadMicroBatch(MicroInstruction):
    """Take the next micro-batch from the data iterator (first stage: inputs, last: labels)."""

    label = "L"


@dataclass(frozen=True)
class Forward(MicroInstruction):
    """Run the chunk's layers on the micro-batch; on the last virtual stage, also the loss."""

    label = "F"


@dataclass(frozen=True)
class Backward(MicroInstruction):
    """Backpropagate through the chunk: input gradients and weight gradients together."""

    label = "B"


@dataclass(frozen=True)
class BackwardInput(MicroInstruction):
    """Backpropagate to the chunk's inputs; weight gradients of linear layers are deferred."""

    label = "b"


@dataclass(frozen=True)
class BackwardWeight(MicroInstruction):
    """Compute the deferred weight gradients of an earlier `BackwardInput`."""

    label = "W"


@dataclass(frozen=True)
class SendActivation(MicroInstruction):
    """Send the chunk's output to the next virtual stage."""

    label = "sa"


@dataclass(frozen=True)
class RecvActivation(MicroInstruction):
    """Receive the chunk's input from the previous virtual stage."""

    label = "ra"


@dataclass(frozen=True)
class SendGrad(MicroInstruction):
    """Send the gradient of the chunk's input to the previous virtual stage."""

    label = "sg"


@dataclass(frozen=True)
class RecvGrad(MicroInstruction):
    """Receive the gradient of the chunk's output from the next virtual stage."""

    label = "rg"


@dataclass(frozen=True)
class ReduceTiedGrads(Instruction):
    """Sum the gradients of weights tied across stages onto the stage that owns them."""


@dataclass(frozen=True)
class ReduceGrads(Instruction):
    """Reduce the accumulated gradients over the data-parallel group."""


@dataclass(frozen=True)
class OptimizerStep(Instruction):
    """Clip, step the optimizer and the LR schedule, refresh the tied copies."""


COMPUTE = (Forward, Backward, BackwardInput, BackwardWeight)
BACKWARD = (Backward, BackwardInput, BackwardWeight)
SENDS = (SendActivation, SendGrad)
RECVS = (RecvActivation, RecvGrad)
COMM = SENDS + RECVS
STEP = (ReduceGrads, ReduceTiedGrads, OptimizerStep)


def virtual_stage(stage: int, chunk: int, stages: int) -> int:
    """Position in the model of `chunk` on rank `stage`."""
    return chunk * stages + stage


def locate(vstage: int, stages: int) -> tuple[int, int]:
    """(rank, chunk) holding virtual stage `vstage`."""
    chunk, stage = divmod(vstage, stages)
    return stage, chunk


def peer(instr: MicroInstruction, stage: int, stages: int) -> tuple[int, int]:
    """(rank, chunk) at the other end of a send or recv issued by `stage`.

    Activations go to (and come from) the neighbouring virtual stage downstream (upstream),
    gradients the other way.
    """
    here = virtual_stage(stage, instr.chunk, stages)
    downstream = isinstance(instr, (SendActivation, RecvGrad))
    return locate(here + 1 if downstream else here - 1, stages)


def channel_kind(instr: MicroInstruction) -> str:
    """"act" or "grad": the two kinds travel on separate channels, each in FIFO order."""
    return "act" if isinstance(instr, (SendActivation, RecvActivation)) else "grad"
