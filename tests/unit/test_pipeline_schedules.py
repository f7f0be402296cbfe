"""Pipeline schedules as data: well-formed for every size, bubbles and memory as the papers say.

Everything here is pure: schedules are built, checked and simulated without processes.
"""

from __future__ import annotations

import pytest

from trident.pipeline import (
    SCHEDULES,
    Backward,
    Costs,
    Forward,
    OptimizerStep,
    RecvGrad,
    ReduceGrads,
    ReduceTiedGrads,
    ScheduleError,
    SendActivation,
    build_all,
    build_schedule,
    check_schedule,
    forward_only,
    simulate,
)
from trident.pipeline.simulate import peak_live_activations

STAGES = range(2, 9)
MICRO = range(1, 17)
VARIANTS = [("gpipe", 1), ("1f1b", 1), ("zb_h1", 1), ("interleaved_1f1b", 2), ("interleaved_1f1b", 3)]
EQUAL = Costs(forward=1.0, backward=2.0)
SPLIT = Costs(forward=1.0, backward_input=1.0, backward_weight=1.0)  # ZB: t_f = t_b = t_w


@pytest.mark.parametrize("name,v", VARIANTS)
def test_every_schedule_is_well_formed(name, v):
    """P in 2..8, M in 1..16: sends meet receives in order, F then B everywhere, no deadlock."""
    for p in STAGES:
        for m in MICRO:
            check_schedule(build_all(name, p, m, v), m, v)


def test_forward_only_is_well_formed():
    for p in STAGES:
        for m in (1, 5, 16):
            for v in (1, 2):
                programs = [forward_only(p, m, s, v) for s in range(p)]
                check_schedule(programs, m, v, train=False)
                assert not any(isinstance(i, Backward) for prog in programs for i in prog)


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("costs", [EQUAL, Costs(forward=1.0, backward=1.0)])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name, costs):
    for p in STAGES:
        for m in MICRO:
            timeline = simulate(build_all(name, p, m), costs)
            expected = (p - 1) / (m + p - 1)
            for s in range(p):
                assert timeline.bubble_fraction(s) == pytest.approx(expected, abs=1e-12), (p, m, s)


@pytest.mark.parametrize("v", [2, 3, 4])
def test_interleaved_bubble_is_p_minus_1_over_vm_plus_p_minus_1(v):
    """Exact whenever every round has at least p micro-batches (m >= p); chunk costs equal."""
    for p in STAGES:
        for m in MICRO:
            timeline = simulate(build_all("interleaved_1f1b", p, m, v), EQUAL)
            expected = (p - 1) / (v * m + p - 1)
            if m >= p:
                assert timeline.bubble_fraction() == pytest.approx(expected, abs=1e-12), (p, m)
            else:  # a round shorter than the pipeline waits for its own wrap-around
                assert timeline.bubble_fraction() >= expected - 1e-12, (p, m)


def test_zb_h1_idles_at_most_a_third_of_1f1b():
    """With t_f = t_b = t_w, ZB-H1's idle time per stage is (p-1) units against 1F1B's 3(p-1)."""
    for p in STAGES:
        for m in range(p, 17):
            ref = simulate(build_all("1f1b", p, m), EQUAL)
            zb = simulate(build_all("zb_h1", p, m), SPLIT)
            assert zb.makespan == pytest.approx(3 * m + p - 1)
            for s in range(p):
                assert zb.idle(s) <= ref.idle(s) / 3 + 1e-12, (p, m, s)


def test_peak_live_activations():
    for p in STAGES:
        for m in MICRO:
            gpipe = simulate(build_all("gpipe", p, m))
            one_f_one_b = simulate(build_all("1f1b", p, m))
            zb = simulate(build_all("zb_h1", p, m), SPLIT)
            assert gpipe.peak_live == [m] * p
            assert one_f_one_b.peak_live == [min(p - s, m) for s in range(p)]
            assert max(zb.peak_live) <= p


def test_1f1b_warms_up_p_minus_s_minus_1_forwards():
    prog = build_schedule("1f1b", 4, 8, 1)
    compute = [i for i in prog if isinstance(i, (Forward, Backward))]
    assert [str(i) for i in compute[:5]] == ["F0", "F1", "F2", "B0", "F3"]
    assert prog[-3:] == [ReduceTiedGrads(), ReduceGrads(), OptimizerStep()]


