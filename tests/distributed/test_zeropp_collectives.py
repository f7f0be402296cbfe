"""qgZ's two-hop int4 reduce-scatter against the exact sum, on 4 gloo ranks as 2 nodes of 2
(and as 1 node of 4, and 4 nodes of 1), with its error bound derived from the inputs.

Rank r must receive sum_i x_i[r]. Hop 1 quantizes every x_i[r]: elementwise error at most
e1_i = absmax(block of x_i[r]) / 14 (int4: qmax 7, half a step). Node m adds its ranks' rows:
P_m = sum_{i in m} x_i[r] + d_m with |d_m| <= sum_{i in m} e1_i. Hop 2 quantizes P_m: error at
most absmax(block of P_m) / 14 <= absmax(block of |sum_{i in m} x_i[r]| + sum e1_i) / 14 = e2_m.
So |result - exact| <= sum_m (sum_{i in m} e1_i + e2_m), elementwise. With one rank per node
hop 1 is skipped (no e1); with one node hop 2 is skipped (no e2).

int4 is coarse: on Gaussian rows the 2 x 2 result is off by about 19% of the exact sum's norm
(each hop's half step is absmax / 14, about 0.24 sigma), which is why qgZ's training test
allows 1% on the loss rather than the 1e-5 of exact layouts.
"""

from __future__ import annotations

import pytest
import torch

from trident.compression.quantize import GRADIENTS
from trident.testing.distributed import cached_mesh, run_on_ranks
from trident.zero.zeropp import _node_groups
from trident.compression.hierarchical import HierarchicalReduceScatter

WORLD, WIDTH = 4, 1300


def inputs(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + rank)
    scale = torch.logspace(-3, 1, WORLD).view(WORLD, 1)  # each destination's rows at its own magnitude
    return torch.randn(WORLD, WIDTH, generator=g) * scale


def reduce_on_rank(local: int):
    mesh = cached_mesh()
    intra, inter = _node_groups(mesh, WORLD, local)
    qgz = HierarchicalReduceScatter(intra, inter, local, WORLD // local)
    out = torch.empty(WIDTH)
    qgz.launch(out, inputs(mesh.dp_rank)).wait()
    return out


def bound(rank: int, local: int) -> torch.Tensor:
    nodes = WORLD // local
    total = torch.zeros(WIDTH)
    for m in range(nodes):
        rows = [inputs(i)[rank].view(1, -1) for i in range(m * local, (m + 1) * local)]
        e1 = sum(GRADIENTS.error_bound(x) for x in rows) if local > 1 else torch.zeros(1, WIDTH)
        exact = sum(rows)
        e2 = GRADIENTS.error_bound(exact.abs() + e1) if nodes > 1 else torch.zeros(1, WIDTH)
        total += (e1 + e2).view(-1)
    return total


@pytest.mark.parametrize("local", [2, 4, 1])
def test_two_hop_int4_reduce_scatter_is_within_its_bound(local):
    results = run_on_ranks(WORLD, reduce_on_rank, local)
    for rank, out in enumerate(results):
        exact = sum(inputs(i)[rank] for i in range(WORLD))
        err = (out - exact).abs()
        b = bound(rank, local)
        assert (err <= b).all(), f"rank {rank}: worst excess {(err - b).max():.3e}"
        assert err.max() > 0  # it did quantize
        assert b.norm() < exact.norm()  # the bound says something (0.79 of it for 2 x 2)
