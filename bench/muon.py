"""Muon against AdamW on the bundled corpus, and the cost of distributed Muon's gathers against
the planner.

    python bench/muon.py [--what loss,gathers] [--steps 60] [--docs 400] [--nproc 1] [--stage 0]
                         [--cluster FILE]

`loss`: both optimizers through `trident train` (the demo GPT, packed 128-token rows, fp32, the
same seed, data order and lr schedule); the loss after the same tokens. Muon's `adjust_lr:
match_rms_adamw` (Moonlight) scales each matrix's update to AdamW's RMS, so both runs use
AdamW's lr (1e-3) and weight decay (0.1); Muon's AdamW steps the embeddings and norms. Prints
the mean loss of the first and last five steps of each run; `--nproc 2 --stage 2` runs both
under ZeRO-2.

`gathers`: on 2 gloo ranks, ZeRO 1, 2 and 3 with Muon (trident.zero.muon: each unit's momenta
gathered to its owner, Newton-Schulz there, updates scattered back) on the planner check's GPT
(d_model 256, 4 layers). Per step, the median over the timed steps of each phase's host seconds
(`ShardedMuon.seconds`, the slower rank) and the bytes moved, against the planner's figures
(`trident.planner.comm.muon_traffic`, `trident.planner.muon.newton_schulz_seconds`) on a
cluster calibrated on the same ranks (`--cluster FILE` from `trident plan --calibrate`, else
measured first, about a minute).
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from token_loss import prepare_shards  # noqa: E402  (the same documents drawn from the corpus)

OPTIMIZERS = {
    "AdamW": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
    "Muon": {"type": "Muon", "params": {"lr": 1e-3, "weight_decay": 0.1, "adam_betas": [0.9, 0.95],
                                        "adjust_lr": "match_rms_adamw"}},
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


GATHER_STEPS = (2, 5)  # warm-up, timed


def measure_muon(stage: int) -> dict:
    """On every rank: median phase seconds of Muon's distributed step, and its bytes."""
    import statistics

    import torch

    import trident
    from trident.models.gpt import GPT, GPTConfig
    from trident.testing.distributed import cached_mesh
    from trident.tools.planner_check import MICRO, MODEL

    mesh = cached_mesh()
    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "steps_per_print": 0,
              "optimizer": OPTIMIZERS["Muon"], "zero_optimization": {"stage": stage}}
    engine, *_ = trident.initialize(model=GPT(GPTConfig(**MODEL)), config=config, mesh=mesh)
    g = torch.Generator().manual_seed(1 + mesh.dp_rank)
    data = torch.randint(0, MODEL["vocab_size"], (MICRO, MODEL["seq_len"] + 1), generator=g)
    phases = []
    warmup, timed = GATHER_STEPS
    for i in range(warmup + timed):
        engine.backward(engine(data[:, :-1], data[:, 1:]))
        engine.step()
        if i >= warmup:
            phases.append(dict(engine.strategy.muon.seconds))
    muon = engine.strategy.muon
    units = sum(len(pg.layout.units) for pg in muon.groups)
    return {"seconds": {k: statistics.median(p[k] for p in phases) for k in phases[0]},
            "bytes": muon.bytes_per_step, "units": units}


def predict_muon(stage: int, cal) -> dict:
    """The planner's Muon gathers, scatters and Newton-Schulz for the same run."""
    from trident.models.gpt import GPTConfig
    from trident.planner import Layout, Workload
    from trident.planner.cluster import calibrated_cluster
    from trident.planner.comm import muon_traffic
    from trident.planner.muon import newton_schulz_seconds
    from trident.planner.presets import model_from_gpt_config
    from trident.tools.planner_check import MICRO, MODEL

    model = model_from_gpt_config(GPTConfig(**MODEL))
    layout = Layout(dp=2, zero_stage=stage, micro_batch=MICRO)
    work = Workload(MODEL["seq_len"], 2 * MICRO, precision="fp32", optimizer="muon")
    cluster = calibrated_cluster(cal, 2)
    traffic = {t.op: t for t in muon_traffic(model, layout, work, cluster)}
    return {"gather": traffic["gather"].seconds, "scatter": traffic["scatter"].seconds,
            "newton_schulz": newton_schulz_seconds(model, layout, work, cluster),
            "units": traffic["gather"].calls,
            "bytes": sum(t.bytes_per_step * (2 - 1) / 2 for t in traffic.values())}


def gathers(cluster_file: str | None) -> None:
    from trident.planner.cluster import Calibration, load_calibration
    from trident.testing.distributed import run_on_ranks, shutdown_pool
    from trident.tools import planner_check

    try:
        cal = (load_calibration(cluster_file) if cluster_file
               else Calibration.from_json(run_on_ranks(2, planner_check.calibrate_on_rank, timeout=600)[0]))
        rows = [(stage, run_on_ranks(2, measure_muon, stage, timeout=600)) for stage in (1, 2, 3)]
    finally:
        shutdown_pool()
    phases = ("gather", "newton_schulz", "scatter")
    print("| ZeRO | units (planner) | MB moved / step (planner) | gather ms (planner) | Newton-Schulz ms (planner) "
          "| scatter ms (planner) | Muon's step ms (planner) | planner / measured |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for stage, measured in rows:
        p = predict_muon(stage, cal)
        slow = {k: 1e3 * max(m["seconds"][k] for m in measured) for k in phases}
        total = 1e3 * max(sum(m["seconds"].values()) for m in measured)
        predicted = 1e3 * sum(p[k] for k in phases)
        m = measured[0]
        print(f"| {stage} | {m['units']} ({p['units']}) | {m['bytes'] / 1e6:.2f} ({p['bytes'] / 1e6:.2f}) | "
              + " | ".join(f"{slow[k]:.2f} ({1e3 * p[k]:.2f})" for k in phases)
              + f" | {total:.1f} ({predicted:.1f}) | {predicted / total:.2f} |")
    print("\nMeasured: the slower rank's median host seconds per phase (a scatter waits for the slower owner's "
          "Newton-Schulz);\nplanner: trident.planner.comm.muon_traffic and trident.planner.muon.newton_schulz_seconds "
          f"on the calibration ({cal.describe()}).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--what", default="loss,gathers", help="comma-separated: loss, gathers")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--docs", type=int, default=400)
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--cluster", help="a cluster file from `trident plan --calibrate` (default: calibrate now)")
    args = parser.parse_args()
    what = set(args.what.split(","))
    if "gathers" in what:
        gathers(args.cluster)
    if "loss" not in what:
        return
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        prepare_shards(folder, args.docs)
        print(f"| optimizer | mean loss, steps 1-5 | mean loss, last 5 of {args.steps} |")
        print("| --- | ---: | ---: |")
        for name in OPTIMIZERS:
            losses = run(folder, name, args.steps, args.nproc, args.stage)
            print(f"| {name} | {sum(losses[:5]) / 5:.4f} | {sum(losses[-5:]) / 5:.4f} |")


if __name__ == "__main__":
    main()
