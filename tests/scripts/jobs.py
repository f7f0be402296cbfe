"""Run a `trident` command line as the launch tests do, without leaving processes behind.

The command runs in its own session; if it outlives `timeout`, the whole process group (the
launcher, torchrun's agent and every worker) is killed before the test fails, so a hung job
cannot outlive its test.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

TRIDENT = [sys.executable, "-m", "trident.cli.main"]


def run_trident(args: list[str], timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`trident ARGS...`, its output captured as text (`env`: the command's environment)."""
    proc = subprocess.Popen(TRIDENT + args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"`trident {' '.join(args)}` did not end within {timeout:g} s; killed it.\n"
                             f"stdout tail:\n{out[-2000:]}\nstderr tail:\n{err[-2000:]}") from None
    return subprocess.CompletedProcess(TRIDENT + args, proc.returncode, out, err)


def train_and_read_metrics(tmp_path, config: dict, name: str, nproc: int = 2) -> list[dict]:
    """`trident train` on `config` (written to tmp_path/NAME.json); the run's metrics.csv rows."""
    import csv
    import json

    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    proc = run_trident(["train", "--nproc", str(nproc), "--config", str(path), "--run-dir", str(tmp_path),
                        "--run-name", name], timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with open(tmp_path / name / "metrics.csv") as f:
        return list(csv.DictReader(f))
