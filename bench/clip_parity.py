"""Clipped SGD under each layout against one process, through `trident train` as a user runs it.

    python bench/clip_parity.py [--steps 10]

The demo GPT on the bundled corpus, fp32, SGD (lr 0.1), gradient_clipping 1.0 (active on every
step: the norm starts near 6), global batch 16, no scheduler. Each layout is one `trident train
--nproc N` run; the table gives the largest relative difference from the one-process run over
the steps, of the loss and of the gradient norm (metrics.csv). Clipping multiplies every update
by 1 / norm, so a norm that differs by x gives updates that differ by x; Adam would hide it.
Pipeline layouts are not reachable from `trident train` (its model is the plain GPT); their
norms are checked against one process by tests/parity/test_pp_equivalence.py and
test_3d_equivalence.py.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

LAYOUTS = [  # (row label, processes, config changes)
    ("dp=2, ZeRO stage 0", 2, {}),
    ("dp=2, ZeRO stage 1", 2, {"zero_optimization": {"stage": 1}}),
    ("dp=2, ZeRO stage 2", 2, {"zero_optimization": {"stage": 2}}),
    ("dp=2, ZeRO stage 3", 2, {"zero_optimization": {"stage": 3}}),
    ("dp=2, ZeRO stage 3, optimizer and parameters on CPU", 2,
     {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}}),
    ("tp=2", 2, {"tensor_parallel": {"size": 2}}),
]


def base_config(steps: int) -> dict:
    return {"train_batch_size": 16, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "gradient_clipping": 1.0, "zero_optimization": {"stage": 0}, "steps_per_print": 0, "seed": 1234,
            "model": {"type": "gpt", "preset": "demo", "dropout": 0.0}, "data": {"dataset": "kjv"},
            "trainer": {"train_steps": steps, "save_interval": 0}}


def train(root: Path, name: str, nproc: int, cfg: dict) -> list[dict[str, float]]:
    path = root / f"{name}.json"
    path.write_text(json.dumps(cfg))
    cmd = [sys.executable, "-m", "trident.cli.main", "train", "--nproc", str(nproc), "--config", str(path),
           "--run-dir", str(root), "--run-name", name]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
        raise SystemExit(f"{name}: trident train exited with {done.returncode}")
    with open(root / name / "metrics.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items() if v} for row in csv.DictReader(f)]


def worst(rows: list[dict], ref: list[dict], key: str) -> float:
    return max(abs(r[key] - e[key]) / abs(e[key]) for r, e in zip(rows, ref))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        ref = train(root, "serial", 1, base_config(args.steps))
        print(f"one process: loss {ref[0]['loss']:.6f} -> {ref[-1]['loss']:.6f}, grad norm "
              f"{ref[0]['grad_norm']:.6f} -> {ref[-1]['grad_norm']:.6f}, smallest {min(r['grad_norm'] for r in ref):.6f} "
              f"(clip 1.0: active on every step while it is above 1)")
        print(f"\n| layout | max rel loss diff vs one process | max rel grad-norm diff |\n| --- | --- | --- |")
        for k, (label, nproc, change) in enumerate(LAYOUTS):
            cfg = base_config(args.steps)
            cfg.update(change)
            rows = train(root, f"layout{k}", nproc, cfg)
            print(f"| {label} | {worst(rows, ref, 'loss'):.1e} | {worst(rows, ref, 'grad_norm'):.1e} |", flush=True)


if __name__ == "__main__":
    main()
