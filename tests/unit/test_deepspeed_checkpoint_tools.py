"""`trident checkpoint inspect` / `consolidate` read DeepSpeed checkpoints as they are and the
trident checkpoints imported from them (issue 32, item 6); other commands name `import-deepspeed`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from trident.checkpointing.consolidate import get_fp32_state_dict_from_zero_checkpoint
from trident.deepspeed.checkpoint import import_deepspeed

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspeed"


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trident.cli.main", "checkpoint", *args], capture_output=True,
                          text=True, timeout=300)


def test_inspect_an_imported_deepspeed_checkpoint(tmp_path):
    folder = import_deepspeed(FIXTURES / "zero1", tmp_path / "imported")
    proc = cli("inspect", str(folder.parent))
    assert proc.returncode == 0, proc.stderr
    assert "imported from a DeepSpeed zero1 checkpoint (pp 1 x dp 2 x tp 1)" in proc.stdout


def test_inspect_and_consolidate_read_a_raw_deepspeed_checkpoint(tmp_path):
    for kind in ("zero1", "zero3", "pipe"):
        proc = cli("inspect", str(FIXTURES / kind))
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.startswith(f"DeepSpeed checkpoint {FIXTURES / kind} (global_step4)"), proc.stdout[:200]
        assert "read through `trident checkpoint import-deepspeed`" in proc.stderr
    out = tmp_path / "zero3.safetensors"
    proc = cli("consolidate", str(FIXTURES / "zero3"), str(out))
    assert proc.returncode == 0, proc.stderr
    expected = get_fp32_state_dict_from_zero_checkpoint(import_deepspeed(FIXTURES / "zero3", tmp_path / "z3").parent)
    got = load_file(out)
    assert set(got) <= set(expected) and got
    assert all(torch.equal(got[k], expected[k]) for k in got)


def test_other_commands_name_import_deepspeed(tmp_path):
    proc = cli("reshard", str(FIXTURES / "zero1"), str(tmp_path / "out"), "--pp", "1", "--tp", "1", "--dp", "1")
    assert proc.returncode == 1
    assert "it holds a DeepSpeed checkpoint" in proc.stderr and "import-deepspeed" in proc.stderr, proc.stderr
