"""The GPU check's own logic, without processes: which checks run for how many GPUs, how the
per-rank outcomes become one line, exit codes, the CLI's output without CUDA, and the CUDA-only
bodies skipping themselves on a CPU device. The GPU count is passed into the planner (not
simulated by patching torch.cuda); the bodies running on real gloo ranks are in
tests/distributed/test_gpu_check_cpu.py."""

from __future__ import annotations

import io
import pickle

import pytest
import torch

from trident.cli.main import main
from trident.tools import gpu_check, gpu_device
from trident.tools.gpu_check import CHECKS, Check, Planned, Result, combine, plan_checks, run_checks
from trident.tools.gpu_common import FAIL, PASS, SKIP, Outcome, compare
from trident.tools.rank_launch import RankError

SINGLE_GPU = {"process group", "dp equivalence", "zero-3 equivalence", "bf16 training", "pinned offload",
              "memory_breakdown vs allocator", "planner step time", "deepspeed accelerator"}
MULTI_GPU = {"tp=2 equivalence", "pp=2 equivalence", "comm overlaps backward"}


def ranks_by_name(gpus: int) -> dict[str, int]:
    return {p.check.name: p.ranks for p in plan_checks(gpus)}


def test_the_issue_s_checks_are_all_there():
    assert {c.name for c in CHECKS} == SINGLE_GPU | MULTI_GPU
    assert {c.name for c in CHECKS if c.gpus == 2} == MULTI_GPU


def test_no_gpu_skips_every_check_with_one_line_each():
    planned = plan_checks(0)
    assert all(p.ranks == 0 for p in planned)
    reasons = {p.check.name: p.skip for p in planned}
    assert reasons["dp equivalence"] == "needs 1 GPU, 0 visible"
    assert reasons["tp=2 equivalence"] == "needs 2 GPUs, 0 visible"


def test_one_gpu_runs_the_single_rank_paths_and_skips_the_rest():
    planned = {p.check.name: p for p in plan_checks(1)}
    assert {n for n, p in planned.items() if p.skip is None} == SINGLE_GPU
    assert all(planned[n].ranks == 1 for n in SINGLE_GPU)
    line = gpu_check.run_one(planned["tp=2 equivalence"], "cuda", launch=None).line()
    assert line == "SKIP tp=2 equivalence: needs 2 GPUs, 1 visible"


@pytest.mark.parametrize("gpus", [2, 4, 8])
def test_every_check_runs_on_every_gpu_from_two_up(gpus):
    assert ranks_by_name(gpus) == {name: gpus for name in SINGLE_GPU | MULTI_GPU}


def test_an_odd_gpu_is_left_out_only_by_layouts_that_split_in_two():
    ranks = ranks_by_name(3)
    assert ranks["tp=2 equivalence"] == ranks["pp=2 equivalence"] == 2
    assert ranks["dp equivalence"] == ranks["comm overlaps backward"] == 3


def test_bodies_are_picklable_for_spawned_ranks():
    for check in CHECKS:
        assert pickle.loads(pickle.dumps(check.body)) is not None


# -- reporting ---------------------------------------------------------------------------------

def test_one_failing_rank_fails_the_check_and_is_named():
    outcomes = [Outcome(PASS, "fine"), Outcome(FAIL, "weights rel err 3e-02")]
    assert combine("dp equivalence", outcomes).line() == "FAIL dp equivalence: rank 1: weights rel err 3e-02"


def test_skip_only_when_every_rank_skipped():
    assert combine("x", [Outcome(SKIP, "no CUDA"), Outcome(SKIP, "no CUDA")]).status == SKIP
    mixed = [Outcome(PASS, "rank 0 figure"), Outcome(SKIP, "no CUDA")]
    assert combine("x", mixed) == Result("x", PASS, "rank 0 figure")


def fake_launch(outcomes_by_name: dict, calls: list):
    """A launcher that records (check, ranks, device type) and returns canned per-rank outcomes."""
    def launch(body, ranks, device_type):
        name = next(c.name for c in CHECKS if c.body is body)
        calls.append((name, ranks, device_type))
        outcome = outcomes_by_name[name]
        if isinstance(outcome, Exception):
            raise outcome
        return [outcome] * ranks
    return launch


def test_runner_prints_a_line_per_check_and_fails_on_any_failure():
    outcomes = {name: Outcome(PASS, "ok") for name in SINGLE_GPU | MULTI_GPU}
    outcomes["zero-3 equivalence"] = Outcome(FAIL, "grad norms rel err 1.0e-01")
    outcomes["pinned offload"] = RankError("rank 0 raised:\nTraceback ...\nRuntimeError: CUDA out of memory")
    calls, out, err = [], io.StringIO(), io.StringIO()
    results = run_checks(1, launch=fake_launch(outcomes, calls), out=out, err=err)
    lines = out.getvalue().splitlines()
    assert len(lines) == len(CHECKS)
    assert "FAIL zero-3 equivalence: rank 0: grad norms rel err 1.0e-01" in lines
    assert "FAIL pinned offload: 1 rank(s): RuntimeError: CUDA out of memory" in lines
    assert "SKIP comm overlaps backward: needs 2 GPUs, 1 visible" in lines
    assert "Traceback" in err.getvalue()  # the whole story goes to stderr
    assert {name for name, _, _ in calls} == SINGLE_GPU and all(r == 1 and d == "cuda" for _, r, d in calls)
    assert gpu_check.exit_code(results) == 1
    assert gpu_check.summary(results) == f"{len(SINGLE_GPU) - 2} passed, 2 failed, 3 skipped"


