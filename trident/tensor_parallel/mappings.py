"""The communication of tensor parallelism as conjugate autograd pairs.

Each function enters or leaves the *tp region* (where a tensor is split, or partially summed,
over the tp ranks) and is an autograd Function whose backward is the conjugate of its
forward: what is an all-reduce one way is an identity the other, a split one way is an
all-gather the other. With these four (plus the sequence-parallel pair) a layer's parallel
maths is written once and its gradients follow.

    function                                    forward                  backward
    copy_to_tp_region                           identity                 all-reduce
    reduce_from_tp_region                       all-reduce               identity
    scatter_to_tp_region                        split last dim           all-gather last dim
    gather_from_tp_region                       all-gather last dim      split last dim
    gather_from_sequence_parallel_region        all-gather along seq     reduce-scatter along seq
    reduce_scatter_to_sequence_parallel_region  reduce-scatter along seq all-gather along seq
    scatter_to_sequence_parallel_region         split along seq          all-gather along seq

"seq" is dimension `dim` (default 1: trident's activations are [batch, seq, hidden]). A split
keeps this rank's chunk (chunk tp_rank of tp_size equal chunks); a gather concatenates the
ranks' chunks in tp-rank order. Collectives go through trident.comm.collectives with the
group and the optional CommsLogger given, and never modify an autograd input in place. On a
group of one rank every function is the identity and sends nothing.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from trident.comm import collectives
from trident.comm.logger import CommsLogger

ProcessGroup = dist.ProcessGroup
SEQUENCE_DIM = 1

_EAGER_CALLS: list[list] = []


def _eager(fn):
    """Run `fn` eagerly inside a torch.compile'd block (trident.engine.compile): its collective
    (with trident's logger and flight recorder) is one clean graph break, instead of dynamo
    compiling small graphs inside the autograd function's eager fallback. The call goes through
    a cell that `keep_mappings_eager` points at `torch.compiler.disable(fn)` once compilation is
    on, so importing trident does not import dynamo (about a second per process)."""
    impl = [fn]

    @functools.wraps(fn)
    def call(*args, **kwargs):
        return impl[0](*args, **kwargs)
    _EAGER_CALLS.append(impl)
    return call


def keep_mappings_eager() -> None:
    """Make every mapping a graph break for torch.compile (called before the first compile)."""
    for impl in _EAGER_CALLS:
        if not getattr(impl[0], "_trident_eager", False):
            impl[0] = torch.compiler.disable(impl[0])
            impl[0]._trident_eager = True


def _size(group: ProcessGroup) -> int:
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: ProcessGroup, logger: CommsLogger | None) -> torch.Tensor:
    out = x.contiguous().clone()
    collectives.all_reduce(out, group=group, logger=logger)
    return out


def _split(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of a tensor of shape {tuple(x.shape)} into {n} equal "
                         f"tp chunks: {x.shape[dim]} is not divisible by tp={n}; make that size a multiple "
                         f"of {n}")
    return x.chunk(n, dim=dim)[dist.get_rank(group)].contiguous()


def _gather(x: torch.Tensor, dim: int, group: ProcessGroup, logger: CommsLogger | None) -> torch.Tensor:
    n = _size(group)
    buf = torch.empty((n,) + tuple(x.shape), dtype=x.dtype, device=x.device)
    collectives.all_gather(buf, x.contiguous(), group=group, logger=logger)
    return torch.cat(buf.unbind(0), dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup, logger: CommsLogger | None) -> torch.Tensor:
    n = _size(group)
    if x.shape[dim] % n:
        raise ValueError(f"cannot reduce-scatter dim {dim} of a tensor of shape {tuple(x.shape)} over tp={n}: "
                         f"{x.shape[dim]} is not divisible by {n}; make the sequence length a multiple of {n}")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // n,) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    collectives.reduce_scatter(out, front, group=group, logger=logger)
    return out.movedim(0, dim).contiguous()


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, logger):
        ctx.group, ctx.logger = group, logger
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group, ctx.logger), None, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, logger):
        return _all_reduce(x, group, logger)

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _ScatterToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, logger):
        ctx.group, ctx.logger = group, logger
        return _split(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, -1, ctx.group, ctx.logger), None, None


class _GatherFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, logger):
        ctx.group = group
        return _gather(x, -1, group, logger)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, -1, ctx.group), None, None


class _GatherFromSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, logger, dim):
        ctx.group, ctx.logger, ctx.dim = group, logger, dim
        return _gather(x, dim, group, logger)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group, ctx.logger), None, None, None


class _ReduceScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, logger, dim):
        ctx.group, ctx.logger, ctx.dim = group, logger, dim
        return _reduce_scatter(x, dim, group, logger)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.logger), None, None, None


class _ScatterToSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, logger, dim):
        ctx.group, ctx.logger, ctx.dim = group, logger, dim
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.dim, ctx.group, ctx.logger), None, None, None


@_eager
def copy_to_tp_region(x: torch.Tensor, group: ProcessGroup, logger: CommsLogger | None = None) -> torch.Tensor:
    """Enter the region with a replicated tensor. Forward: identity. Backward: all-reduce (sum).

    Each rank's part of the region contributes a partial gradient of the shared input; the
    all-reduce sums them into the full gradient on every rank.
    """
    if _size(group) == 1:
        return x
    return _CopyToRegion.apply(x, group, logger)


@_eager
def reduce_from_tp_region(x: torch.Tensor, group: ProcessGroup, logger: CommsLogger | None = None) -> torch.Tensor:
    """Leave the region by summing partial results. Forward: all-reduce (sum). Backward: identity.

    The sum's gradient with respect to each rank's addend is the (replicated) output gradient.
    """
    if _size(group) == 1:
        return x
    return _ReduceFromRegion.apply(x, group, logger)


@_eager
def scatter_to_tp_region(x: torch.Tensor, group: ProcessGroup, logger: CommsLogger | None = None) -> torch.Tensor:
    """Keep this rank's chunk of the last dim. Forward: split. Backward: all-gather the last dim."""
    if _size(group) == 1:
        return x
    return _ScatterToRegion.apply(x, group, logger)


@_eager
def gather_from_tp_region(x: torch.Tensor, group: ProcessGroup, logger: CommsLogger | None = None) -> torch.Tensor:
    """Concatenate the ranks' chunks of the last dim. Forward: all-gather. Backward: split."""
    if _size(group) == 1:
        return x
    return _GatherFromRegion.apply(x, group, logger)


@_eager
def gather_from_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup, logger: CommsLogger | None = None,
                                         dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Sequence shards -> the whole sequence. Forward: all-gather along `dim`. Backward:
    reduce-scatter along `dim` (the full-sequence gradient is partial per rank, as the
    region after it is split by columns)."""
    if _size(group) == 1:
        return x
    return _GatherFromSequence.apply(x, group, logger, dim)


@_eager
def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup,
                                               logger: CommsLogger | None = None,
                                               dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """Partial sums of the whole sequence -> this rank's summed sequence shard. Forward:
    reduce-scatter along `dim`. Backward: all-gather along `dim`."""
    if _size(group) == 1:
        return x
    return _ReduceScatterToSequence.apply(x, group, logger, dim)


@_eager
def scatter_to_sequence_parallel_region(x: torch.Tensor, group: ProcessGroup, logger: CommsLogger | None = None,
                                        dim: int = SEQUENCE_DIM) -> torch.Tensor:
    """A replicated whole sequence -> this rank's shard. Forward: split along `dim`. Backward:
    all-gather along `dim`."""
    if _size(group) == 1:
        return x
    return _ScatterToSequence.apply(x, group, logger, dim)
