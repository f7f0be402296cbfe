"""Megatron-style tensor-parallel layers: a linear layer split by columns or by rows, and the
embedding split by vocabulary.

    Y = X A + b, A = [A_1 ... A_p] by columns   (ColumnParallelLinear: rank i computes X A_i + b_i)
    Y = X A + b, A = [A_1; ...; A_p] by rows    (RowParallelLinear: rank i computes X_i A_i; sum; + b)

(A is the transposed nn.Linear weight, [in, out]: columns of A are rows of `weight`.)

A column layer followed by a row layer (attention's qkv then proj, an MLP's fc then proj)
needs one all-reduce forward (the row layer's sum) and one backward (the column layer's input
gradient): a transformer layer does two of each. With `sequence_parallel`, activations
between those pairs are split along the sequence: the column layer all-gathers its input
instead of copying it, the row layer reduce-scatters its output instead of all-reducing it.

Every layer is built from the full weight and keeps its slice: the constructors draw the full
weight exactly as torch's nn.Linear / nn.Embedding would from the same seed (so tp=1 and tp=4
start from the same model), and `from_linear` / `from_embedding` slice an existing module.
Split parameters carry Megatron's attributes `tensor_model_parallel = True`, `partition_dim`
and `partition_stride`, plus `tp_spec` (a ShardSpec). Parameters without them are replicated
over the tp ranks. Replicated parameters that only see this rank's sequence shard under
sequence parallelism (a row layer's bias) carry `sequence_parallel = True` and all-reduce
their gradient over tp in backward (`mark_sequence_parallel`), so every rank holds the full
gradient when backward returns.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trident.comm import collectives
from trident.comm.logger import CommsLogger
from trident.tensor_parallel.mappings import (
    SEQUENCE_DIM,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from trident.tensor_parallel.split import ShardSpec


def set_tp_attributes(param: nn.Parameter, spec: ShardSpec) -> None:
    """Mark `param` as split over tp by `spec` (Megatron's attribute names, plus `tp_spec`)."""
    param.tensor_model_parallel = True
    param.partition_dim = spec.dim
    param.partition_stride = spec.stride
    param.tp_spec = spec


def gather_whole(local: torch.Tensor, spec: ShardSpec, group: dist.ProcessGroup) -> torch.Tensor:
    """The whole tensor from every tp rank's slice `local` (collective over `group`): all-gather,
    then merge by `spec` (fused-block stride and vocabulary padding undone)."""
    shards = [torch.empty_like(local) for _ in range(spec.tp_size)]
    collectives.all_gather_list(shards, local.contiguous(), group=group)
    return spec.merge(shards)


def is_tp_split(param: torch.Tensor) -> bool:
    """True for a parameter split over the tp ranks, False for a replicated one."""
    return bool(getattr(param, "tensor_model_parallel", False))


def mark_sequence_parallel(param: nn.Parameter, mesh, logger: CommsLogger | None = None) -> None:
    """`param` is replicated but used on sequence shards: sum its gradient over tp in backward.

    The hook acts on each backward's incoming gradient, before it is accumulated into
    `.grad`, so gradient accumulation and hooks that run after accumulation see the sum.
    """
    if getattr(param, "sequence_parallel", False):
        return
    param.sequence_parallel = True
    if mesh.tp_size == 1:
        return
    group = mesh.tp_group

    def all_reduce_grad(grad: torch.Tensor) -> torch.Tensor:
        out = grad.contiguous().clone()
        collectives.all_reduce(out, group=group, logger=logger)
        return out

    param.register_hook(all_reduce_grad)


class TPHandle:
    """The tp group, size and rank of a ParallelMesh, and the comms logger, as a layer uses them.

    copy.deepcopy shares it instead of copying it: a copied model talks to the same ranks
    (a process group cannot be copied) and counts into the same logger.
    """

    __slots__ = ("group", "size", "rank", "logger")

    def __init__(self, mesh, logger: CommsLogger | None = None) -> None:
        self.group, self.size, self.rank = mesh.tp_group, mesh.tp_size, mesh.tp_rank
        self.logger = logger

    def __deepcopy__(self, memo: dict) -> TPHandle:
        return self


class _TPModule(nn.Module):
    """Holds the tp group, size and rank from a ParallelMesh, and the optional comms logger."""

    def __init__(self, mesh, sequence_parallel: bool, logger: CommsLogger | None) -> None:
        super().__init__()
        self.tp = TPHandle(mesh, logger)
        self.sequence_parallel = sequence_parallel
        self.fp8 = None  # trident.tensor_parallel.fp8.TPFloat8 once `fp8` converts the layer

    @property
    def tp_group(self) -> dist.ProcessGroup:
        return self.tp.group

    @property
    def tp_size(self) -> int:
        return self.tp.size

    @property
    def tp_rank(self) -> int:
        return self.tp.rank

    @property
    def logger(self) -> CommsLogger | None:
        return self.tp.logger

    def tp_ranks(self) -> list[int]:
        """Global ranks of this layer's tp group."""
        return dist.get_process_group_ranks(self.tp_group)

    def _shard_param(self, full: torch.Tensor, spec: ShardSpec) -> nn.Parameter:
        param = nn.Parameter(spec.shard(full.detach(), self.tp_rank), requires_grad=full.requires_grad)
        set_tp_attributes(param, spec)
        return param


def _linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fp8) -> torch.Tensor:
    """F.linear, or its float8 GEMMs with tp-wide scales when `fp8` converted the layer."""
    if fp8 is None:
        return F.linear(x, weight, bias)
    from trident.tensor_parallel.fp8 import float8_linear
    return float8_linear(x, weight, bias, fp8)


