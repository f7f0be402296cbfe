"""The hang detector: what the flight recorder keeps, how reports read, and real stuck jobs.

The recorder tests run on the shared gloo pool (nothing hangs there). The stuck and diverging
jobs run under `trident launch` in subprocesses, because the detector ends them.
"""

from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tests.scripts.jobs import run_trident
from trident.comm import collectives, p2p
from trident.config.schema import DistributedConfig
from trident.reliability import configure, shutdown
from trident.reliability.report import divergence_report, first_divergence, hang_report
from trident.testing.distributed import run_on_ranks

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


# -- the recorder, on real gloo ranks ----------------------------------------------------------

def record_some_calls() -> dict:
    recorder = configure(DistributedConfig(flight_recorder_size=4, strict_collectives=True))
    try:
        world = dist.group.WORLD
        start = recorder.streams.get(f"group {world.group_name} [0, 1]")
        base = start.seq if start is not None else 0
        collectives.all_reduce(torch.ones(3, 2), group=world)
        handle = collectives.all_gather(torch.empty(4, dtype=torch.float64), torch.ones(2, dtype=torch.float64),
                                        group=world, async_op=True)
        issued = recorder.records()[-1].state
        handle.wait()
        peer = 1 - dist.get_rank()
        if dist.get_rank() == 0:
            p2p.send(torch.ones(5), dst=peer, group=world)
        else:
            p2p.recv(torch.empty(5), src=peer, group=world)
        for _ in range(16):  # reaches a strict-mode checkpoint
            collectives.barrier(group=world)
        rows = [r.describe(time.monotonic()) for r in recorder.records()]
        stream = recorder.streams[f"group {world.group_name} [0, 1]"]
        return {"base": base, "issued": issued, "rows": rows, "waiting": len(recorder.waiting),
                "hash": stream.hash}
    finally:
        shutdown()


def test_recorder_keeps_op_group_sequence_shapes_and_call_site():
    results = run_on_ranks(2, record_some_calls)
    for rank, got in enumerate(results):
        assert got["issued"] == "issued" and got["waiting"] == 0
        assert len(got["rows"]) == 4  # the ring keeps the newest flight_recorder_size calls
        assert all(r["op"] == "barrier" and r["state"] == "done" for r in got["rows"])
        seqs = [r["streams"][0][2] for r in got["rows"]]
        assert seqs == [got["base"] + n for n in (15, 16, 17, 18)]  # 2 calls, then 16 barriers
        assert re.fullmatch(r"tests/distributed/test_hang_detector\.py:\d+ in record_some_calls",
                            got["rows"][-1]["site"]), got["rows"][-1]["site"]
        assert got["rows"][0]["streams"][0][1] == [0, 1]
    # strict mode's running hash of (op, element count, dtype) agrees across processes
    assert results[0]["hash"] == results[1]["hash"] != 0


def record_p2p_and_async() -> list:
    recorder = configure(DistributedConfig())
    try:
        world, rank = dist.group.WORLD, dist.get_rank()
        out = []
        t = torch.full((2, 3), float(rank))
        handle = p2p.isend(t, dst=1, group=world) if rank == 0 else p2p.irecv(t, src=0, group=world)
        handle.wait()
        collectives.all_reduce(torch.ones(1, dtype=torch.int64), group=world)
        for rec in recorder.records()[-2:]:
            d = rec.describe(time.monotonic())
            out.append((d["op"], d["streams"][0][0], d["shape"], d["dtype"], d["state"]))
        return out
    finally:
        shutdown()


def test_p2p_calls_are_recorded_per_direction():
    sender, receiver = run_on_ranks(2, record_p2p_and_async)
    assert sender[0] == ("send", "p2p 0->1", [2, 3], "float32", "done")
    assert receiver[0] == ("recv", "p2p 0->1", [2, 3], "float32", "done")
    assert sender[1][0] == receiver[1][0] == "all_reduce" and sender[1][3] == "int64"


# -- reports from snapshots (no processes) -----------------------------------------------------

def _rec(op, seq, state="done", shape=(4,), dtype="float32", site="train.py:10 in main", key="group 0 [0, 1, 2]"):
    ranks = [int(r) for r in key[key.index("[") + 1:-1].split(", ")]
    return {"op": op, "streams": [[key, ranks, seq]], "shape": list(shape), "dtype": dtype, "site": site,
            "state": state, "age": 1.0, "done_ago": 6.0, "waited": 6.0}


def _state(rank, records, seq, waiting=(), now_at=None):
    return {"rank": rank, "records": records, "waiting": list(waiting), "now_at": now_at,
            "streams": {"group 0 [0, 1, 2]": {"ranks": [0, 1, 2], "seq": seq}}}


