"""The planner's step time against trident's own steps on this machine (issue 23).

A session fixture calibrates this machine once on the same 2 gloo ranks (1 thread each) the
runs use, while both ranks load the cores as training does; every prediction then uses that
cluster file. Timing on a shared machine is noisy and the noise only adds time: calibration
keeps the fastest of several repeats (the hardware's rate), a run reports the median of its
timed steps after warm-up, and a layout outside the bound is measured once more before the
test fails (load from other processes comes in bursts). On a machine loaded by other work
the measured steps are slower than predicted and these tests fail: run them on a quiet one
(`pytest -m timing`; `-m "not timing"` leaves them out).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from trident.tools import planner_check as check
from trident.tools.calibrate import _timed
from trident.planner.cluster import Calibration, load_calibration, save_calibration
from trident.testing.distributed import run_on_ranks

pytestmark = pytest.mark.timing

GEMM_SHAPES = [(512, 768, 256), (768, 256, 512), (512, 1024, 256), (512, 256, 1024), (256, 1024, 512),
               (512, 384, 256), (384, 256, 512), (96, 384, 256), (200, 300, 700), (300, 1000, 100)]
"""The GEMMs of the reference runs' layers (forward and both backward products; tp=2's halves),
most of them off the calibration grid (interpolated, not looked up), and three odd shapes."""
STEP_BOUND, GEMM_BOUND = 0.20, 0.15


@pytest.fixture(scope="session")
def calibration(tmp_path_factory) -> Calibration:
    """This machine, measured once per session on 2 ranks, through a cluster file."""
    cal = Calibration.from_json(run_on_ranks(2, check.calibrate_on_rank, timeout=300)[0])
    path = save_calibration(cal, tmp_path_factory.mktemp("cluster") / "cluster.json")
    return load_calibration(path)


def _gemm_times(shapes) -> list[float]:
    torch.set_num_threads(1)
    out = []
    for m, n, k in shapes:
        a, b = torch.randn(m, k), torch.randn(k, n)
        dist.barrier()
        out.append(_timed(lambda: torch.mm(a, b), torch.device("cpu")))
    return out


def test_gemm_curve_within_15_percent_on_ten_shapes(calibration):
    def errors():
        measured = [min(t) for t in zip(*run_on_ranks(2, _gemm_times, GEMM_SHAPES))]
        return {s: calibration.gemm.seconds(*s) / t - 1 for s, t in zip(GEMM_SHAPES, measured)}

    err = errors()
    if max(abs(e) for e in err.values()) > GEMM_BOUND:
        retry = errors()  # a burst of load elsewhere: measure again, keep each shape's closer figure
        err = {s: min(err[s], retry[s], key=abs) for s in err}
    bad = {s: f"{100 * e:+.0f}%" for s, e in err.items() if abs(e) > GEMM_BOUND}
    assert not bad, f"predicted / measured GEMM time off by more than 15% for {bad} (all: " \
                    f"{ {s: round(100 * e) for s, e in err.items()} })"


@pytest.mark.parametrize("case", check.LAYOUTS, ids=[c.name for c in check.LAYOUTS])
def test_step_time_within_20_percent_of_measured(calibration, case):
    result = check.compare(case, calibration, run_on_ranks(2, check.measure_layout, case))
    if abs(result["time_ratio"] - 1) > STEP_BOUND:
        again = check.compare(case, calibration, run_on_ranks(2, check.measure_layout, case))
        result = min(result, again, key=lambda r: abs(r["time_ratio"] - 1))
    assert abs(result["time_ratio"] - 1) <= STEP_BOUND, (
        f"{case.name}: predicted {result['predicted_s']:.3f} s, measured median {result['measured_s']:.3f} s "
        f"(ratio {result['time_ratio']:.2f})")
    assert result["memory_ratio"] == pytest.approx(1.0, abs=0.05), result
