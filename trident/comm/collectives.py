"""Collectives over an explicit process group, with gloo fallbacks and optional logging.

Every function takes `group` as a keyword with no default, so each call site says which ranks
it talks to (pass `dist.group.WORLD` for all of them). Ranks named in arguments (`src`, `dst`)
are group-local: rank 0 is the group's first member, whatever its global rank. They are
converted with `dist.get_global_rank`.

Reductions (`op`) follow torch's `ReduceOp`. What gloo lacks, measured on torch 2.13 with 2 and
3 ranks, and what trident does instead:

- PREMUL_SUM (every reduction): gloo rejects it. Each rank multiplies its input by the
  factor (in place for all_reduce and reduce, whose tensors are overwritten anyway; a copy
  for reduce_scatter, whose input is left intact), then SUM.
- AVG of an integer tensor: gloo fails on the division. An integer mean is not an integer,
  so trident refuses it on every backend rather than guess a rounding: reduce with SUM.
- all_gather_single / reduce_scatter_single want exact shapes (output dim 0 = group size x
  input dim 0). trident passes flat views, so any shapes with matching element counts work.

Everything else (AVG, MAX, MIN, PRODUCT in all reductions including reduce_scatter, uneven
all_to_all, async variants) is native on gloo. An async call returns a `Handle`; its `wait()`
completes the op and stops the logger's clock.

Every call is also noted by the hang detector's flight recorder (`recorder.py` here) when it
is on: op, group, the group's call number, the tensor's shape and dtype, and the call site. A
blocking call is watched from issue to return; an async one while `Handle.wait()` blocks.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch
import torch.distributed as dist

from trident.comm.logger import CommsLogger, Span
import trident.comm.recorder as flight

ReduceOp = dist.ReduceOp
ProcessGroup = dist.ProcessGroup

# all_gather_single / reduce_scatter_single replace the *_into_tensor / *_tensor names (deprecated
# in torch 2.13); older torch only has the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor

flight.skip_frames_of(__file__)  # call sites are reported in the caller's file, not here


class Handle:
    """A collective in flight. `wait()` blocks until it is done; calling it again is free."""

    __slots__ = ("_work", "_span", "_done", "_rec", "_recorder")

    def __init__(self, work: dist.Work | None, span: Span | None = None, rec: flight.Record | None = None,
                 recorder: flight.FlightRecorder | None = None) -> None:
        self._work, self._span = work, span
        self._rec, self._recorder = rec, recorder
        self._done = False

    def wait(self) -> bool:
        if not self._done:
            rec = self._rec
            if rec is not None:
                self._recorder.wait_begin(rec)
            if self._work is not None:
                try:
                    self._work.wait()
                except BaseException as err:
                    if rec is not None:
                        self._recorder.failed(rec, err)
                    raise
            self._done = True
            if self._span is not None:
                self._span.end()
            if rec is not None:
                self._recorder.end(rec)
        return True

    def is_completed(self) -> bool:
        """True once `wait()` has returned."""
        return self._done


def premul_sum(factor: float | torch.Tensor) -> ReduceOp:
    """The reduction sum(factor * x_i): e.g. an average with the division folded into the sum."""
    return dist._make_nccl_premul_sum(factor)


def to_global_rank(group: ProcessGroup, rank: int, name: str) -> int:
    """The global rank of group-local `rank`, with an error naming the argument when out of range."""
    size = dist.get_world_size(group)
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
        raise ValueError(f"{name}={rank!r} must be a group-local rank in [0, {size}) for this group of "
                         f"{size} ranks; convert a global rank with dist.get_group_rank(group, rank)")
    return dist.get_global_rank(group, rank)


def logged_call(name: str, group: ProcessGroup, logger: CommsLogger | None, async_op: bool,
                nbytes: Callable[[], int], device: torch.device,
                issue: Callable[[], dist.Work | None], tensor: torch.Tensor | None = None,
                exact: bool = True, transfers: list[tuple[str, int]] | None = None) -> Handle | None:
    """Run `issue()`, timed from issue to completion if `logger` records `name`, and noted by
    the flight recorder when the hang detector is on.

    `tensor` is the per-rank buffer the recorder describes; `exact` says every rank passes as
    many elements (strict mode compares them); `transfers` marks a point-to-point call: its
    ("send" | "recv", global peer rank) pairs.
    """
    recorder = flight.active
    rec = None
    if recorder is not None:
        if transfers is None:
            rec = recorder.collective(name, group, tensor, not async_op, exact)
        else:
            rec = recorder.p2p(name, transfers, tensor, not async_op)
    span = None
    if logger is not None and logger.enabled:
        span = logger.begin(name, nbytes(), dist.get_world_size(group), device)
    try:
        work = issue()
    except BaseException as err:
        if rec is not None:
            recorder.failed(rec, err)
        raise
    if async_op:
        return Handle(work, span, rec, recorder)
    if span is not None:
        span.end()
    if rec is not None:
        recorder.end(rec)
    return None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _reduction(op: ReduceOp, tensor: torch.Tensor, group: ProcessGroup) -> tuple[ReduceOp, object]:
    """The op to issue, and the PREMUL_SUM factor to apply first when the backend lacks it."""
    if op == ReduceOp.AVG and not (tensor.is_floating_point() or tensor.is_complex()):
        raise TypeError(f"ReduceOp.AVG needs a floating-point tensor, got {tensor.dtype}: an integer "
                        f"mean would have to be rounded; reduce with ReduceOp.SUM and divide as intended")
    if op == ReduceOp.PREMUL_SUM and dist.get_backend(group) == "gloo":
        return ReduceOp.SUM, op.factor
    return op, None


def _flat_output(output: torch.Tensor, expected_numel: int, name: str, other: torch.Tensor) -> torch.Tensor:
    if output.numel() != expected_numel:
        raise ValueError(f"{name}: output has {output.numel()} elements, expected {expected_numel} "
                         f"(group size x input elements for all_gather, input elements / group size "
                         f"for reduce_scatter)")
    if output.dtype != other.dtype:
        raise TypeError(f"{name}: output dtype {output.dtype} differs from input dtype {other.dtype}")
    if not output.is_contiguous():
        raise ValueError(f"{name}: output must be contiguous (it is written through a flat view); "
                         f"pass a contiguous tensor and copy from it")
    return output if output.dim() == 1 else output.view(-1)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.dim() == 1 else t.reshape(-1)


def broadcast(tensor: torch.Tensor, src: int, *, group: ProcessGroup, async_op: bool = False,
              logger: CommsLogger | None = None) -> Handle | None:
    """Copy group rank `src`'s `tensor` into `tensor` on every rank of the group."""
    gsrc = to_global_rank(group, src, "src")
    return logged_call("broadcast", group, logger, async_op, lambda: _nbytes(tensor), tensor.device,
                       lambda: dist.broadcast(tensor, gsrc, group=group, async_op=async_op), tensor)


