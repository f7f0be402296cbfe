"""`trident launch` ends a failed job with the first real error (issue 32, item 5): exception type and
message, rank and host, its traceback printed once, and the rank that failed first, never one the
agent stopped. The failures here happen before trident's own failure hook is installed."""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

from tests.scripts.jobs import run_trident

SCRIPT = str(Path(__file__).resolve().parents[1] / "scripts" / "fail_early.py")
pytestmark = pytest.mark.launch


def test_the_same_error_on_every_rank_is_reported_once():
    proc = run_trident(["launch", "--nproc", "2", SCRIPT, "--mode", "both"], timeout=120)
    err = proc.stderr
    assert proc.returncode == 1
    assert err.count("Traceback (most recent call last)") == 1, err[-4000:]
    assert "To enable traceback see" not in err.strip().splitlines()[-1]
    last = err.strip().splitlines()[-2:]
    assert re.match(r"trident launch: the job failed; first failure on global rank [01] on host ", last[0]), last
    assert socket.gethostname() in last[0]
    assert re.fullmatch(r"trident launch: rank [01]: ValueError: bad value in the script's own set-up", last[1])
    assert 'raise ValueError("bad value' in err  # the traceback itself, once


def test_the_rank_that_failed_first_is_named_not_the_one_the_agent_stopped():
    proc = run_trident(["launch", "--nproc", "2", SCRIPT, "--mode", "one"], timeout=120)
    err = proc.stderr
    assert proc.returncode == 1
    last = err.strip().splitlines()[-2:]
    assert "first failure on global rank 1" in last[0], err[-3000:]
    assert last[1] == "trident launch: rank 1: KeyError: 'missing key on rank 1'", last
    assert err.count("Traceback (most recent call last)") == 1, err[-4000:]
