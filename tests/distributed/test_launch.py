"""`trident launch` and `trident train` through torchrun's elastic agent, in real subprocesses."""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"
TRIDENT = [sys.executable, "-m", "trident.cli.main"]
pytestmark = pytest.mark.launch


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _results(text: str) -> dict[int, dict[str, str]]:
    """RESULT records printed by the ranks (their lines may interleave on a shared pipe)."""
    rows = {}
    for match in re.finditer(r"RESULT (.*?) END", text):
        fields = dict(kv.split("=") for kv in match.group(1).split())
        rows[int(fields["rank"])] = fields
    return rows


def test_launch_two_processes():
    proc = subprocess.run(TRIDENT + ["launch", "--nproc", "2", str(SCRIPTS / "dp_script.py")],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = _results(proc.stdout)
    assert sorted(rows) == [0, 1]
    assert rows[0]["world"] == rows[1]["world"] == "2" and rows[0]["steps"] == "3"
    assert rows[0]["checksum"] == rows[1]["checksum"]  # replicas agree


def test_two_nodes_on_loopback():
    port = str(_free_port())
    node = lambda r: subprocess.Popen(  # noqa: E731
        TRIDENT + ["launch", "--nproc", "1", "--nnodes", "2", "--node-rank", str(r),
                   "--master-addr", "127.0.0.1", "--master-port", port, str(SCRIPTS / "dp_script.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    nodes = [node(0), node(1)]
    outs = [p.communicate(timeout=240) for p in nodes]
    for p, (out, err) in zip(nodes, outs):
        assert p.returncode == 0, err[-3000:]
    rows = {**_results(outs[0][0]), **_results(outs[1][0])}
    assert sorted(rows) == [0, 1] and rows[0]["world"] == "2"
    assert rows[0]["checksum"] == rows[1]["checksum"]


def test_failing_rank_fails_the_job_and_is_named():
    proc = subprocess.run(TRIDENT + ["launch", "--nproc", "2", str(SCRIPTS / "dp_script.py"), "--fail-rank", "1"],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert re.search(r"first failure on global rank 1", proc.stderr), proc.stderr[-3000:]
    assert "injected failure on rank 1" in proc.stderr


def test_launch_rejects_bad_flags():
    proc = subprocess.run(TRIDENT + ["launch", "--nproc", "0", "x.py"], capture_output=True, text=True)
    assert proc.returncode != 0 and "--nproc must be >= 1, got 0" in proc.stderr


def test_train_leaves_a_complete_run_folder(tmp_path):
    proc = subprocess.run(TRIDENT + ["train", "--nproc", "2", "--config", str(SCRIPTS / "tiny_train.json"),
                                     "--run-dir", str(tmp_path), "--run-name", "smoke"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "smoke"
    assert "run folder:" in proc.stdout and str(run) in proc.stdout
    for name in ("config.json", "metrics.csv", "loss.png"):
        assert (run / name).stat().st_size > 0, name
    assert list((run / "tensorboard").glob("events.out.tfevents.*"))
    ckpts = run / "checkpoints"
    assert (ckpts / "latest").read_text() == "global_step4"
    assert (ckpts / "global_step2" / "manifest.json").exists()
    lines = (run / "metrics.csv").read_text().splitlines()
    assert lines[0].startswith("step") and len(lines) == 5


def test_train_reports_a_bad_config_once(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 2, "fp16": {"enabeld": true}}')
    proc = subprocess.run(TRIDENT + ["train", "--config", str(bad)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.count("fp16.enabeld") == 1 and "did you mean 'enabled'" in proc.stderr


def test_keep_going_lets_the_other_ranks_finish(tmp_path):
    """--keep-going: rank 1 dies at once, ranks 0 and 2 still run to the end; the job still fails."""
    script = tmp_path / "lone.py"
    script.write_text("import os, sys\n"
                      "rank = int(os.environ['RANK'])\n"
                      "if rank == 1:\n    sys.exit(3)\n"
                      "print(f\"RESULT rank={rank} world={os.environ['WORLD_SIZE']} END\", flush=True)\n")
    proc = subprocess.run(TRIDENT + ["launch", "--keep-going", "--nproc", "3", str(script)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert sorted(_results(proc.stdout)) == [0, 2]
    assert "1 of 3 rank(s) failed: rank 1 (exit code 3)" in proc.stderr