def scatter(output: torch.Tensor, inputs: Sequence[torch.Tensor] | None, src: int, *,
            group: ProcessGroup, async_op: bool = False, logger: CommsLogger | None = None) -> Handle | None:
    """Group rank i receives `inputs[i]` of group rank `src` in `output`; `inputs` is None off src."""
    gsrc = to_global_rank(group, src, "src")
    scatter_list = list(inputs) if inputs is not None else None
    return logged_call("scatter", group, logger, async_op,
                       lambda: _nbytes(output) * dist.get_world_size(group), output.device,
                       lambda: dist.scatter(output, scatter_list, src=gsrc, group=group, async_op=async_op),
                       output)


def reduce(tensor: torch.Tensor, dst: int, op: ReduceOp = ReduceOp.SUM, *, group: ProcessGroup,
           async_op: bool = False, logger: CommsLogger | None = None) -> Handle | None:
    """Group rank `dst`'s `tensor` becomes the reduction of every rank's `tensor`.

    On the other ranks `tensor` is left unspecified: gloo uses it as scratch space.
    """
    gdst = to_global_rank(group, dst, "dst")
    op, factor = _reduction(op, tensor, group)
    if factor is not None:
        tensor.mul_(factor)
    return logged_call("reduce", group, logger, async_op, lambda: _nbytes(tensor), tensor.device,
                       lambda: dist.reduce(tensor, gdst, op=op, group=group, async_op=async_op), tensor)


