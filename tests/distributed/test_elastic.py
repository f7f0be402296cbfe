"""Elastic restart with auto-resume, under `trident launch --max-restarts 1`.

The script (tests/scripts/elastic_script.py) saves a checkpoint every 2 steps with
`checkpoint.auto_resume`; on its first attempt a rank dies on purpose. The restarted job must
resume from the newest complete checkpoint and produce, step for step, the losses of a run
that was never interrupted (bit for bit: same weights, optimizer state, RNG and data order).
"""

from __future__ import annotations

import random
import re
import subprocess
from pathlib import Path

import pytest

from tests.scripts.jobs import run_trident

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
STEPS = 8
pytestmark = pytest.mark.launch


def _run(tmp: Path, *extra: str, restarts: int = 1) -> subprocess.CompletedProcess:
    tmp.mkdir(parents=True, exist_ok=True)
    return run_trident(["launch", "--nproc", "2", "--max-restarts", str(restarts),
                        str(SCRIPTS / "elastic_script.py"), "--ckpt", str(tmp / "ckpt"),
                        "--out", str(tmp), "--steps", str(STEPS), *extra], timeout=180)


def _losses(folder: Path, rank: int) -> list[tuple[int, int, str]]:
    """(attempt, step, loss as printed) per line of the rank's loss log."""
    lines = (folder / f"losses_rank{rank}.txt").read_text().split("\n")
    return [(int(a), int(s), loss) for a, s, loss in (line.split() for line in lines if line)]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, dict[int, str]]:
    folder = tmp_path_factory.mktemp("uninterrupted")
    proc = _run(folder, restarts=0)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {rank: {step: loss for _, step, loss in _losses(folder, rank)} for rank in (0, 1)}


def _assert_resumed_equal(folder: Path, proc, resume_step: int, reference, context: str) -> None:
    assert proc.returncode == 0, f"{context}\n{proc.stderr[-3000:]}"
    assert "START attempt=1" in proc.stdout, context
    for rank in (0, 1):
        assert f"RESUMED rank={rank} attempt=1 step={resume_step}" in proc.stdout, context
        after = {step: loss for attempt, step, loss in _losses(folder, rank) if attempt == 1}
        assert sorted(after) == list(range(resume_step + 1, STEPS + 1)), context
        assert after == {s: reference[rank][s] for s in after}, f"{context}: rank {rank} losses differ"


def test_kill_9_of_a_random_rank_resumes_with_the_uninterrupted_losses(tmp_path, uninterrupted):
    rng = random.Random()
    rank, step = rng.randrange(2), rng.randrange(1, STEPS - 1)
    context = f"rank {rank} killed before step index {step}"
    proc = _run(tmp_path, "--kill-rank", str(rank), "--kill-step", str(step))
    _assert_resumed_equal(tmp_path, proc, 2 * (step // 2), uninterrupted, context)


def test_kill_during_a_checkpoint_write_keeps_the_previous_checkpoint(tmp_path, uninterrupted):
    proc = _run(tmp_path, "--kill-in-save", "4")
    # the restart saw the partial folder of step 4, with `latest` still naming step 2
    assert re.search(r"START attempt=1 latest=global_step2 partial=\.global_step4\.partial", proc.stdout), \
        proc.stdout[-2000:]
    _assert_resumed_equal(tmp_path, proc, 2, uninterrupted, "killed while saving step 4")
    ckpt = tmp_path / "ckpt"
    assert (ckpt / "latest").read_text() == f"global_step{STEPS}"
    assert not list(ckpt.glob(".*.partial"))