def test_skips_and_passes_exit_zero():
    assert gpu_check.exit_code([Result("a", PASS, ""), Result("b", SKIP, "")]) == 0
    assert gpu_check.exit_code([Result("a", PASS, ""), Result("b", FAIL, "")]) == 1


def test_only_selects_by_name_and_rejects_unknown_names():
    calls = []
    outcomes = {name: Outcome(PASS, "ok") for name in SINGLE_GPU | MULTI_GPU}
    run_checks(2, only=["equivalence"], launch=fake_launch(outcomes, calls), out=io.StringIO())
    assert {c[0] for c in calls} == {"dp equivalence", "zero-3 equivalence", "tp=2 equivalence", "pp=2 equivalence"}
    with pytest.raises(ValueError, match="no check matches \\['nope'\\]; checks: process group, dp equivalence"):
        run_checks(2, only=["nope"], launch=fake_launch(outcomes, []), out=io.StringIO())


def test_compare_fails_a_wrong_update_and_passes_an_exact_one():
    cpu = torch.device("cpu")
    ref = {"w": torch.ones(10)}
    assert compare(cpu, {"w": torch.ones(10)}, ref, [1.0, 2.0], [1.0, 2.0], "dp=2").status == PASS
    off = compare(cpu, {"w": torch.ones(10) * 1.001}, ref, [1.0, 2.0], [1.0, 2.0], "dp=2")
    assert off.status == FAIL and "weights rel err 1.0e-03" in off.detail
    assert compare(cpu, {"w": torch.ones(10)}, ref, [1.0, None], [1.0, 2.0], "dp=2").status == FAIL


# -- CUDA-only bodies skip themselves on CPU ----------------------------------------------------

@pytest.mark.parametrize("body", [gpu_device.offload, gpu_device.overlap, gpu_device.memory,
                                  gpu_device.planner_step_time])
def test_cuda_only_bodies_skip_themselves_on_a_cpu_device(body):
    outcome = body(torch.device("cpu"))
    assert outcome.status == SKIP and "needs a CUDA device, this rank has cpu" in outcome.detail


def test_planner_presets_by_device_name():
    assert gpu_device.gpu_preset_name("NVIDIA A100-SXM4-80GB", 80 * 2**30) == "a100-80gb"
    assert gpu_device.gpu_preset_name("NVIDIA A100-PCIE-40GB", 40 * 2**30) == "a100-40gb"
    assert gpu_device.gpu_preset_name("NVIDIA H100 80GB HBM3", 80 * 2**30) == "h100-80gb"
    assert gpu_device.gpu_preset_name("NVIDIA GeForce RTX 4090", 24 * 2**30) is None


def test_planner_prediction_is_a_step_time_that_scales_with_the_batch():
    one = gpu_device.predicted_step_seconds(gpu_device.PLANNER_SHAPE, 1, 4, "a100-80gb")
    two = gpu_device.predicted_step_seconds(gpu_device.PLANNER_SHAPE, 1, 8, "a100-80gb")
    assert 0 < one < two < 3 * one


# -- the CLI ---------------------------------------------------------------------------------------

def test_doctor_gpu_without_gpus_prints_one_skip_per_check_and_exits_zero(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "visible_gpus", lambda: 0)
    assert main(["doctor", "--gpu"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("python   ") and any(line.startswith("torch    ") for line in lines)
    skips = [line for line in lines if line.startswith("SKIP ")]
    assert len(skips) == len(CHECKS) and "SKIP pp=2 equivalence: needs 2 GPUs, 0 visible" in skips
    assert lines[-1] == f"0 passed, 0 failed, {len(CHECKS)} skipped"


def test_doctor_rejects_an_unknown_check_name(capsys):
    assert main(["doctor", "--gpu", "--only", "nope"]) == 2
    assert "trident doctor: no check matches ['nope']" in capsys.readouterr().err


def test_doctor_exit_code_follows_the_results(capsys, monkeypatch):
    monkeypatch.setattr(gpu_check, "run_checks", lambda *a, **k: [Result("dp equivalence", FAIL, "x")])
    assert main(["doctor", "--gpu"]) == 1
    assert capsys.readouterr().out.splitlines()[-1] == "0 passed, 1 failed, 0 skipped"


def test_planned_skip_never_launches():
    check = Check("needs four", 4, gpu_device.memory)
    assert gpu_check.run_one(Planned(check, 0, "needs 4 GPUs, 2 visible"), "cuda", launch=None).status == SKIP