def all_reduce(tensor: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *, group: ProcessGroup,
               async_op: bool = False, logger: CommsLogger | None = None) -> Handle | None:
    """Every rank's `tensor` becomes the reduction of all of them (in place)."""
    op, factor = _reduction(op, tensor, group)
    if factor is not None:
        tensor.mul_(factor)
    return logged_call("all_reduce", group, logger, async_op, lambda: _nbytes(tensor), tensor.device,
                       lambda: dist.all_reduce(tensor, op=op, group=group, async_op=async_op), tensor)


def gather(tensor: torch.Tensor, outputs: Sequence[torch.Tensor] | None, dst: int, *,
           group: ProcessGroup, async_op: bool = False, logger: CommsLogger | None = None) -> Handle | None:
    """Group rank `dst` receives rank i's `tensor` in `outputs[i]`; `outputs` is None off dst."""
    gdst = to_global_rank(group, dst, "dst")
    gather_list = list(outputs) if outputs is not None else None
    return logged_call("gather", group, logger, async_op,
                       lambda: _nbytes(tensor) * dist.get_world_size(group), tensor.device,
                       lambda: dist.gather(tensor, gather_list, dst=gdst, group=group, async_op=async_op),
                       tensor)


def all_gather(output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup,
               async_op: bool = False, logger: CommsLogger | None = None) -> Handle | None:
    """`output` holds every rank's `input` back to back, in group-rank order.

    `output` has group_size * input.numel() elements, shaped flat or as the dim-0
    concatenation of the inputs (any shape with that many elements, contiguous).
    """
    n = dist.get_world_size(group)
    flat_out = _flat_output(output, n * input.numel(), "all_gather", input)
    flat_in = _flat(input)
    return logged_call("all_gather", group, logger, async_op, lambda: _nbytes(output), output.device,
                       lambda: _all_gather_flat(flat_out, flat_in, group=group, async_op=async_op), input)


def all_gather_coalesced(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                         group: ProcessGroup, async_op: bool = False,
                         logger: CommsLogger | None = None) -> Handle | None:
    """Several all-gathers issued as one (one NCCL group call, gloo's coalesced op): `outputs[k]`
    holds every rank's `inputs[k]` back to back. Each output is its own buffer, so gathering
    several units costs neither a concatenation of the inputs nor a copy out of a joint result.
    Logged as one "all_gather" of all the bytes."""
    if len(outputs) == 1:
        return all_gather(outputs[0], inputs[0], group=group, async_op=async_op, logger=logger)
    n = dist.get_world_size(group)
    pairs = [(_flat_output(o, n * i.numel(), "all_gather", i), _flat(i)) for o, i in zip(outputs, inputs)]

    def issue():
        with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
            for out, inp in pairs:
                _all_gather_flat(out, inp, group=group)
        return cm if async_op else None
    return logged_call("all_gather", group, logger, async_op, lambda: sum(_nbytes(o) for o in outputs),
                       inputs[0].device, issue, inputs[0])