def is_conv1d(module: nn.Module) -> bool:
    """A transformers `Conv1D` (GPT-2's linear layer): y = x W + b with W stored [in, out]."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and module.weight.dim() == 2


def linear_features(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an nn.Linear or a transformers Conv1D."""
    if is_conv1d(module):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


class ColumnParallelLinear(_TPModule):
    """Y = X W^T + b with W's output features (rows of `weight`) split over tp.

    Forward sends: nothing for the input (identity), or an all-gather along the sequence with
    `sequence_parallel`; an all-gather of the output along the last dim with `gather_output`.
    Backward sends: an all-reduce of the input gradient (a reduce-scatter along the sequence
    with `sequence_parallel`); a split of the output gradient with `gather_output` (no message).

    `gather_output=False` leaves each rank with its out_features / tp columns, ready for a
    RowParallelLinear. `skip_bias_add=True` returns (output, bias) and leaves the addition to
    the caller (to fuse it with what follows). `stride` keeps fused blocks whole: a fused
    q|k|v projection uses stride 3. `pad_vocab=True` allows out_features not divisible by tp
    for a vocabulary head: the weight is padded with zero rows to a multiple of tp (Megatron's
    convention); a gathered output is trimmed back to out_features, a local one keeps the
    pad columns for vocab_parallel_cross_entropy(vocab_size=out_features) to exclude.
    """

    def __init__(self, in_features: int, out_features: int, mesh, *, bias: bool = True,
                 gather_output: bool = False, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 stride: int = 1, pad_vocab: bool = False, logger: CommsLogger | None = None,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None,
                 _full: nn.Module | None = None) -> None:
        super().__init__(mesh, sequence_parallel, logger)
        self.transposed = _full is not None and is_conv1d(_full)
        if gather_output and stride > 1:
            raise ValueError(f"ColumnParallelLinear: gather_output=True with stride={stride} would interleave "
                             f"the fused blocks of different ranks; gather the blocks separately or use stride 1")
        try:
            self.spec = ShardSpec(1 if self.transposed else 0, out_features, self.tp_size, stride=stride,
                                  pad=pad_vocab)
            bias_spec = ShardSpec(0, out_features, self.tp_size, stride=stride, pad=pad_vocab)
        except ValueError as err:
            raise ValueError(f"ColumnParallelLinear(in_features={in_features}, out_features={out_features}): "
                             f"{err} (out_features is split over tp; pass pad_vocab=True for a vocabulary "
                             f"head, padded to a multiple of tp as in Megatron-LM)") from None
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.skip_bias_add = gather_output, skip_bias_add
        full = _full if _full is not None else nn.Linear(in_features, out_features, bias=bias, device=device,
                                                          dtype=dtype)
        self.weight = self._shard_param(full.weight, self.spec)
        self.bias = self._shard_param(full.bias, bias_spec) if full.bias is not None else None

    @classmethod
    def from_linear(cls, linear: nn.Module, mesh, **options) -> ColumnParallelLinear:
        """The column-parallel twin of `linear` (an nn.Linear, or a transformers Conv1D, whose
        weight is stored transposed and stays so), holding this rank's slice of its weights."""
        n_in, n_out = linear_features(linear)
        return cls(n_in, n_out, mesh, bias=linear.bias is not None, _full=linear, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, self.logger, SEQUENCE_DIM)
        else:
            x = copy_to_tp_region(x, self.tp_group, self.logger)
        weight = self.weight.t() if self.transposed else self.weight
        y = _linear(x, weight, None if self.skip_bias_add else self.bias, self.fp8)
        if self.gather_output:
            y = gather_from_tp_region(y, self.tp_group, self.logger)
            if y.shape[-1] != self.out_features:
                y = y[..., :self.out_features]
        return (y, self.bias) if self.skip_bias_add else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.spec.local_size} per rank, tp={self.tp_size}), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(_TPModule):
    """Y = X W^T + b with W's input features (columns of `weight`) split over tp.

    Forward sends: a split of the input when `input_is_parallel=False` (no message); an
    all-reduce of the partial outputs, or a reduce-scatter along the sequence with
    `sequence_parallel`. Backward sends: nothing for the output gradient (identity), or an
    all-gather along the sequence with `sequence_parallel`; an all-gather of the input
    gradient when `input_is_parallel=False`.

    The bias is replicated and added once, after the sum. `input_is_parallel=True` takes the
    input already split by columns, as a ColumnParallelLinear(gather_output=False) leaves it.
    """

    def __init__(self, in_features: int, out_features: int, mesh, *, bias: bool = True,
                 input_is_parallel: bool = False, skip_bias_add: bool = False, sequence_parallel: bool = False,
                 logger: CommsLogger | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, _full: nn.Module | None = None) -> None:
        super().__init__(mesh, sequence_parallel, logger)
        self.transposed = _full is not None and is_conv1d(_full)
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True (its input "
                             "comes split by columns from a ColumnParallelLinear)")
        try:
            self.spec = ShardSpec(0 if self.transposed else 1, in_features, self.tp_size)
        except ValueError as err:
            raise ValueError(f"RowParallelLinear(in_features={in_features}, out_features={out_features}): "
                             f"{err} (in_features is split over tp)") from None
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.skip_bias_add = input_is_parallel, skip_bias_add
        full = _full if _full is not None else nn.Linear(in_features, out_features, bias=bias, device=device,
                                                          dtype=dtype)
        self.weight = self._shard_param(full.weight, self.spec)
        self.bias = None
        if full.bias is not None:
            self.bias = nn.Parameter(full.bias.detach().clone(), requires_grad=full.bias.requires_grad)
            if sequence_parallel:
                mark_sequence_parallel(self.bias, mesh, logger)

    @classmethod
    def from_linear(cls, linear: nn.Module, mesh, **options) -> RowParallelLinear:
        """The row-parallel twin of `linear` (an nn.Linear or a transformers Conv1D), holding
        this rank's slice of its weight."""
        n_in, n_out = linear_features(linear)
        return cls(n_in, n_out, mesh, bias=linear.bias is not None, _full=linear, **options)

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = scatter_to_tp_region(x, self.tp_group, self.logger)
        y = _linear(x, self.weight.t() if self.transposed else self.weight, None, self.fp8)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group, self.logger, SEQUENCE_DIM)
        else:
            y = reduce_from_tp_region(y, self.tp_group, self.logger)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.spec.local_size} per rank, tp={self.tp_size}), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class ReplicatedHeadsLinear(_TPModule):
    """A key or value projection with fewer heads than tp ranks (grouped-query attention with
    tp > key/value heads), as Megatron handles it: every rank keeps the whole (small)
    projection, computes it, and keeps the one head its query heads share, head
    tp_rank // (tp / heads). Its gradient is summed over tp (each rank's holds its query heads'
    share), and the input gradient likewise (identity forward, all-reduce backward)."""

    def __init__(self, linear: nn.Module, mesh, head_dim: int, logger: CommsLogger | None = None) -> None:
        super().__init__(mesh, False, logger)
        n_in, n_out = linear_features(linear)
        heads = n_out // head_dim
        if n_out % head_dim or self.tp_size % heads:
            raise ValueError(f"ReplicatedHeadsLinear: {n_out} output features are not whole heads of {head_dim}, or "
                             f"their {heads} heads do not divide tp={self.tp_size}")
        self.in_features, self.out_features, self.head_dim = n_in, n_out, head_dim
        self.transposed = is_conv1d(linear)
        self.head = self.tp_rank // (self.tp_size // heads)
        self.weight = nn.Parameter(linear.weight.detach().clone(), requires_grad=linear.weight.requires_grad)
        self.bias = None
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
        for param in (self.weight, self.bias):
            if param is not None:
                mark_sequence_parallel(param, mesh, logger)  # replicated, each rank holding part of its gradient

    @classmethod
    def from_linear(cls, linear: nn.Module, mesh, head_dim: int, logger: CommsLogger | None = None):
        return cls(linear, mesh, head_dim, logger)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp_region(x, self.tp_group, self.logger)
        rows = slice(self.head * self.head_dim, (self.head + 1) * self.head_dim)
        weight = (self.weight.t() if self.transposed else self.weight)[rows]
        return F.linear(x, weight, self.bias[rows] if self.bias is not None else None)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (whole on every rank; head "
                f"{self.head} of {self.out_features // self.head_dim} used here, tp={self.tp_size})")


