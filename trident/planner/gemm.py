"""Matrix-multiply time by shape: a measured table (calibrated here) or a GPU's published curve.

One sustained-GEMM constant for every shape makes small models look fast: a 2-4k wide GEMM
runs well below the rate of a 12k wide one, and a tiny one is all launch overhead. Two shapes
of the same curve answer `seconds(m, n, k)` for C[m, n] = A[m, k] B[k, n]:

- `GemmTable`: rates measured on a grid of (m, n, k) by `trident plan --calibrate`;
  a shape between grid points gets the rate interpolated linearly in log(rate) over log(m),
  log(n), log(k) (trilinear), clamped at the grid's edges. What CPUs and small GPUs need: their
  rate depends on cache blocking the planner cannot model from a data sheet.
- `GemmCurve`: a GPU's rate from its published figures: the sustained rate of large GEMMs
  (`GPUSpec.gemm_efficiency` of peak) scaled by cuBLAS's tile and wave quantization (NVIDIA,
  "Matrix Multiplication Background User's Guide", DU-09799-001, sections 2.3 and 3: output
  tiles of 256 x 128 or 128 x 128 are spread over the SMs in waves; a last partial wave or a
  partly filled tile idles the rest), by the reduction depth (`GPUSpec.gemm_depth`: each
  output tile loads its pipeline and writes its result once whatever k is, so a short k loop
  runs below the rate of a long one; a table of measured rates by k, relative to k = 4096,
  interpolated in log k), the memory roofline (bytes of A, B and C at HBM bandwidth) and a
  fixed launch cost per kernel. The depth factor leaves fused kernels (flash attention, whose
  loop runs over the sequence) alone.
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass

TILES = ((256, 128), (128, 256), (128, 128), (128, 64), (64, 64))
"""cuBLAS's usual output tiles, largest (most efficient) first (the guide's section 2.3)."""
TILE_EFFICIENCY = {(256, 128): 1.0, (128, 256): 1.0, (128, 128): 0.93, (128, 64): 0.82, (64, 64): 0.68}
"""Relative per-tile throughput: smaller tiles re-read A and B more often (the guide, figure 5)."""


@dataclass(frozen=True)
class GemmCurve:
    """A GPU's GEMM rate by shape, from its data sheet and the published sustained share."""

    peak_flops: float
    efficiency: float          # share of peak large GEMMs sustain
    sms: int                   # streaming multiprocessors: tiles run in waves of this many
    memory_bandwidth: float    # bytes/s
    launch_seconds: float = 4e-6
    depth: tuple[tuple[int, float], ...] = ()  # (k, rate relative to the deepest k): measured; () = 1

    def quantization(self, m: int, n: int, batch: int = 1) -> float:
        """Useful share of the tile-and-wave grid for `batch` m x n outputs (1.0 when they fill it;
        a batched GEMM spreads all its tiles over the SMs at once)."""
        best = 0.0
        for tm, tn in TILES:
            tiles = math.ceil(m / tm) * math.ceil(n / tn) * batch
            waves = math.ceil(tiles / self.sms)
            filled = (m * n * batch) / (tiles * tm * tn) * tiles / (waves * self.sms)
            best = max(best, filled * TILE_EFFICIENCY[(tm, tn)])
        return best

    def seconds(self, m: int, n: int, k: int, dtype_bytes: int = 2, batch: int = 1) -> float:
        """`batch` GEMMs of (m, n, k) run as one batched kernel; dtype_bytes 0 leaves out the
        memory roofline (a fused kernel that keeps its output on chip, as flash attention)."""
        flops = 2.0 * m * n * k * batch
        depth = depth_factor(self.depth, k) if dtype_bytes else 1.0
        compute = flops / (self.peak_flops * self.efficiency * self.quantization(m, n, batch) * depth)
        memory = batch * dtype_bytes * (m * k + k * n + m * n) / self.memory_bandwidth
        return max(compute, memory) + self.launch_seconds