def reduce_scatter_coalesced(outputs: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], *,
                             group: ProcessGroup, async_op: bool = False,
                             logger: CommsLogger | None = None) -> Handle | None:
    """Several SUM reduce-scatters issued as one: `outputs[k]` becomes this rank's chunk of the sum
    of every rank's `inputs[k]`. Logged as one "reduce_scatter" of all the bytes."""
    if len(outputs) == 1:
        return reduce_scatter(outputs[0], inputs[0], group=group, async_op=async_op, logger=logger)
    n = dist.get_world_size(group)
    pairs = []
    for o, i in zip(outputs, inputs):
        if i.numel() % n != 0:
            raise ValueError(f"reduce_scatter: input has {i.numel()} elements, not a multiple of the group "
                             f"size {n}; pad the input to a multiple of {n}")
        pairs.append((_flat_output(o, i.numel() // n, "reduce_scatter", i), _flat(i)))

    def issue():
        with dist._coalescing_manager(group=group, async_ops=async_op) as cm:
            for out, inp in pairs:
                _reduce_scatter_flat(out, inp, op=ReduceOp.SUM, group=group)
        return cm if async_op else None
    return logged_call("reduce_scatter", group, logger, async_op, lambda: sum(_nbytes(i) for i in inputs),
                       inputs[0].device, issue, inputs[0])


def all_gather_list(outputs: Sequence[torch.Tensor], input: torch.Tensor, *, group: ProcessGroup,
                    async_op: bool = False, logger: CommsLogger | None = None) -> Handle | None:
    """`outputs[i]` receives group rank i's `input` (all inputs of one shape)."""
    outputs = list(outputs)
    return logged_call("all_gather_list", group, logger, async_op, lambda: _nbytes(input) * len(outputs),
                       input.device, lambda: dist.all_gather(outputs, input, group=group, async_op=async_op),
                       input)


def reduce_scatter(output: torch.Tensor, input: torch.Tensor, op: ReduceOp = ReduceOp.SUM, *,
                   group: ProcessGroup, async_op: bool = False,
                   logger: CommsLogger | None = None) -> Handle | None:
    """Group rank i's `output` becomes the reduction over ranks of chunk i of their `input`.

    `input` has group_size * output.numel() elements; chunk i is its i-th run of
    output.numel() elements in flat (row-major) order.
    """
    n = dist.get_world_size(group)
    if input.numel() % n != 0:
        raise ValueError(f"reduce_scatter: input has {input.numel()} elements, not a multiple of the "
                         f"group size {n}; pad the input to a multiple of {n}")
    flat_out = _flat_output(output, input.numel() // n, "reduce_scatter", input)
    op, factor = _reduction(op, output, group)
    flat_in = _flat(input) if factor is None else _flat(input) * factor
    return logged_call("reduce_scatter", group, logger, async_op, lambda: _nbytes(input), input.device,
                       lambda: _reduce_scatter_flat(flat_out, flat_in, op=op, group=group, async_op=async_op),
                       input)


def all_to_all(output: torch.Tensor, input: torch.Tensor, *, group: ProcessGroup,
               output_split_sizes: Sequence[int] | None = None, input_split_sizes: Sequence[int] | None = None,
               async_op: bool = False, logger: CommsLogger | None = None) -> Handle | None:
    """Rank i sends the j-th dim-0 slice of its `input` to rank j, which stores it as slice i.

    Without split sizes the slices are equal (dim 0 / group size rows); with them, slice j of
    `input` has input_split_sizes[j] rows and slice i of `output` output_split_sizes[i] rows,
    which must match what rank i sends.
    """
    out_splits = list(output_split_sizes) if output_split_sizes is not None else None
    in_splits = list(input_split_sizes) if input_split_sizes is not None else None
    return logged_call("all_to_all", group, logger, async_op, lambda: _nbytes(input), input.device,
                       lambda: dist.all_to_all_single(output, input, out_splits, in_splits,
                                                      group=group, async_op=async_op),
                       input, exact=out_splits is None and in_splits is None)


def barrier(*, group: ProcessGroup, logger: CommsLogger | None = None) -> None:
    """Return once every rank of the group has called barrier."""
    logged_call("barrier", group, logger, False, lambda: 0, torch.device("cpu"),
                lambda: dist.barrier(group=group))


def all_gather_object(outputs: list, obj: object, *, group: ProcessGroup) -> None:
    """`outputs[i]` receives group rank i's picklable `obj` (`outputs` has group-size entries)."""
    logged_call("all_gather_object", group, None, False, lambda: 0, torch.device("cpu"),
                lambda: dist.all_gather_object(outputs, obj, group=group))


def broadcast_object_list(objects: list, src: int, *, group: ProcessGroup) -> None:
    """Every rank's `objects` becomes group rank `src`'s (picklable entries, same length)."""
    gsrc = to_global_rank(group, src, "src")
    logged_call("broadcast_object_list", group, None, False, lambda: 0, torch.device("cpu"),
                lambda: dist.broadcast_object_list(objects, src=gsrc, group=group))
