"""The GPU check's bodies on real CPU ranks over gloo (device "cpu"): the same code a GPU runs,
against one process; the CUDA-only measurements skip themselves. Some go through the check's own
launcher (fresh processes, as `trident doctor --gpu` runs them), the rest through the test pool."""

from __future__ import annotations

import io
import time

import pytest
import torch
import torch.distributed as dist

from trident.cli.main import main
from trident.tools import gpu_equivalence
from trident.tools.gpu_check import run_checks
from trident.tools.gpu_common import PASS, SKIP
from trident.tools.rank_launch import RankError, run_ranks
from trident.testing.distributed import run_on_ranks

CPU = torch.device("cpu")


def test_doctor_without_gpu_runs_gloo_and_data_parallelism_on_two_ranks(capsys):
    assert main(["doctor"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("PASS process group: gloo on 2 rank(s): all_reduce/all_gather/broadcast correct")
               for line in lines), lines
    assert any(line.startswith("PASS dp equivalence: dp=2: weights rel err") for line in lines), lines
    assert lines[-1] == "2 passed, 0 failed, 0 skipped"


def test_a_cuda_only_check_on_cpu_ranks_skips_itself():
    out = io.StringIO()
    (result,) = run_checks(2, device_type="cpu", only=["pinned offload"], out=out)
    assert out.getvalue() == "SKIP pinned offload: pinned host memory needs a CUDA device, this rank has cpu\n"
    assert result.status == SKIP


@pytest.mark.parametrize("body,world,layout", [
    (gpu_equivalence.equivalence, 1, "dp=1:"),
    (gpu_equivalence.equivalence, 2, "dp=2:"),
    (gpu_equivalence.pipeline_equivalence, 2, "pp=2 dp=1 stage"),
    (gpu_equivalence.bf16_training, 2, "dp=2: parameters ['torch.bfloat16']"),
])
def test_bodies_pass_on_gloo_ranks(body, world, layout):
    for outcome in run_on_ranks(world, body, CPU):
        assert outcome.status == PASS and outcome.detail.startswith(layout), outcome


def zero3(device):
    return gpu_equivalence.equivalence(device, stage=3)


def tp2(device):
    return gpu_equivalence.equivalence(device, tp=2)


@pytest.mark.parametrize("body,world,layout", [
    (zero3, 2, "dp=2 zero=3:"),
    (tp2, 4, "dp=2 tp=2:"),  # four GPUs: tp=2 with dp over the other factor
    (gpu_equivalence.pipeline_equivalence, 4, "pp=2 dp=2 stage"),
])
def test_layouts_with_data_parallel_replicas_pass_on_gloo_ranks(body, world, layout):
    for outcome in run_on_ranks(world, body, CPU):
        assert outcome.status == PASS and outcome.detail.startswith(layout), outcome


def one_rank_raises(device):
    """Rank 1 raises while rank 0 waits for it in an all-reduce."""
    if dist.get_rank() == 1:
        raise ValueError("broken on purpose")
    dist.all_reduce(torch.ones(1, device=device))
    return "unreachable"


def test_launcher_reports_the_failing_rank_and_does_not_hang():
    start = time.monotonic()
    with pytest.raises(RankError, match="(?s)rank 1 raised:.*ValueError: broken on purpose"):
        run_ranks(one_rank_raises, 2, "cpu", timeout_s=300)
    assert time.monotonic() - start < 200  # the waiting rank was killed after the grace period