@dataclass(frozen=True)
class GemmTable:
    """Measured GEMM times on a full grid: `points` holds (m, n, k, seconds) for every
    combination of `ms`, `ns`, `ks`."""

    ms: tuple[int, ...]
    ns: tuple[int, ...]
    ks: tuple[int, ...]
    points: tuple[tuple[int, int, int, float], ...]

    def __post_init__(self) -> None:
        have = {(m, n, k) for m, n, k, _ in self.points}
        missing = [(m, n, k) for m in self.ms for n in self.ns for k in self.ks if (m, n, k) not in have]
        if missing:
            raise ValueError(f"GEMM table: the grid point(s) {missing[:3]} have no measurement; calibrate again")

    @property
    def peak(self) -> float:
        """The best rate measured (FLOP/s)."""
        return max(2.0 * m * n * k / s for m, n, k, s in self.points)

    @functools.cached_property
    def _log_rate(self) -> dict[tuple[int, int, int], float]:
        return {(m, n, k): math.log(2.0 * m * n * k / s) for m, n, k, s in self.points}

    def rate(self, m: float, n: float, k: float) -> float:
        """FLOP/s at (m, n, k): trilinear in log space between grid points, clamped at the edges."""
        table = self._log_rate
        axes = [_bracket(self.ms, m), _bracket(self.ns, n), _bracket(self.ks, k)]
        total = 0.0
        for mi, wm in axes[0]:
            for nj, wn in axes[1]:
                for kl, wk in axes[2]:
                    total += wm * wn * wk * table[(mi, nj, kl)]
        return math.exp(total)

    def seconds(self, m: int, n: int, k: int, dtype_bytes: int = 4, batch: int = 1) -> float:
        del dtype_bytes  # measured in the dtype of the run it was calibrated for
        return batch * 2.0 * m * n * k / self.rate(m, n, k)

    def to_json(self) -> dict:
        return {"ms": list(self.ms), "ns": list(self.ns), "ks": list(self.ks),
                "points": [list(p) for p in self.points]}

    @classmethod
    def from_json(cls, data: dict) -> GemmTable:
        return cls(tuple(data["ms"]), tuple(data["ns"]), tuple(data["ks"]),
                   tuple((int(m), int(n), int(k), float(s)) for m, n, k, s in data["points"]))


def _bracket(grid: tuple[int, ...], x: float) -> list[tuple[int, float]]:
    """The grid points around x with their weights, linear in log(x); one point at the edges."""
    if x <= grid[0]:
        return [(grid[0], 1.0)]
    if x >= grid[-1]:
        return [(grid[-1], 1.0)]
    hi = bisect.bisect_left(grid, x)
    lo_v, hi_v = grid[hi - 1], grid[hi]
    w = (math.log(x) - math.log(lo_v)) / (math.log(hi_v) - math.log(lo_v))
    return [(lo_v, 1.0 - w), (hi_v, w)]


def gemm_seconds(curve, m: float, n: float, k: float, dtype_bytes: int = 2, count: float = 1.0) -> float:
    """`count` GEMMs of shape (m, n, k) on `curve` (a GemmTable or GemmCurve); 0 for empty ones."""
    if m < 1 or n < 1 or k < 1 or count <= 0:
        return 0.0
    whole = max(1, int(count))
    return count / whole * curve.seconds(max(1, round(m)), max(1, round(n)), max(1, round(k)), dtype_bytes, whole)


def depth_factor(table: tuple[tuple[int, float], ...], k: float) -> float:
    """A GEMM's rate at reduction depth `k` relative to deep ones: linear in log(rate) over log(k)
    between the table's points, clamped at its ends; 1 without a table."""
    return attention_rate(table, k) if table else 1.0


def attention_rate(rates: tuple[tuple[int, float], ...], head_dim: float) -> float:
    """FLOP/s of a fused attention kernel at `head_dim`, from measured (head width, FLOP/s)
    pairs: linear in log(rate) over log(head width) between them, clamped at the ends."""
    widths = tuple(d for d, _ in rates)
    log_rate = dict((d, math.log(r)) for d, r in rates)
    return math.exp(sum(w * log_rate[d] for d, w in _bracket(widths, head_dim)))
