"""Activation checkpointing: peak activation memory per rank and step time, off vs every layer
vs every layer with partitioned + host-kept inputs, on the reference GPT at tp=2 (2 gloo ranks),
next to the planner's figures.

Each (mode, repeat) runs in fresh processes, modes in rotating order per repeat. Per rank:
- activation peak: the most bytes of operator-made tensors alive at once during one
  forward+backward (trident.testing.memory.LiveTensorBytes; model states excluded), and the
  bytes kept when backward starts;
- peak RSS of the process (includes the model states, libraries and allocator caches);
- median step time over the timed steps (forward, backward, AdamW step).
The planner's prediction (trident.planner.memory.activation_memory, Korthikanti et al.'s
per-layer terms, "none" vs "full" recompute) is printed next to the measured peak.

    python bench/activation_memory.py [--repeats 2] [--steps 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

from _common import peak_rss_bytes, rotated, run_ranks, start_rank, timed_steps, token_batches

MODEL = dict(vocab_size=4096, seq_len=256, n_layer=8, n_head=8, d_model=256, dropout=0.0, bias=False)
MICRO = 8
TP = 2
MODES = {
    "off": None,
    "every layer": {"layers": [r"blocks\.\d+"]},
    "every layer, partitioned + cpu": {"layers": [r"blocks\.\d+"], "partition_activations": True,
                                       "cpu_checkpointing": True},
}


def _worker(rank: int, port: int, mode: str, steps: int, out) -> None:
    start_rank(rank, TP, port)
    sys.stdout = open(os.devnull, "w")
    import trident
    from trident.models.gpt import GPT, GPTConfig
    from trident.testing.memory import LiveTensorBytes

    torch.manual_seed(0)
    config = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "tensor_parallel": {"size": TP}}
    if MODES[mode] is not None:
        config["activation_checkpointing"] = MODES[mode]
    engine, *_ = trident.initialize(model=GPT(GPTConfig(**MODEL)), config=config)

    def step(batch):
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()

    batches = token_batches(0, MODEL, MICRO)  # tp ranks share the batch
    median, _ = timed_steps(step, batches, 2, steps)
    states = {t.untyped_storage().data_ptr() for p in engine.module.parameters() for t in (p, p.grad)
              if t is not None}
    batch = next(batches)
    tracker = LiveTensorBytes(states)
    with tracker:
        loss = engine(batch[:, :-1], batch[:, 1:])
        kept = tracker.live
        engine.backward(loss)
    engine.step()
    out.put((rank, median, tracker.peak, kept, peak_rss_bytes()))
    dist.destroy_process_group()


def run_once(mode: str, steps: int) -> tuple[float, int, int, int]:
    results = run_ranks(_worker, TP, (mode, steps), f"mode {mode!r}")
    return (max(r[1] for r in results), max(r[2] for r in results), max(r[3] for r in results),
            max(r[4] for r in results))


def predicted(checkpointing: str) -> float:
    from trident.models.gpt import GPTConfig
    from trident.planner import Layout, Workload, model_from_gpt_config
    from trident.planner.memory import activation_memory
    spec = model_from_gpt_config(GPTConfig(**MODEL))
    return activation_memory(spec, Layout(micro_batch=MICRO, tp=TP, activation_checkpointing=checkpointing),
                             Workload(MODEL["seq_len"], MICRO, "fp32", attention="flash", dropout=False))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    runs: dict[str, list] = {m: [] for m in MODES}
    for repeat in range(args.repeats):
        for mode in rotated(list(MODES), repeat):
            runs[mode].append(run_once(mode, args.steps))
    mib = 2 ** 20
    base = {k: statistics.median(r[k] for r in runs["off"]) for k in range(4)}
    print(f"GPT {MODEL}, micro {MICRO}, fp32, tp={TP}; medians of {args.repeats} runs, per rank (largest rank)\n")
    print("| mode | activation peak | kept at backward | planner peak | peak RSS | step time | peak vs off |"
          " step vs off |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for mode, rows in runs.items():
        med = {k: statistics.median(r[k] for r in rows) for k in range(4)}
        plan = predicted("none" if mode == "off" else "full")
        plan_text = f"{plan / mib:.1f} MiB" if "partitioned" not in mode else "n/a"
        print(f"| {mode} | {med[1] / mib:.1f} MiB | {med[2] / mib:.1f} MiB | {plan_text} | {med[3] / mib:.0f} MiB | "
              f"{med[0] * 1e3:.0f} ms | {med[1] / base[1]:.2f} | {med[0] / base[0]:.2f} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
