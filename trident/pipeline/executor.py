"""Run one stage's instruction list: compute, batched point-to-point transfers, failure draining.

What crosses the wire, between neighbouring virtual stages (`instructions` explains them):

    forward   the chunk's output, a tensor or a tuple of tensors, on the activation channel
    backward  the gradient of every floating-point tensor of that tuple, on the gradient channel

Activations and gradients use two process groups over the same ranks, so each channel is
first-in-first-out on its own and the schedules keep every channel's sends and receives in the
same order on both ends (the simulator checks it). A run of adjacent transfer instructions is
posted together through trident.comm.p2p (each recorded by the hang detector); the stage then
waits for its receives only.
Sends are waited for at the end of the step, so a stage never blocks on a peer that is
itself waiting: this is the execution model under which `simulate` proves a schedule
deadlock-free. After each batch the next receive of each channel is posted ahead of time, so
its data can arrive while the stage computes (a large message cannot wait in the socket
buffers: without a posted receive it would move only once the receiver asks for it). That
only moves a receive earlier, in channel order, and waits stay where they were.

Shapes are exchanged once: before the first activation of a chunk the sender sends its
metadata (count, dtypes, shapes); both ends cache it, and later transfers allocate from the
cache. Changed shapes raise an error that names the chunk and both shapes.

Gradients accumulate locally: every backward runs as a non-boundary pass of the engine's
gradient strategy (`start_backward(boundary=False)`, `finish_backward()`), so nothing but
point-to-point traffic happens until the step instructions, which the engine runs.

A stage that raises does not leave its peers waiting. It records the error and *drains* the
rest of its list: it posts every send it still owes (zeros of the cached shapes) and every
receive, and skips compute, so every rank reaches the end of the list, where the engine's
agreement turns the error into the same exception on every rank.
"""

from __future__ import annotations

import contextlib
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist

from trident.comm import p2p
from trident.comm.collectives import Handle
import trident.pipeline.aux_loss as aux_loss
from trident.pipeline.instructions import (
    COMM,
    RECVS,
    Backward,
    BackwardInput,
    BackwardWeight,
    Forward,
    Instruction,
    LoadMicroBatch,
    MicroInstruction,
    RecvActivation,
    RecvGrad,
    SendGrad,
    channel_kind,
    peer,
)
from trident.pipeline.module import PipelineModule
from trident.pipeline.simulate import Span
from trident.pipeline.weight_grad import WeightGradStore, defer_weight_grads

_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32,
           torch.int16, torch.int8, torch.uint8, torch.bool]
Meta = tuple[tuple[torch.dtype, tuple[int, ...]], ...]
_PLACEHOLDER: Meta = ((torch.float32, (1,)),)  # what a failed stage announces for outputs it never made


class PipelineError(RuntimeError):
    """A pipeline stage failed; raised on every rank of the pipeline with that stage's error."""


@dataclass
class StageResult:
    """What one stage's run produced: last-stage losses, or the error it raised."""

    # 0-dim tensors on the stage's device, read on the host only when the step needs them
    losses: list[torch.Tensor] = field(default_factory=list)
    aux_losses: list[torch.Tensor] = field(default_factory=list)  # this stage's auxiliary losses, per micro-batch
    counts: list[torch.Tensor] = field(default_factory=list)  # token-weighted runs: each loss's counted tokens
    error: str | None = None
    failed_at: float | None = None
    exception: BaseException | None = None


