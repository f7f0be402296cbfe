"""Failures end the job loudly: one traceback, every rank stopped, the launcher names the rank.

The launch test uses the default 30-minute timeout on purpose: the other ranks, blocked in a
collective, must stop because the failing rank told them through the store, not because a
timeout ran out. The failing rank keeps a non-daemon thread alive, so its process does not
exit either (a common way for a crashed rank to linger).
"""

from __future__ import annotations

import io
import itertools
import json
import re
import sys
import time
from contextlib import redirect_stderr
from pathlib import Path

import pytest
import torch.distributed as dist

from tests.scripts.jobs import run_trident
from trident.config import load_config
from trident.reliability.failures import FailureHook, OneLineError
from trident.reliability.preflight_checks import PreflightError, run_preflight
from trident.testing.distributed import cached_mesh, run_on_ranks

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.launch
def test_an_exception_on_rank_1_of_4_stops_every_rank_and_is_named():
    proc = run_trident(["launch", "--nproc", "4", str(SCRIPTS / "hang_script.py"), "--mode", "raise",
                        "--rank", "1", "--step", "1", "--linger"], timeout=120)
    ended = time.time()
    err = proc.stderr
    assert proc.returncode != 0
    entered = float(re.search(r"ENTERING step 1 at ([\d.]+)", proc.stdout).group(1))
    assert ended - entered < 20, f"the job took {ended - entered:.1f} s to stop (timeout_s is 1800)"
    assert err.count("Traceback (most recent call last)") == 1, err[-4000:]
    assert "RuntimeError: injected failure on rank 1" in err
    # The first rank to stop this way makes torchrun's agent end the rest, so not every rank
    # gets to say it; the failing rank's own process lingers, so at least one must have.
    stopped = re.findall(r"trident: rank (\d) stops because rank (\d) failed with (.*) \(its traceback", err)
    assert stopped and all(cause == "1" and rank in "023" for rank, cause, _ in stopped), err[-3000:]
    assert {what for _, _, what in stopped} == {"RuntimeError: injected failure on rank 1"}
    last = err.strip().splitlines()[-2:]
    assert "trident launch: the job failed; first failure on global rank 1" in last[0], last
    assert last[1] == "trident launch: rank 1: RuntimeError: injected failure on rank 1", last


# -- preflight, on the shared pool (nothing dies: the mismatch is returned, not raised) ---------

def preflight_with(lr_by_rank: list[float], use_mesh: bool) -> str:
    cfg = load_config({"train_micro_batch_size_per_gpu": 2,
                       "optimizer": {"type": "SGD", "params": {"lr": lr_by_rank[dist.get_rank()]}},
                       "distributed": {"timeout_s": 30}})
    try:
        run_preflight(cfg, cached_mesh() if use_mesh else None)
    except PreflightError as err:
        return f"{'quiet' if err.quiet else 'loud'}: {err}"
    return "ok"


@pytest.mark.parametrize("use_mesh", [False, True])
def test_preflight_reports_a_config_mismatch_in_one_line(use_mesh):
    assert run_on_ranks(2, preflight_with, [0.1, 0.1], use_mesh) == ["ok", "ok"]
    loud, quiet = run_on_ranks(2, preflight_with, [0.1, 0.2], use_mesh)
    assert quiet.startswith("quiet: ") and loud.startswith("loud: ")
    message = loud[len("loud: "):]
    assert "\n" not in message
    assert re.fullmatch(r"trident preflight: the ranks disagree on the config: rank 0 sees [0-9a-f]{15}; rank 1 "
                        r"sees [0-9a-f]{15}; start every rank with the same config \(same file, same overrides\)",
                        message), message


def test_failure_hook_prints_a_one_line_error_once_and_a_traceback_otherwise():
    announced = []
    hook = FailureHook(0, announced.append, lambda exc: False)
    hook.previous = lambda *exc_info: print("TRACEBACK", file=sys.stderr)
    out = io.StringIO()
    with redirect_stderr(out):
        hook(OneLineError, OneLineError("trident preflight: the ranks disagree"), None)
        hook(OneLineError, OneLineError("the same, on another rank", quiet=True), None)
        hook(ValueError, ValueError("bad value\nsecond line"), None)
    assert out.getvalue() == "trident preflight: the ranks disagree\nTRACEBACK\n"
    assert announced == ["OneLineError: trident preflight: the ranks disagree",
                         "OneLineError: the same, on another rank", "ValueError: bad value"]


# -- how the launcher picks the first failure (no processes) ------------------------------------

_FILE_IDS = itertools.count()


def _failure(tmp_path: Path, rank: int, exitcode: int, entry: dict | None):
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    path = tmp_path / f"error_{next(_FILE_IDS)}.json"
    if entry is not None:
        path.write_text(json.dumps({"message": {"message": entry.get("error", ""),
                                                "extraInfo": {"py_callstack": "", "timestamp": "0"}},
                                    "trident": entry}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=exitcode, error_file=str(path))


def test_launcher_names_the_cause_not_the_ranks_stopped_because_of_it(tmp_path):
    from trident.cli.launch import first_failure

    failures = {0: _failure(tmp_path, 0, 3, {"kind": "peer", "time": 1.0}),
                1: _failure(tmp_path, 1, 1, {"kind": "comm", "time": 2.0, "error": "RuntimeError: closed"}),
                2: _failure(tmp_path, 2, 1, {"kind": "exception", "time": 3.0, "error": "ValueError: bad"}),
                3: _failure(tmp_path, 3, -15, None)}
    assert first_failure(failures) == (2, "ValueError: bad")
    hang = {0: _failure(tmp_path, 0, 3, {"kind": "hang", "time": 5.0, "culprits": [1],
                                         "headline": "all_reduce #4 on group [0, 1] did not complete"}),
            1: _failure(tmp_path, 1, 3, {"kind": "aborted", "time": 5.5})}
    assert first_failure(hang) == (1, "all_reduce #4 on group [0, 1] did not complete (reported by rank 0)")
    killed = {0: _failure(tmp_path, 0, 1, {"kind": "comm", "time": 1.0, "error": "RuntimeError: closed"}),
              1: _failure(tmp_path, 1, -9, None), 2: _failure(tmp_path, 2, -15, None)}
    assert first_failure(killed) == (1, "killed by signal 9 (SIGKILL)")