class VocabParallelEmbedding(_TPModule):
    """An embedding table split by vocabulary rows: rank i holds rows [i*V/tp, (i+1)*V/tp).

    Each rank looks up the ids it owns, writes zeros for the others, and the partial results
    are summed. Forward sends: an all-reduce of the [*, dim] output, or a reduce-scatter along
    the sequence with `sequence_parallel` (the output is then this rank's sequence shard).
    Backward sends: nothing (identity), or an all-gather along the sequence.

    The vocabulary is padded with zero rows to a multiple of tp (Megatron-LM's convention);
    pad rows are never looked up, and a tied output head excludes their logits from the loss.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, mesh, *, sequence_parallel: bool = False,
                 logger: CommsLogger | None = None, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None, _full: nn.Embedding | None = None) -> None:
        super().__init__(mesh, sequence_parallel, logger)
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.spec = ShardSpec(0, num_embeddings, self.tp_size, pad=True)
        full = _full if _full is not None else nn.Embedding(num_embeddings, embedding_dim, device=device,
                                                             dtype=dtype)
        self.weight = self._shard_param(full.weight, self.spec)
        self.vocab_start = self.tp_rank * self.spec.local_size
        self.vocab_end = self.vocab_start + self.spec.local_size

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, mesh, **options) -> VocabParallelEmbedding:
        """The vocabulary-parallel twin of `embedding`, holding this rank's rows."""
        unsupported = {k: getattr(embedding, k) for k in ("padding_idx", "max_norm")
                       if getattr(embedding, k) is not None}
        if unsupported or embedding.sparse or embedding.scale_grad_by_freq:
            raise ValueError(f"VocabParallelEmbedding.from_embedding: nn.Embedding options {unsupported or ''}"
                             f"{' sparse' if embedding.sparse else ''}"
                             f"{' scale_grad_by_freq' if embedding.scale_grad_by_freq else ''} are not "
                             f"supported under tensor parallelism; build the embedding without them")
        return cls(embedding.num_embeddings, embedding.embedding_dim, mesh, _full=embedding, **options)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(idx, self.weight)
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(partial, self.tp_group, self.logger, SEQUENCE_DIM)
        return reduce_from_tp_region(partial, self.tp_group, self.logger)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim} (rows [{self.vocab_start}, {self.vocab_end}) "
                f"of {self.spec.padded_size} padded, tp={self.tp_size}), sequence_parallel={self.sequence_parallel}")
