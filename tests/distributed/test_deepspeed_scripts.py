"""Three scripts written the way DeepSpeed's examples are, with only `import trident as
deepspeed` changed (tests/scripts/deepspeed): each runs on 2 ranks through `trident launch` and
matches the same script run as one process, in fp32."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "deepspeed"
pytestmark = pytest.mark.launch
# The 2-rank runs sum gradients over ranks in another order than one process: fp32 rounding.
TOLERANCE = 1e-5


def _run(argv: list[str], nproc: int) -> dict:
    launcher = [sys.executable, "-m", "trident.cli.main", "launch", "--nproc", str(nproc)] if nproc > 1 \
        else [sys.executable]
    proc = subprocess.run(launcher + argv, capture_output=True, text=True, timeout=240, cwd=SCRIPTS)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.findall(r"RESULT (.*?) END", proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:]
    result = ast.literal_eval(found[0])
    result["log"] = proc.stdout + proc.stderr
    return result


def _same(one: dict, two: dict) -> None:
    diffs = [abs(a - b) for a, b in zip(one["losses"], two["losses"])]
    assert len(one["losses"]) == len(two["losses"]) and max(diffs) < TOLERANCE, (one["losses"], two["losses"])
    assert abs(one["checksum"] - two["checksum"]) < 1e-4, (one["checksum"], two["checksum"])


def test_cifar_style_script():
    argv = ["cifar_style.py", "--deepspeed", "--deepspeed_config", "cifar_config.json"]
    one, two = _run(argv, 1), _run(argv, 2)
    _same(one, two)
    assert (one["world"], two["world"], two["global_steps"]) == (1, 2, 8)
    # the DeepSpeed keys with no effect, and the _comment, are listed once at start-up (rank 0 logs)
    ignored = [line for line in two["log"].splitlines() if "DeepSpeed key(s) ignored" in line]
    assert len(ignored) == 1 and "zero_optimization.allgather_partitions" in ignored[0], ignored
    assert "unknown key(s) ignored" in two["log"] and "_comment" in two["log"]


def test_pipeline_script():
    one = _run(["pipe_style.py", "-p", "1", "--deepspeed_config", "pipe_config.json"], 1)
    two = _run(["pipe_style.py", "-p", "2", "--deepspeed_config", "pipe_config.json"], 2)
    _same(one, two)
    assert (one["stages"], two["stages"], two["micro_batches"]) == (1, 2, 4)


def test_zero3_script(tmp_path):
    argv = ["zero3_style.py", "--deepspeed", "--deepspeed_config", "zero3_config.json"]
    one = _run(argv, 1)
    two = _run(argv + ["--save_dir", str(tmp_path)], 2)
    _same(one, two)
    assert two["stage"] == 3 and (tmp_path / "pytorch_model.bin").exists()