def test_hang_report_names_op_sequence_reached_missing_and_silent_ranks():
    stuck = _rec("all_reduce", 7, state="waiting", site="engine.py:5 in step")
    states = {0: _state(0, [_rec("all_reduce", 6), stuck], 7, [stuck]),
              1: _state(1, [_rec("all_reduce", 6, site="train.py:33 in main")], 6, now_at="data.py:40 in load")}
    text, summary = hang_report({"rank": 0, "record": stuck, "timeout_s": 5}, states, [0, 1, 2])
    assert "all_reduce #7 on group [0, 1, 2]" in text.splitlines()[0]
    assert "reached it:       rank 0" in text
    assert ("did not reach it: rank 1: its last call was all_reduce #6 on group [0, 1, 2] (done 6.0 s ago, "
            "train.py:33 in main); it is now at data.py:40 in load") in text
    assert "no report from:   rank 2" in text
    assert summary["culprits"] == [1] and "not reached by rank(s) 1" in summary["headline"]


def test_hang_report_for_a_recv_names_the_sender_that_did_not_send():
    recv = {"op": "recv", "streams": [["p2p 0->1", [0, 1], 3]], "shape": [2, 8], "dtype": "float32",
            "site": "pipe.py:7 in recv_activation", "state": "waiting", "age": 6.0, "waited": 6.0}
    last = {"op": "send", "streams": [["p2p 0->1", [0, 1], 2]], "shape": [2, 8], "dtype": "float32",
            "site": "pipe.py:3 in send_activation", "state": "done", "age": 7.0, "done_ago": 6.5}
    states = {1: {"records": [recv], "waiting": [recv], "streams": {"p2p 0->1": {"ranks": [0, 1], "seq": 3}}},
              0: {"records": [last], "waiting": [], "now_at": "train.py:9 in main",
                  "streams": {"p2p 0->1": {"ranks": [0, 1], "seq": 2}}}}
    text, summary = hang_report({"rank": 1, "record": recv, "timeout_s": 5}, states, [0, 1])
    assert "in recv #3 on p2p 0->1 (float32[2, 8], pipe.py:7 in recv_activation)" in text.splitlines()[0]
    assert "did not reach it: rank 0: its last call was send #2 on p2p 0->1" in text
    assert summary["culprits"] == [0]


def test_divergence_is_found_at_the_first_differing_call():
    states = {0: _state(0, [_rec("all_reduce", 4), _rec("all_reduce", 5), _rec("all_reduce", 6)], 6),
              1: _state(1, [_rec("all_reduce", 4), _rec("broadcast", 5), _rec("all_reduce", 6, dtype="int32")], 6),
              2: _state(2, [_rec("all_reduce", 4), _rec("all_reduce", 5), _rec("all_reduce", 6)], 6)}
    seq, recs = first_divergence(states, "group 0 [0, 1, 2]")
    assert seq == 5 and recs[1]["op"] == "broadcast"
    text, summary = divergence_report({"stream": "group 0 [0, 1, 2]", "seq_from": 0, "seq_to": 16,
                                       "hashes": {"0": 1, "1": 2, "2": 1}}, states)
    assert "call #5 on group [0, 1, 2] differs between ranks" in text and "rank 1: broadcast float32[4]" in text
    assert summary["culprits"] == [1]


# -- real jobs under trident launch ------------------------------------------------------------

def _launch(*script_args: str, timeout: float = 120) -> tuple[subprocess.CompletedProcess, float]:
    proc = run_trident(["launch", "--nproc", "2", str(SCRIPTS / "hang_script.py"), *script_args], timeout)
    return proc, time.time()


@pytest.mark.launch
def test_a_skipped_collective_ends_the_job_naming_the_op_and_the_missing_rank():
    proc, ended = _launch("--mode", "skip", "--rank", "1", "--step", "2", "--timeout", "5")
    assert proc.returncode != 0, proc.stderr[-3000:]
    entered = float(re.search(r"ENTERING step 2 at ([\d.]+)", proc.stdout).group(1))
    assert ended - entered < 5 + 6, f"the job took {ended - entered:.1f} s to end after the hang began"
    err = proc.stderr
    assert err.count("trident hang detector:") == 1, err[-3000:]
    report = err[err.index("trident hang detector:"):]
    assert re.search(r"in all_reduce #\d+ on group \[0, 1\]", report.splitlines()[0])
    assert "reached it:       rank 0" in report
    assert re.search(r"did not reach it: rank 1: its last call was .*; it is now at "
                     r"tests/scripts/hang_script\.py:\d+ in load_next_batch", report), report
    last = err.strip().splitlines()[-2:]
    assert "first failure on global rank 1" in last[0], last
    assert "not reached by rank(s) 1" in last[1], last


@pytest.mark.launch
def test_strict_mode_names_the_first_divergent_collective():
    proc, _ = _launch("--mode", "dtype", "--rank", "1", "--step", "1", "--steps", "30", "--timeout", "5", "--strict")
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "RESULT" not in proc.stdout  # the job was stopped, not finished with garbage
    assert re.search(r"trident strict collectives: the ranks of group \[0, 1\] issued different collectives: "
                     r"call #\d+ on group \[0, 1\] differs between ranks: rank 0: all_reduce float32\[16\] "
                     r"\(tests/scripts/hang_script\.py:\d+ in <module>\); rank 1: all_reduce int32\[16\]",
                     proc.stderr), proc.stderr[-3000:]
    assert "first failure on global rank 1" in proc.stderr.strip().splitlines()[-2]
