"""The same packed global batch split three ways through `trident train`: per-step losses against
1 process x micro 16, with `data.loss_normalization` "tokens" and "micro_batch" (issue 37's
measurement, end to end: `trident data prepare` shards, packing, the demo GPT, AdamW, fp32).

    python bench/token_loss.py [--steps 8] [--docs 400]

Prints the worst relative loss difference of 2 ranks x micro 8 and 1 x micro 8 x accumulation 2
against 1 x micro 16, per normalization. Token weighting makes the split irrelevant (fp32
rounding, ~1e-6); the mean of micro-batch means does not (~1e-3).
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import random
import subprocess
import sys
import tempfile
from importlib import resources
from pathlib import Path

SPLITS = {"1 x 16": (1, 16, 1), "2 x 8": (2, 8, 1), "1 x 8 x 2": (1, 8, 2)}


def write_documents(folder: Path, count: int) -> Path:
    """`count` JSON-lines documents of 5-300 words drawn from the bundled corpus."""
    corpus = resources.files("trident.data").joinpath("corpus/kjv.txt.gz")
    words = gzip.decompress(corpus.read_bytes()).decode().split()
    rng = random.Random(0)
    path = folder / "docs.jsonl"
    with path.open("w") as f:
        for _ in range(count):
            n = rng.randint(5, 300)
            start = rng.randint(0, len(words) - n)
            f.write(json.dumps({"text": " ".join(words[start:start + n])}) + "\n")
    return path


def prepare_shards(folder: Path, count: int) -> Path:
    """`count` documents tokenized into shards under `folder / "shards"` by `trident data prepare`."""
    docs = write_documents(folder, count)
    tokenizer = resources.files("trident.data").joinpath("corpus/tokenizer.json")
    subprocess.run([sys.executable, "-m", "trident.cli.main", "data", "prepare", str(docs), "--key", "text",
                    "--tokenizer", str(tokenizer), "--out", str(folder / "shards"), "--append-eod"],
                   check=True, capture_output=True)
    return folder / "shards"


def run(folder: Path, split: tuple[int, int, int], mode: str, steps: int) -> list[float]:
    nproc, micro, gas = split
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
              "gradient_clipping": 1.0, "seed": 1234, "model": {"type": "gpt", "preset": "demo", "dropout": 0.0},
              "data": {"paths": [str(folder / "shards")], "seq_len": 128, "packing": True, "loss_normalization": mode},
              "trainer": {"train_steps": steps, "run_dir": str(folder / "runs"), "save_interval": 0, "log_interval": 1}}
    name = f"{nproc}-{micro}-{gas}-{mode}"
    path = folder / f"{name}.json"
    path.write_text(json.dumps(config))
    subprocess.run([sys.executable, "-m", "trident.cli.main", "train", "--nproc", str(nproc), "--config", str(path),
                    "--run-name", name], check=True, capture_output=True)
    return [float(row["loss"]) for row in csv.DictReader((folder / "runs" / name / "metrics.csv").open())]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--docs", type=int, default=400)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prepare_shards(folder, args.docs)
        print("| loss_normalization | split | worst relative loss difference to 1 x 16 |")
        print("| --- | --- | ---: |")
        for mode in ("tokens", "micro_batch"):
            losses = {name: run(folder, split, mode, args.steps) for name, split in SPLITS.items()}
            ref = losses["1 x 16"]
            for name in ("2 x 8", "1 x 8 x 2"):
                worst = max(abs(a - b) / abs(b) for a, b in zip(losses[name], ref))
                print(f"| {mode} | {name} | {worst:.1e} |")


if __name__ == "__main__":
    main()