class StageExecutor:
    """Interprets instruction lists for `module`'s stage.

    `act_group` and `grad_group` are two process groups over the pipeline's ranks in stage
    order (None with one stage). `strategy` is the engine's gradient strategy (None to skip the
    calls around each backward pass).
    """

    def __init__(self, module: PipelineModule, act_group: dist.ProcessGroup | None,
                 grad_group: dist.ProcessGroup | None, compute_dtype: torch.dtype = torch.float32,
                 strategy: Any = None) -> None:
        self.module = module
        self.stage, self.stages = module.stage_id, module.num_stages
        self.groups = {"act": act_group, "grad": grad_group}
        self.compute_dtype = compute_dtype
        self.strategy = strategy
        tensors = list(module.parameters()) + list(module.buffers())
        self.device = tensors[0].device if tensors else torch.device("cpu")  # where transfers land
        self.record = False  # keep a trace of the last run, for benchmarks
        self.trace: list[Span] = []  # times in seconds after trace_start (a time.perf_counter() value)
        self.trace_start = 0.0
        self._sent_meta: dict[int, Meta] = {}
        self._recv_meta: dict[int, Meta] = {}

    def reset_shapes(self) -> None:
        """Forget the cached shapes; every rank must call it before the same step."""
        self._sent_meta.clear()
        self._recv_meta.clear()

    # -- the step --------------------------------------------------------------------------

    def run(self, program: Sequence[Instruction], data_iter: Iterator | None, loss_scale: float = 1.0,
            train: bool = True, token_weighted: bool = False) -> StageResult:
        """Execute the micro-batch instructions of `program`; a stage error is returned, not raised.
        `token_weighted`: the last stage backpropagates each loss times its counted tokens
        (`loss_fn.loss_tokens(labels)`), and the step divides by the global count."""
        self._begin(program, data_iter, loss_scale, train)
        self._token_weighted = token_weighted
        if self.record:
            self.trace, self.trace_start = [], time.perf_counter()
        result = StageResult()
        broken = False
        with torch.enable_grad() if train else torch.no_grad(), \
                aux_loss.training_run(loss_scale) if train else contextlib.nullcontext():
            for item in _batches(program):
                if result.error is None:
                    t0 = time.perf_counter()
                    try:
                        self._execute(item)
                        self._note(item, t0)
                        continue
                    except Exception as exc:
                        result.error = f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"
                        result.failed_at, result.exception = time.time(), exc
                try:
                    self._drain(item)
                except Exception:
                    broken = True  # the transport itself failed: nothing more can be exchanged
                    break
        if not broken:
            for work in self._inflight:
                work.wait()
        result.losses = list(self._losses) if result.error is None else []
        result.aux_losses = list(self._aux.values()) if result.error is None else []
        result.counts = list(self._counts.values()) if result.error is None else []
        self._begin((), None, 1.0, train)  # drop the step's tensors
        return result

    def _begin(self, program: Sequence[Instruction], data_iter: Iterator | None, loss_scale: float,
               train: bool) -> None:
        self._data_iter, self._loss_scale, self._train = data_iter, loss_scale, train
        self._split = any(isinstance(i, BackwardWeight) for i in program)
        self._inputs: dict[int, Any] = {}
        self._labels: dict[int, Any] = {}
        self._received: dict[tuple[int, int], tuple[torch.Tensor, ...]] = {}
        self._outputs: dict[tuple[int, int], Any] = {}
        self._grads_out: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._grads_in: dict[tuple[int, int], list[torch.Tensor]] = {}
        self._stores: dict[tuple[int, int], WeightGradStore] = {}
        self._losses: list[torch.Tensor] = []
        self._aux: dict[int, torch.Tensor] = {}  # micro-batch -> its auxiliary losses on this stage
        self._counts: dict[int, torch.Tensor] = {}  # micro-batch -> its loss's counted tokens (token-weighted)
        self._inflight: list[Handle] = []  # sends, waited at the end of the run
        self._keep: list[Any] = []  # tensors being sent
        self._posted: set[Instruction] = set()
        self._upcoming = {kind: deque(i for i in program if isinstance(i, RECVS) and channel_kind(i) == kind)
                          for kind in ("act", "grad")}  # each channel's receives, in program order
        self._early: dict[Instruction, tuple[list[torch.Tensor], list[Handle]]] = {}  # posted ahead

    def _note(self, item: Instruction | tuple, t0: float) -> None:
        if self.record:
            t1 = time.perf_counter()
            for instr in item if isinstance(item, tuple) else (item,):
                self.trace.append(Span(instr, t0 - self.trace_start, t1 - self.trace_start))

    def _execute(self, item: Instruction | tuple) -> None:
        if isinstance(item, tuple):
            self._exchange(item, drain=False)
        elif isinstance(item, LoadMicroBatch):
            self._load(item.micro)
        elif isinstance(item, Forward):
            self._forward(item.micro, item.chunk)
        elif isinstance(item, (Backward, BackwardInput)):
            self._backward(item)
        elif isinstance(item, BackwardWeight):
            self._weight(item)
        else:
            raise TypeError(f"the stage executor does not run {item!r}; the engine runs the step instructions")

    def _drain(self, item: Instruction | tuple) -> None:
        """Keep the peers going after this stage failed: only the transfers it owes them."""
        if isinstance(item, tuple):
            self._exchange(item, drain=True)

    # -- compute ---------------------------------------------------------------------------

    def _load(self, micro: int) -> None:
        if self._data_iter is None:
            raise ValueError(f"pipeline stage {self.stage} reads micro-batches but data_iter is None; pass "
                             f"an iterator of (inputs, labels) to train_batch / eval_batch on this stage")
        batch = next(self._data_iter)
        if not (isinstance(batch, (tuple, list)) and len(batch) == 2):
            raise ValueError(f"data_iter must yield (inputs, labels) pairs, got {type(batch).__name__}"
                             + (f" of length {len(batch)}" if isinstance(batch, (tuple, list)) else ""))
        inputs, labels = batch
        if self.module.is_first(0):
            self._inputs[micro] = _cast_floats(inputs, self.compute_dtype)
        if self.stage == self.stages - 1:
            self._labels[micro] = labels

    def _forward(self, micro: int, chunk: int) -> None:
        if self.module.is_first(chunk):
            x = self._inputs.pop(micro)
        else:  # training keeps the received inputs: backward sends their gradients
            received = self._received[(micro, chunk)] if self._train else self._received.pop((micro, chunk))
            x = received[0] if len(received) == 1 else received
        store = WeightGradStore() if self._split and self._train else None
        defer = store is not None and self.module.activation_checkpoint_interval == 0
        with defer_weight_grads(store) if defer else contextlib.nullcontext(), aux_loss.collecting() as aux:
            out = self.module.run_chunk(chunk, x)
        if aux:
            self._aux[micro] = sum(aux, self._aux.get(micro, torch.zeros(())))
        if store is not None:
            self._stores[(micro, chunk)] = store
        if self.module.is_last(chunk):
            labels = self._labels.pop(micro)
            if getattr(self, "_token_weighted", False):
                self._counts[micro] = self.module.loss_fn.loss_tokens(labels)
            loss = self.module.loss_fn(out, labels) if self.module.loss_fn else out
            if not (isinstance(loss, torch.Tensor) and loss.numel() == 1):
                raise ValueError(f"the pipeline's loss must be a scalar tensor, got {_describe(loss)}; give "
                                 f"PipelineModule a loss_fn(outputs, labels) that returns one number")
            self._losses.append(loss.detach())
            if self._train:
                self._outputs[(micro, chunk)] = loss
        else:
            self._outputs[(micro, chunk)] = _as_tensors(out, self.stage, chunk)

    def _backward(self, instr: MicroInstruction) -> None:
        key = (instr.micro, instr.chunk)
        self._start_backward()
        out = self._outputs.pop(key)
        if self.module.is_last(instr.chunk):
            scale = self._loss_scale * self._counts[instr.micro].float() if instr.micro in self._counts \
                else self._loss_scale
            (out.float() * scale).backward()
        else:
            floats = [o for o in out if o.is_floating_point()]
            pairs = [(o, g) for o, g in zip(floats, self._grads_out.pop(key)) if o.requires_grad]
            if pairs:
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        if not self.module.is_first(instr.chunk):
            inputs = self._received.pop(key)
            self._grads_in[key] = [x.grad if x.grad is not None else torch.zeros_like(x)
                                   for x in inputs if x.is_floating_point()]
        self._finish_backward()

    def _weight(self, instr: BackwardWeight) -> None:
        self._start_backward()
        self._stores.pop((instr.micro, instr.chunk)).flush()
        self._finish_backward()

    def _start_backward(self) -> None:
        if self.strategy is not None:
            self.strategy.start_backward(boundary=False)

    def _finish_backward(self) -> None:
        if self.strategy is not None:
            self.strategy.finish_backward()

    # -- transfers -------------------------------------------------------------------------

    def _exchange(self, batch: tuple[MicroInstruction, ...], drain: bool) -> None:
        """Post a batch (sends first), then wait for its receives."""
        todo = [i for i in batch if i not in self._posted]
        ops: dict[str, list] = {"act": [], "grad": []}
        sends = [i for i in todo if not isinstance(i, RECVS)]
        for instr in sends:
            for t in self._send_tensors(instr, drain):
                ops[channel_kind(instr)].append(self._op("send", t, instr))
        recvs = [i for i in todo if isinstance(i, RECVS)]
        if any(isinstance(i, RecvActivation) and i.chunk not in self._recv_meta for i in recvs):
            self._post(ops, sends)  # peers may wait on these before they send us the metadata
            ops, sends = {"act": [], "grad": []}, []
            for instr in recvs:
                if isinstance(instr, RecvActivation) and instr.chunk not in self._recv_meta:
                    self._recv_meta[instr.chunk] = self._receive_meta(instr)
        buffers = {}
        for instr in recvs:
            buffers[instr] = self._recv_buffers(instr)
            ops[channel_kind(instr)] += [self._op("recv", b, instr) for b in buffers[instr]]
        waits = self._post(ops, sends + recvs)
        for instr in (i for i in batch if i in self._early):
            buffers[instr], works = self._early.pop(instr)
            waits += works
        for work in waits:
            work.wait()
        for instr in batch:
            if isinstance(instr, RECVS):
                self._upcoming[channel_kind(instr)].popleft()
        if not drain:
            for instr, bufs in buffers.items():
                self._deliver(instr, bufs)
        self._post_next_receives()

    def _post_next_receives(self) -> None:
        """Post each channel's next receive now if its shapes are known (see the module docstring)."""
        for queue in self._upcoming.values():
            instr = queue[0] if queue else None
            if instr is None or instr in self._posted:
                continue
            known = self._recv_meta if isinstance(instr, RecvActivation) else self._sent_meta
            if instr.chunk in known:
                bufs = self._recv_buffers(instr)
                ops = {channel_kind(instr): [self._op("recv", b, instr) for b in bufs]}
                self._early[instr] = (bufs, self._post(ops, [instr]))

    def _op(self, kind: str, tensor: torch.Tensor, instr: MicroInstruction) -> tuple:
        """One transfer of `instr`'s channel: ("send" | "recv", tensor, group-local peer, group)."""
        channel = channel_kind(instr)
        return kind, tensor, peer(instr, self.stage, self.stages)[0], self.groups[channel]

    def _issue(self, op: tuple) -> Handle:
        """Start one transfer through trident.comm.p2p (so the hang detector records it)."""
        kind, tensor, other, group = op
        start = p2p.isend if kind == "send" else p2p.irecv
        return start(tensor, other, group=group)

    def _post(self, ops: dict[str, list], instrs: Sequence[Instruction]) -> list[Handle]:
        """Issue every op at once (all posted before any wait, so no order deadlocks); returns
        the receive handles (sends are kept and waited at the end of the run)."""
        recv_works = []
        for kind_ops in ops.values():
            for op in kind_ops:
                (recv_works if op[0] == "recv" else self._inflight).append(self._issue(op))
        self._posted.update(instrs)
        return recv_works

    def _send_tensors(self, instr: MicroInstruction, drain: bool) -> list[torch.Tensor]:
        key = (instr.micro, instr.chunk)
        if isinstance(instr, SendGrad):
            if drain:
                grads = [torch.zeros(shape, dtype=dtype, device=self.device)
                         for dtype, shape in self._recv_meta[instr.chunk] if dtype.is_floating_point]
            else:
                grads = [g.contiguous() for g in self._grads_in.pop(key)]
            self._keep.append(grads)
            return grads
        if drain:
            meta = self._sent_meta.get(instr.chunk, _PLACEHOLDER)
            tensors = [torch.zeros(shape, dtype=dtype, device=self.device) for dtype, shape in meta]
        else:
            outputs = self._outputs[key] if self._train else self._outputs.pop(key)  # backward needs them
            tensors = [t.detach().contiguous() for t in outputs]
            meta = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        cached = self._sent_meta.get(instr.chunk)
        if cached is None:
            self._send_meta(instr, meta)
        elif cached != meta:
            raise ValueError(
                f"pipeline stage {self.stage} chunk {instr.chunk}: micro-batch {instr.micro}'s output is "
                f"{_show(meta)} but earlier micro-batches sent {_show(cached)}; shapes are exchanged once, so "
                f"keep micro-batch shapes fixed, or call engine.reset_activation_shape() on every rank first")
        self._keep.append(tensors)
        return tensors

    def _send_meta(self, instr: MicroInstruction, meta: Meta) -> None:
        body = [len(meta)]
        for dtype, shape in meta:
            body += [_DTYPES.index(dtype), len(shape), *shape]
        header = torch.tensor([len(body)], dtype=torch.int64, device=self.device)
        payload = torch.tensor(body, dtype=torch.int64, device=self.device)
        self._keep.append((header, payload))
        for t in (header, payload):
            self._inflight.append(self._issue(self._op("send", t, instr)))
        self._sent_meta[instr.chunk] = meta

    def _receive_meta(self, instr: RecvActivation) -> Meta:
        header = torch.empty(1, dtype=torch.int64, device=self.device)
        self._issue(self._op("recv", header, instr)).wait()
        body = torch.empty(int(header.item()), dtype=torch.int64, device=self.device)
        self._issue(self._op("recv", body, instr)).wait()
        values, meta, pos = body.tolist(), [], 1
        for _ in range(values[0]):
            ndim = values[pos + 1]
            meta.append((_DTYPES[values[pos]], tuple(values[pos + 2:pos + 2 + ndim])))
            pos += 2 + ndim
        return tuple(meta)

    def _recv_buffers(self, instr: MicroInstruction) -> list[torch.Tensor]:
        if isinstance(instr, RecvActivation):
            meta = self._recv_meta[instr.chunk]
        else:  # gradients of the floating-point outputs this chunk sent
            meta = tuple(m for m in self._sent_meta[instr.chunk] if m[0].is_floating_point)
        return [torch.empty(shape, dtype=dtype, device=self.device) for dtype, shape in meta]

    def _deliver(self, instr: MicroInstruction, bufs: list[torch.Tensor]) -> None:
        key = (instr.micro, instr.chunk)
        if isinstance(instr, RecvGrad):
            self._grads_out[key] = bufs
            return
        if self._train:
            for b in bufs:
                if b.is_floating_point():
                    b.requires_grad_(True)
        self._received[key] = tuple(bufs)


