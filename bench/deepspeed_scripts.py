"""The same unmodified DeepSpeed scripts under DeepSpeed and under trident: per-step losses side by side.

The scripts are tests/scripts/deepspeed/unmodified/*.py (cifar-style with get_accelerator(),
bfloat16_enabled() and a checkpoint round trip; a pipeline script with RepeatingLoader,
set_random_seed and train_batch(); a Megatron-style script passing mpu; a Hugging Face GPT-2
with decay / no-decay param groups), with `import deepspeed` as written. Each runs on 2 gloo ranks:

  DeepSpeed  the bench venv's python (DeepSpeed 0.19 on CPU, DS_ACCELERATOR=cpu) under torchrun;
             the configs set `torch_adam: true` (DeepSpeed's Adam is otherwise a compiled op)
  trident    this checkout under `trident launch --as-deepspeed` (a venv without DeepSpeed, so
             `import deepspeed` resolves to trident)

Target: every step within 1e-6 relative. `make bench-deepspeed-scripts` makes the bench venv
(bench/README.md, "DeepSpeed on CPU with gloo"), adds `transformers` to it for the Hugging Face
script, and runs this.

    python bench/deepspeed_scripts.py [--deepspeed-python .venv-bench/bin/python] [--only cifar]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "tests" / "scripts" / "deepspeed" / "unmodified"
TARGET = 1e-6

CASES = [  # (name, script and its arguments)
    ("cifar, SGD + clipping, checkpoint", ["cifar_ds.py", "--deepspeed", "--deepspeed_config", "sgd_clip.json",
                                           "--ckpt_dir", "{tmp}/ckpt"]),
    ("cifar, AdamW", ["cifar_ds.py", "--deepspeed", "--deepspeed_config", "adamw.json"]),
    ("pipeline, 2 stages, AdamW", ["pipe_ds.py", "-p", "2", "--deepspeed_config", "adamw.json"]),
    ("Megatron-style mpu, SGD + clipping", ["megatron_ds.py", "--deepspeed_config", "sgd_clip.json"]),
    ("HF GPT-2, param groups, AdamW", ["hf_ds.py", "--deepspeed_config", "adamw.json"]),
]


def run(command: list[str], env: dict, what: str) -> list[float]:
    proc = subprocess.run(command, cwd=SCRIPTS, env=env, capture_output=True, text=True, timeout=900)
    found = re.findall(r"RESULT (.*?) END", proc.stdout)
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{what} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return ast.literal_eval(found[0])["losses"]


def deepspeed_run(python: str, argv: list[str], nproc: int) -> list[float]:
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    return run([python, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *argv], env,
               f"DeepSpeed: {' '.join(argv)}")


def trident_run(python: str, argv: list[str], nproc: int) -> list[float]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return run([python, "-m", "trident.cli.main", "launch", "--as-deepspeed", "--nproc", str(nproc), *argv], env,
               f"trident: {' '.join(argv)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--deepspeed-python", default=str(ROOT / ".venv-bench" / "bin" / "python"))
    parser.add_argument("--trident-python", default=sys.executable)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--only", default=None, help="run the cases whose name contains this")
    parser.add_argument("--tmp", default="/tmp/trident-bench-ds-scripts")
    args = parser.parse_args()
    worst_all = 0.0
    print(f"| script | step | DeepSpeed loss | trident loss | relative difference |\n|---|---:|---:|---:|---:|")
    summary = []
    for name, argv in CASES:
        if args.only and args.only not in name:
            continue
        ds = deepspeed_run(args.deepspeed_python, [a.format(tmp=f"{args.tmp}/ds") for a in argv], args.nproc)
        ours = trident_run(args.trident_python, [a.format(tmp=f"{args.tmp}/trident") for a in argv], args.nproc)
        if len(ds) != len(ours):
            raise SystemExit(f"{name}: DeepSpeed ran {len(ds)} steps, trident {len(ours)}")
        worst = 0.0
        for step, (a, b) in enumerate(zip(ds, ours)):
            rel = abs(a - b) / max(abs(a), 1e-12)
            worst = max(worst, rel)
            print(f"| {name} | {step} | {a:.9f} | {b:.9f} | {rel:.1e} |")
        summary.append((name, len(ds), worst))
        worst_all = max(worst_all, worst)
    print("\n| script | steps | worst relative difference |\n|---|---:|---:|")
    for name, steps, worst in summary:
        print(f"| {name} | {steps} | {worst:.1e} |")
    verdict = "met" if worst_all <= TARGET else "MISSED"
    print(f"\nworst over all scripts: {worst_all:.1e} (target {TARGET:.0e}): {verdict}")
    return 0 if worst_all <= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
