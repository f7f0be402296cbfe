"""Muon's step on the planner's clock: which matrices it orthogonalizes whole, how long their
Newton-Schulz iterations take on one rank, and how many units ZeRO gathers to owners.

Newton-Schulz on a matrix X of n x m (n <= m; trident.optim.muon transposes a tall one) runs
`NS_STEPS` iterations of three GEMMs: A = X X^T (n x n, depth m), A A (n x n, depth n) and
(b A + c A A) X (n x m, depth n): 4 n^2 m + 2 n^3 FLOPs each. Every rank that orthogonalizes a
tensor-parallel slice's matrix does it for the whole matrix (the slices are gathered first), so
tp does not share this work; ZeRO 1-3 deal the matrices to owner ranks of the dp group by
this cost, and the owners run side by side (trident.zero.muon), so each does about a dp-th.
"""

from __future__ import annotations

from trident.planner.gemm import gemm_seconds
from trident.planner.layout import Layout, Workload, stage_layers
from trident.planner.presets import Cluster, ModelSpec

NS_STEPS = 5
"""Muon's default `ns_steps` (Moonlight's and DeepSpeed's)."""


def layer_matrices(model: ModelSpec, ep: int = 1) -> list[tuple[int, int, float]]:
    """One block's matrices as (rows, columns, count), whole (before tp splits them): qkv,
    the attention output, the MLP's (a gated MLP's gate and up apart, as Llama's modules hold
    them); an MoE block counts its experts on this ep rank (averaged over the blocks)."""
    h, ff = model.d_model, model.ff_dim
    experts = 1.0
    if model.num_experts:
        experts += model.moe_layers * (model.num_experts / ep - 1) / model.n_layer
    mlp = [(ff, h, (2.0 if model.gated_mlp else 1.0) * experts), (h, ff, experts)]
    return [(h + 2 * model.kv_dim, h, 1.0), (h, h, 1.0)] + mlp


def stage_matrices(model: ModelSpec, layout: Layout) -> list[tuple[int, int, float]]:
    """The busiest pipeline stage's matrices (count over its layers)."""
    layers = stage_layers(model, layout.pp)
    return [(n, m, count * layers) for n, m, count in layer_matrices(model, layout.ep)]


def newton_schulz_seconds(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> float:
    """Seconds one rank spends in Newton-Schulz per optimizer step: its stage's matrices whole,
    under ZeRO the busiest owner's share (the matrices dealt largest first to the least loaded
    dp rank, as trident.zero.muon deals them), in bf16 on a GPU and fp32 on a calibrated CPU
    (what trident.optim.muon.newton_schulz_dtype picks)."""
    if workload.optimizer.lower() != "muon":
        return 0.0
    cal = cluster.calibration
    dtype_bytes = 4 if cal is not None and cal.device == "cpu" else 2
    curve = cluster.gpu.gemm_curve()
    costs = []
    for rows, cols, count in stage_matrices(model, layout):
        n, m = min(rows, cols), max(rows, cols)
        one = NS_STEPS * (gemm_seconds(curve, n, n, m, dtype_bytes) + gemm_seconds(curve, n, n, n, dtype_bytes)
                          + gemm_seconds(curve, n, m, n, dtype_bytes))
        whole, part = divmod(count, 1.0)
        costs += [one] * int(whole) + ([one * part] if part else [])
    owners = layout.dp * layout.cp if layout.zero_stage else 1
    loads = [0.0] * owners
    for cost in sorted(costs, reverse=True):
        loads[loads.index(min(loads))] += cost
    return max(loads)


def gather_units(model: ModelSpec, layout: Layout) -> int:
    """Units ZeRO gathers to their owners per step, one gather and one scatter each: a unit per
    matrix (stage 3: the matrix's module; stages 1-2 make Muon's matrices a unit each)."""
    return matrices_per_stage(model, layout)


def matrices_per_stage(model: ModelSpec, layout: Layout) -> int:
    """Matrices Muon steps on the busiest stage (each tp slice counts as its matrix)."""
    return max(1, round(sum(count for _, _, count in stage_matrices(model, layout))))


__all__ = ["NS_STEPS", "gather_units", "layer_matrices", "matrices_per_stage", "newton_schulz_seconds",
           "stage_matrices"]