def _batches(program: Sequence[Instruction]) -> list[Instruction | tuple]:
    """The program with every run of adjacent transfers grouped into one tuple."""
    items: list[Instruction | tuple] = []
    run: list[Instruction] = []
    for instr in program:
        if isinstance(instr, COMM):
            run.append(instr)
            continue
        if run:
            items.append(tuple(run))
            run = []
        items.append(instr)
    if run:
        items.append(tuple(run))
    return items


def _as_tensors(out: Any, stage: int, chunk: int) -> tuple[torch.Tensor, ...]:
    outs = out if isinstance(out, (tuple, list)) else (out,)
    if not outs or not all(isinstance(t, torch.Tensor) for t in outs):
        raise TypeError(f"pipeline stage {stage} chunk {chunk} returned {_describe(out)}; a stage's last layer "
                        f"must return a tensor or a tuple of tensors (they are sent to the next stage)")
    if any(t.dtype not in _DTYPES for t in outs):
        raise TypeError(f"pipeline stage {stage} chunk {chunk} returned dtypes {[t.dtype for t in outs]}; "
                        f"tensors sent between stages must be one of {_DTYPES}")
    return tuple(outs)


def _cast_floats(obj: Any, dtype: torch.dtype) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() and dtype != obj.dtype else obj
    if isinstance(obj, (tuple, list)):
        return type(obj)(_cast_floats(x, dtype) for x in obj)
    return obj


def _describe(obj: Any) -> str:
    if isinstance(obj, torch.Tensor):
        return f"a tensor of shape {tuple(obj.shape)}"
    if isinstance(obj, (tuple, list)):
        return f"a {type(obj).__name__} of ({', '.join(type(x).__name__ for x in obj)})"
    return f"a {type(obj).__name__}"


def _show(meta: Meta) -> str:
    return ", ".join(f"{str(d).replace('torch.', '')}{list(s)}" for d, s in meta)
