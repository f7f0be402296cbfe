"""Every tensor-parallel mapping and layer against its unsplit twin, on 2 and 4 gloo ranks.

Each rank builds the full layer from a seed, the split layer from the same full weights, and
runs both on the same input. Outputs, input gradients and weight gradients of the split layer
must equal the matching slices of the full layer's (fp32, relative error <= 1e-5). Workers
return the relative error per check; the test reports every check above the tolerance.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from trident.comm.logger import CommsLogger
from trident.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardSpec,
    VocabParallelEmbedding,
    copy_to_tp_region,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
    vocab_parallel_cross_entropy,
)
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.testing.parity import relative_error

WORLD_SIZES = [2, 4]
B, T, D_IN, D_OUT, VOCAB = 2, 8, 8, 12, 13  # VOCAB is padded at tp=2 (14) and tp=4 (16)


def leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone().requires_grad_(True)


def chunk(t: torch.Tensor, dim: int, n: int, i: int) -> torch.Tensor:
    return t.chunk(n, dim=dim)[i]


# -- worker functions -----------------------------------------------------------------------

def check_mappings() -> dict[str, float]:
    """Forward and backward of each mapping against its definition, rank-distinct data."""
    mesh = cached_mesh(tp=dist.get_world_size())
    g, n, r = mesh.tp_group, mesh.tp_size, mesh.tp_rank
    base = torch.randn(n, B, T, D_OUT * n, generator=torch.Generator().manual_seed(0))  # rank i's tensor: base[i]
    grads = torch.randn(n, B, T, D_OUT * n, generator=torch.Generator().manual_seed(1))
    errs = {}

    def run(name, fn, x_in, grad_out, want_out, want_grad):
        x = leaf(x_in)
        y = fn(x, g)
        y.backward(grad_out)
        errs[f"{name}/forward"] = relative_error(y, want_out)
        errs[f"{name}/backward"] = relative_error(x.grad, want_grad)

    go = grads[r]
    run("copy", copy_to_tp_region, base[0], go, base[0], grads.sum(0))
    run("reduce", reduce_from_tp_region, base[r], go, base.sum(0), go)
    run("scatter", scatter_to_tp_region, base[0], chunk(go, -1, n, r), chunk(base[0], -1, n, r),
        torch.cat([chunk(grads[i], -1, n, i) for i in range(n)], dim=-1))
    run("gather", gather_from_tp_region, chunk(base[r], -1, n, r), go,
        torch.cat([chunk(base[i], -1, n, i) for i in range(n)], dim=-1), chunk(go, -1, n, r))
    run("sp_gather", gather_from_sequence_parallel_region, chunk(base[r], 1, n, r), go,
        torch.cat([chunk(base[i], 1, n, i) for i in range(n)], dim=1), chunk(grads.sum(0), 1, n, r))
    run("sp_reduce_scatter", reduce_scatter_to_sequence_parallel_region, base[r], chunk(go, 1, n, r),
        chunk(base.sum(0), 1, n, r), torch.cat([chunk(grads[i], 1, n, i) for i in range(n)], dim=1))
    run("sp_scatter", scatter_to_sequence_parallel_region, base[0], chunk(go, 1, n, r), chunk(base[0], 1, n, r),
        torch.cat([chunk(grads[i], 1, n, i) for i in range(n)], dim=1))
    return errs


def _column_case(mesh, sp: bool, gather: bool, stride: int, out: int) -> dict[str, float]:
    n, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(10)
    full = nn.Linear(D_IN, out)
    layer = ColumnParallelLinear.from_linear(full, mesh, gather_output=gather, stride=stride,
                                             pad_vocab=gather and out % n != 0, sequence_parallel=sp)
    x = torch.randn(B, T, D_IN)
    w_out = torch.randn(B, T, out)
    xf, xl = leaf(x), leaf(chunk(x, 1, n, r) if sp else x)
    yf, yl = full(xf), layer(xl)
    (yf * w_out).sum().backward()
    out_spec = ShardSpec(2, out, n, stride=stride, pad=stride == 1)
    (yl * (w_out if gather else out_spec.shard(w_out, r))).sum().backward()
    spec = layer.weight.tp_spec
    return {"output": relative_error(yl, yf if gather else out_spec.shard(yf.detach(), r)),
            "input_grad": relative_error(xl.grad, chunk(xf.grad, 1, n, r) if sp else xf.grad),
            "weight_grad": relative_error(layer.weight.grad, spec.shard(full.weight.grad, r)),
            "bias_grad": relative_error(layer.bias.grad, spec.shard(full.bias.grad, r))}


def _row_case(mesh, sp: bool, input_is_parallel: bool) -> dict[str, float]:
    n, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(11)
    full = nn.Linear(D_OUT * 2, D_IN)
    layer = RowParallelLinear.from_linear(full, mesh, input_is_parallel=input_is_parallel, sequence_parallel=sp)
    x = torch.randn(B, T, D_OUT * 2)
    w_out = torch.randn(B, T, D_IN)
    xf, xl = leaf(x), leaf(chunk(x, -1, n, r) if input_is_parallel else x)
    yf, yl = full(xf), layer(xl)
    (yf * w_out).sum().backward()
    (yl * (chunk(w_out, 1, n, r) if sp else w_out)).sum().backward()
    return {"output": relative_error(yl, chunk(yf, 1, n, r) if sp else yf),
            "input_grad": relative_error(xl.grad, chunk(xf.grad, -1, n, r) if input_is_parallel else xf.grad),
            "weight_grad": relative_error(layer.weight.grad, layer.weight.tp_spec.shard(full.weight.grad, r)),
            "bias_grad": relative_error(layer.bias.grad, full.bias.grad)}


def _embedding_case(mesh, sp: bool) -> dict[str, float]:
    n, r = mesh.tp_size, mesh.tp_rank
    torch.manual_seed(12)
    full = nn.Embedding(VOCAB, D_IN)
    layer = VocabParallelEmbedding.from_embedding(full, mesh, sequence_parallel=sp)
    idx = torch.randint(0, VOCAB, (B, T))
    w_out = torch.randn(B, T, D_IN)
    yf, yl = full(idx), layer(idx)
    (yf * w_out).sum().backward()
    (yl * (chunk(w_out, 1, n, r) if sp else w_out)).sum().backward()
    return {"output": relative_error(yl, chunk(yf, 1, n, r) if sp else yf),
            "weight_grad": relative_error(layer.weight.grad, layer.weight.tp_spec.shard(full.weight.grad, r))}


def _cross_entropy_case(mesh, smoothing: float, reduction: str) -> dict[str, float]:
    n, r = mesh.tp_size, mesh.tp_rank
    spec = ShardSpec(1, VOCAB, n, pad=True)
    torch.manual_seed(13)
    logits = torch.randn(B * T, VOCAB) * 3
    targets = torch.randint(0, VOCAB, (B * T,))
    targets[::5] = -100
    local = spec.shard(logits, r)
    if spec.padded_size > VOCAB and r == n - 1:
        local[:, -(spec.padded_size - VOCAB):] = 50.0  # pad logits would dominate if they were not excluded
    lf, ll = leaf(logits), leaf(local)
    want = F.cross_entropy(lf, targets, label_smoothing=smoothing, reduction=reduction)
    got = vocab_parallel_cross_entropy(ll, targets, mesh.tp_group, vocab_size=VOCAB, label_smoothing=smoothing,
                                       reduction=reduction)
    w = torch.randn(want.shape) if reduction == "none" else torch.tensor(1.7)
    (want * w).sum().backward()
    (got * w).sum().backward()
    return {"output": relative_error(got, want), "logits_grad": relative_error(ll.grad, spec.shard(lf.grad, r))}


def check_layers() -> dict[str, float]:
    mesh = cached_mesh(tp=dist.get_world_size())
    cases = {}
    for sp in (False, True):
        cases |= {f"column/sp={sp}/{k}": v for k, v in _column_case(mesh, sp, False, 1, D_OUT * 2).items()}
        cases |= {f"row/sp={sp}/{k}": v for k, v in _row_case(mesh, sp, True).items()}
        cases |= {f"embedding/sp={sp}/{k}": v for k, v in _embedding_case(mesh, sp).items()}
    cases |= {f"column/gather_padded/{k}": v for k, v in _column_case(mesh, False, True, 1, VOCAB).items()}
    cases |= {f"column/stride3/{k}": v for k, v in _column_case(mesh, False, False, 3, 3 * 4 * mesh.tp_size).items()}
    cases |= {f"row/split_input/{k}": v for k, v in _row_case(mesh, False, False).items()}
    for smoothing in (0.0, 0.1):
        for reduction in ("mean", "sum", "none"):
            cases |= {f"cross_entropy/eps={smoothing}/{reduction}/{k}": v
                      for k, v in _cross_entropy_case(mesh, smoothing, reduction).items()}
    return cases


def check_init_matches_torch() -> dict[str, bool]:
    """Constructors draw the full weight as torch would from the same seed, then slice it."""
    mesh = cached_mesh(tp=dist.get_world_size())
    r = mesh.tp_rank
    out = {}
    torch.manual_seed(5)
    ref_col, ref_row, ref_emb = nn.Linear(D_IN, D_OUT * 4), nn.Linear(D_OUT * 4, D_IN), nn.Embedding(VOCAB, D_IN)
    torch.manual_seed(5)
    col = ColumnParallelLinear(D_IN, D_OUT * 4, mesh)
    row = RowParallelLinear(D_OUT * 4, D_IN, mesh, input_is_parallel=True)
    emb = VocabParallelEmbedding(VOCAB, D_IN, mesh)
    out["column"] = torch.equal(col.weight, col.weight.tp_spec.shard(ref_col.weight, r)) and \
        torch.equal(col.bias, col.bias.tp_spec.shard(ref_col.bias, r))
    out["row"] = torch.equal(row.weight, row.weight.tp_spec.shard(ref_row.weight, r)) and \
        torch.equal(row.bias, ref_row.bias)
    out["embedding"] = torch.equal(emb.weight, emb.weight.tp_spec.shard(ref_emb.weight, r))
    out["attributes"] = (col.weight.tensor_model_parallel and col.weight.partition_dim == 0
                         and row.weight.partition_dim == 1 and not hasattr(row.bias, "tensor_model_parallel")
                         and emb.weight.partition_dim == 0)
    return out


def count_mlp_comms(sp: bool) -> dict[str, tuple[int, int]]:
    """One forward + backward of a column -> row pair: (calls, bytes) per op."""
    mesh = cached_mesh(tp=dist.get_world_size())
    n, r = mesh.tp_size, mesh.tp_rank
    logger = CommsLogger(enabled=True)
    torch.manual_seed(0)
    fc = ColumnParallelLinear(D_IN, 4 * D_IN, mesh, sequence_parallel=sp, logger=logger)
    proj = RowParallelLinear(4 * D_IN, D_IN, mesh, input_is_parallel=True, sequence_parallel=sp, logger=logger)
    x = torch.randn(B, T, D_IN)
    x = leaf(chunk(x, 1, n, r) if sp else x)
    proj(F.gelu(fc(x))).sum().backward()
    return {op: (s.calls, s.bytes) for op, s in logger.totals().items()}


# -- tests ----------------------------------------------------------------------------------

def assert_small(results: list[dict[str, float]], rtol: float = 1e-5) -> None:
    bad = sorted({(name, err) for res in results for name, err in res.items() if err > rtol}, key=lambda x: -x[1])
    assert not bad, "relative errors above {}:\n".format(rtol) + "\n".join(f"  {n}: {e:.2e}" for n, e in bad)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_mappings_match_their_definitions(world):
    assert_small(run_on_ranks(world, check_mappings))


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_layers_and_loss_match_unsplit_twins(world):
    results = run_on_ranks(world, check_layers)
    assert len(results[0]) == 44  # every case ran
    assert_small(results)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_constructors_slice_the_weights_torch_would_draw(world):
    for rank, checks in enumerate(run_on_ranks(world, check_init_matches_torch)):
        assert all(checks.values()), (rank, checks)


@pytest.mark.parametrize("world", WORLD_SIZES)
def test_column_row_pair_communication(world):
    act = B * T * D_IN * 4  # bytes of one full activation [B, T, D_IN] in fp32
    plain = run_on_ranks(world, count_mlp_comms, False)
    for counts in plain:  # one all-reduce forward (row output), one backward (column input grad)
        assert counts == {"all_reduce": (2, 2 * act)}
    sp = run_on_ranks(world, count_mlp_comms, True)
    for counts in sp:  # all-gather the input forward + its reduce-scatter backward, and the converse;
        # the row layer's bias sees only this rank's sequence shard: its gradient is summed over tp
        assert counts == {"all_gather": (2, 2 * act), "reduce_scatter": (2, 2 * act), "all_reduce": (1, D_IN * 4)}
