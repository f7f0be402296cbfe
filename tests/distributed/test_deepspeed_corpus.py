"""Unmodified DeepSpeed scripts (tests/scripts/deepspeed/unmodified: cifar-style, pipeline,
Megatron-style with mpu, Hugging Face with param groups) run on 2 ranks in both ways a DeepSpeed
user can switch, and train like one process (SGD + clipping and AdamW configs):

- `trident launch --as-deepspeed` with no change at all (`import deepspeed` resolves to trident);
- with only `import deepspeed` changed to `import trident as deepspeed` (every
  `from deepspeed.x import y` below it follows).

bench/deepspeed_scripts.py runs the same scripts under DeepSpeed itself and compares per-step losses.
"""

from __future__ import annotations

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts" / "deepspeed" / "unmodified"
pytestmark = pytest.mark.launch
TOLERANCE = 1e-5  # 2 ranks sum gradients in another order than one process: fp32 rounding

CASES = {  # name: (script arguments on 1 rank, on 2 ranks)
    "cifar-sgd-clip": (["cifar_ds.py", "--deepspeed", "--deepspeed_config", "sgd_clip.json",
                        "--ckpt_dir", "{tmp}"],) * 2,
    "pipe-adamw": (["pipe_ds.py", "-p", "1", "--deepspeed_config", "adamw.json"],
                   ["pipe_ds.py", "-p", "2", "--deepspeed_config", "adamw.json"]),
    "megatron-sgd-clip": (["megatron_ds.py", "--deepspeed_config", "sgd_clip.json"],) * 2,
    "hf-groups-adamw": (["hf_ds.py", "--deepspeed_config", "adamw.json"],) * 2,
}


def launch(argv: list[str], nproc: int, cwd: Path, as_deepspeed: bool) -> dict:
    command = [sys.executable, "-m", "trident.cli.main", "launch", "--nproc", str(nproc)]
    command += ["--as-deepspeed"] if as_deepspeed else []
    proc = subprocess.run(command + argv, capture_output=True, text=True, timeout=300, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-4000:]
    found = re.findall(r"RESULT (.*?) END", proc.stdout)
    assert len(found) == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    return ast.literal_eval(found[0])


def import_changed(tmp_path: Path) -> Path:
    """The scripts with `import deepspeed` changed to `import trident as deepspeed`, nothing else."""
    folder = tmp_path / "import_changed"
    shutil.copytree(SCRIPTS, folder)
    for script in folder.glob("*.py"):
        text = script.read_text()
        assert text.count("\nimport deepspeed\n") == 1, script
        script.write_text(text.replace("\nimport deepspeed\n", "\nimport trident as deepspeed\n"))
    return folder


def same(one: list[float], two: list[float]) -> None:
    assert len(one) == len(two) and max(abs(a - b) / abs(a) for a, b in zip(one, two)) < TOLERANCE, (one, two)


@pytest.mark.parametrize("case", sorted(CASES))
def test_unmodified_script_on_two_ranks_trains_like_one_process(case, tmp_path):
    single, double = CASES[case]
    one = launch([a.format(tmp=tmp_path / "one") for a in single], 1, SCRIPTS, as_deepspeed=True)
    switched = launch([a.format(tmp=tmp_path / "two") for a in double], 2, SCRIPTS, as_deepspeed=True)
    changed = launch([a.format(tmp=tmp_path / "three") for a in double], 2, import_changed(tmp_path),
                     as_deepspeed=False)
    same(one["losses"], switched["losses"])
    assert changed["losses"] == switched["losses"]  # the same script, the same trident: bit for bit
    if case.startswith("cifar"):
        assert switched["saved"] and switched["accelerator"] == "cpu" and switched["bf16"] is False
    if case.startswith("hf"):
        assert switched["groups"] == 2 and switched["decays"] == [0.0, 0.1]
    if case.startswith("megatron"):
        assert (one["gas"], switched["gas"], switched["mp"], switched["clipping"]) == (2, 1, 1, 0.5)


def test_deepspeed_import_without_the_switch_is_not_trident(tmp_path):
    """Without --as-deepspeed (and without `import trident as deepspeed`), `import deepspeed` is
    DeepSpeed's own business: here, where it is not installed, a ModuleNotFoundError."""
    script = tmp_path / "plain.py"
    script.write_text("import trident\nimport deepspeed\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "No module named 'deepspeed'" in proc.stderr
