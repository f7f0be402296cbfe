"""Muon against AdamW on the bundled corpus through `trident train`: the loss after the same tokens
(the demo GPT, packed 128-token rows, fp32, the same seed, data order and lr schedule).

    python bench/muon.py [--steps 60] [--docs 400] [--nproc 1] [--stage 0]

Muon's `adjust_lr: match_rms_adamw` (Moonlight) scales each matrix's update to AdamW's RMS, so
both runs use AdamW's lr (1e-3) and weight decay (0.1); Muon's AdamW steps the embeddings and
norms. Prints the mean loss of the first and last five steps of each run; `--nproc 2 --stage 2`
runs both under ZeRO-2 (Muon's matrices gathered to their owner ranks, trident.zero.muon).
Still to add (issue 36): the time of those gathers against the planner's figure.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from token_loss import write_documents  # noqa: E402  (the same documents drawn from the corpus)

OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "Muon": {"type": "Muon", "params": {"lr": 1e-3, "weight_decay": 0.1, "adam_betas": [0.9, 0.95]}},
}


def run(folder: Path, name: str, steps: int, nproc: int, stage: int) -> list[float]:
    config = {"train_micro_batch_size_per_gpu": 16 // nproc, "gradient_accumulation_steps": 1, "steps_per_print": 0,
              "optimizer": OPTIMIZERS[name], "gradient_clipping": 1.0, "seed": 1234,
              "zero_optimization": {"stage": stage},
              "model": {"type": "gpt", "preset": "demo", "dropout": 0.0},
              "data": {"paths": [str(folder / "shards")], "seq_len": 128, "packing": True},
              "trainer": {"train_steps": steps, "run_dir": str(folder / "runs"), "save_interval": 0, "log_interval": 1}}
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    subprocess.run([sys.executable, "-m", "trident.cli.main", "train", "--nproc", str(nproc), "--config", str(path),
                    "--run-name", name], check=True, capture_output=True)
    return [float(row["loss"]) for row in csv.DictReader((folder / "runs" / name / "metrics.csv").open())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--stage", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        docs = write_documents(folder, args.docs)
        tokenizer = resources.files("trident.data").joinpath("corpus/tokenizer.json")
        subprocess.run([sys.executable, "-m", "trident.cli.main", "data", "prepare", str(docs), "--key", "text",
                        "--tokenizer", str(tokenizer), "--out", str(folder / "shards"), "--append-eod"],
                       check=True, capture_output=True)
        print(f"| optimizer | mean loss, steps 1-5 | mean loss, last 5 of {args.steps} |")
        print("| --- | ---: | ---: |")
        for name in OPTIMIZERS:
            losses = run(folder, name, args.steps, args.nproc, args.stage)
            print(f"| {name} | {sum(losses[:5]) / 5:.4f} | {sum(losses[-5:]) / 5:.4f} |")


if __name__ == "__main__":
    main()