def test_simulated_p2p_latency_lengthens_the_pipeline():
    """GPipe streams, so only the first forward and the last backward pay the p - 1 hops."""
    for p, m in ((2, 1), (3, 5), (4, 8)):
        programs = build_all("gpipe", p, m)
        fast, slow = simulate(programs, EQUAL), simulate(programs, Costs(forward=1.0, backward=2.0, p2p=0.5))
        assert slow.makespan == pytest.approx(fast.makespan + 2 * (p - 1) * 0.5)


def test_checker_finds_out_of_order_channels():
    """Stage 0 sends micro-batch 1's activation before micro-batch 0's; stage 1 expects 0 first."""
    programs = build_all("gpipe", 2, 2)
    stage0 = [i for i in programs[0] if i != SendActivation(0)]
    stage0.insert(stage0.index(SendActivation(1)) + 1, SendActivation(0))
    programs[0] = stage0
    with pytest.raises(ScheduleError, match="out of order"):
        check_schedule(programs, 2)


def test_checker_finds_deadlocks():
    """Stage 0 waits for a gradient before sending the activation that would produce it."""
    programs = build_all("1f1b", 2, 1)
    stage0 = [i for i in programs[0] if i != RecvGrad(0)]
    stage0.insert(stage0.index(Forward(0)), RecvGrad(0))
    programs[0] = stage0
    with pytest.raises(ScheduleError, match="deadlocks: stage 0 waits at instruction 1 .*rg0.*stage 1 waits"):
        check_schedule(programs, 1)


def test_checker_finds_missing_work_and_step():
    programs = build_all("1f1b", 2, 2)
    programs[1] = [i for i in programs[1] if i != Backward(1, 0)]
    with pytest.raises(ScheduleError, match="appears 0 times"):
        check_schedule(programs, 2)
    programs = build_all("1f1b", 2, 2)
    programs[0] = programs[0][:-1]
    with pytest.raises(ScheduleError, match="step instructions"):
        check_schedule(programs, 2)


def test_build_schedule_rejects_bad_arguments():
    assert set(SCHEDULES) == {"gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}
    with pytest.raises(ValueError, match="unknown; choose one of"):
        build_schedule("pipedream", 2, 4, 0)
    with pytest.raises(ValueError, match="needs schedule 'interleaved_1f1b'"):
        build_schedule("1f1b", 2, 4, 0, virtual_stages=2)
    with pytest.raises(ValueError, match=r"stage must be an integer in \[0, 2\)"):
        build_schedule("gpipe", 2, 4, 2)
    with pytest.raises(ValueError, match="micro_batches must be a positive integer"):
        build_schedule("gpipe", 2, 0, 0)


def test_instruction_labels_and_peak_of_a_program():
    prog = build_schedule("interleaved_1f1b", 2, 2, 0, virtual_stages=2)
    assert "F0.1" in [str(i) for i in prog] and str(Forward(3)) == "F3"
    assert peak_live_activations(prog) == simulate(build_all("interleaved_1f1b", 2, 2, 2)).peak_live[0]


def test_costs_per_stage_and_chunk_and_posting_time():
    programs = build_all("interleaved_1f1b", 2, 2, 2)
    heavy_last = [Costs(), [Costs(), Costs(forward=3.0)]]  # stage 1's chunk 1 (the model's end) is slow
    spans = {str(sp.instr): sp.end - sp.start for sp in simulate(programs, heavy_last).spans[1]}
    assert spans["F0.1"] == 3.0 and spans["F0"] == 1.0
    assert simulate(programs, heavy_last).makespan > simulate(programs).makespan
    posting = simulate(build_all("gpipe", 2, 2), Costs(post=0.25))
    sends = [sp for sp in posting.spans[0] if isinstance(sp.instr, SendActivation)]
    assert [sp.end - sp.start for sp in sends] == [0.25, 0.25]
    assert posting.busy(0) == pytest.approx(2 * 1.0 + 2 * 2.0 + 2 * 0.25)
    with pytest.raises(ValueError, match="costs has 1 entries but the schedule has stage 1"):
        simulate(programs, [Costs()])
