"""Fine-tuning the reference GPT in full vs with LoRA adapters (r = 8, 64) under ZeRO-2 on 2 ranks.

Same model (the "demo" GPT with vocabulary 4096), same batches, fp32, AdamW (torch.optim's),
gloo on CPU, one thread per rank, ZeRO stage 2 with the bucket sizes of zero_vs_peers.py. LoRA
adapts qkv, attn.proj, mlp.fc and mlp.proj (trident's default `target_modules`), alpha = 2 r.
Every (system, repeat) runs in fresh spawned processes, so peak RSS is that run's own; the
systems are interleaved repeat by repeat in rotating order. Per system:

  step ms      the slowest rank's median step, median over repeats;
  peak RSS     the largest ru_maxrss of any rank (start-up included);
  model states after the timed steps, parameters + gradients + optimizer states per rank
               (trident: engine.memory_breakdown(); peft + DeepSpeed: the storages of its
               parameters, gradient partitions and inner optimizer, as zero_vs_peers.py counts
               them), next to the planner's theory (`trident.planner.model_state_bytes` with
               LoRA's trainable count): 4 bytes per parameter, frozen or not, plus, for the
               trainable ones only, 4 of gradient and 8 of AdamW moments, both split over dp.

peft + DeepSpeed ZeRO-2 (peft's `get_peft_model` on the same GPT and targets) runs only where
both import (the bench venv, see "DeepSpeed on CPU with gloo" in bench/README.md); otherwise
it is left out with a note.

    python bench/lora.py [--lora-r 8 64] [--repeats 3] [--steps 8]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

import torch
import torch.distributed as dist

from _common import build_gpt, peak_rss_bytes, rotated, run_ranks, start_rank, timed_steps, token_batches
from zero_vs_peers import ZERO_KEYS, deepspeed_model_states

MODEL = dict(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=256)  # GPT_PRESETS["demo"]
TARGETS = ["qkv", "proj", "fc"]
WORLD, MICRO, WARMUP, LR, STAGE = 2, 4, 3, 1e-4, 2
STATE_KEYS = ("parameters", "gradients", "optimizer_states")


def _lora_section(r: int) -> dict:
    return {"r": r, "alpha": 2.0 * r, "target_modules": TARGETS}


def _trident(model: torch.nn.Module, r: int | None):
    import trident
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}},
           "zero_optimization": {"stage": STAGE, **ZERO_KEYS}}
    if r is not None:
        cfg["lora"] = _lora_section(r)
    engine, *_ = trident.initialize(model=model, config=cfg)

    def step(batch: torch.Tensor) -> None:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()
    return step, engine.memory_breakdown


def _peft_deepspeed(model: torch.nn.Module, r: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from peft import LoraConfig, get_peft_model
    model = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, lora_dropout=0.0, target_modules=TARGETS))
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR, foreach=True)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "steps_per_print": 2**31 - 1, "zero_allow_untested_optimizer": True,
           "zero_optimization": {"stage": STAGE, **ZERO_KEYS}}
    engine, zero, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)

    def step(batch: torch.Tensor) -> None:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()

    return step, lambda: deepspeed_model_states(model, zero)


def _adapter_rank(system: str) -> int | None:
    """The LoRA rank in a system's name: 'trident full' -> None, 'trident lora r=8' -> 8."""
    return int(system.rsplit("r=", 1)[1]) if "r=" in system else None


def _worker(rank: int, port: int, system: str, steps: int, out) -> None:
    start_rank(rank, WORLD, port)
    sys.stdout = open(os.devnull, "w")  # keep the start-up tables out of the report
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    model = build_gpt(MODEL)
    if system.startswith("peft"):
        step, breakdown = _peft_deepspeed(model, _adapter_rank(system))
    else:
        step, breakdown = _trident(model, _adapter_rank(system))
    median, _ = timed_steps(step, token_batches(rank, MODEL, MICRO), WARMUP, steps)
    out.put((rank, median, peak_rss_bytes(), breakdown()))
    dist.destroy_process_group()


def theory(r: int | None) -> tuple[int, dict[str, float]]:
    """The planner's trainable count and model states per rank (fp32 AdamW, ZeRO-2 over WORLD):
    the whole model, or the frozen model plus LoRA adapters of rank r of which only they train."""
    from trident.models.gpt import GPTConfig
    from trident.planner import model_from_gpt_config, model_state_bytes, trident_state_bytes
    from trident.planner.memory import lora_parameters
    spec = model_from_gpt_config(GPTConfig(**MODEL))
    trainable = int(lora_parameters(spec, r)) if r else spec.num_parameters()
    total = spec.num_parameters() + (trainable if r else 0)
    state = trident_state_bytes(STAGE, "fp32", "adamw")
    return trainable, model_state_bytes(total, STAGE, WORLD, state, trainable).as_dict()


def _missing_peers() -> str | None:
    for module, why in (("deepspeed", "DeepSpeed"), ("peft", "peft")):
        if importlib.util.find_spec(module) is None:
            return f"{why} is not importable in this interpreter (run with the bench venv, .venv-bench/bin/python)"
    return None


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lora-r", type=int, nargs="+", default=[8, 64], help="LoRA ranks r to compare")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    systems = ["trident full"] + [f"trident lora r={r}" for r in args.lora_r]
    missing = _missing_peers()
    if missing is None:
        systems += [f"peft+deepspeed lora r={r}" for r in args.lora_r]
    n_params = sum(p.numel() for p in build_gpt(MODEL).parameters())
    print(f"GPT {MODEL} ({n_params / 1e6:.2f}M params), micro batch {MICRO} per rank, fp32, AdamW, ZeRO-{STAGE} "
          f"over {WORLD} gloo ranks, 1 thread/rank; {args.steps} timed steps after {WARMUP} warm-up, "
          f"{args.repeats} interleaved repeats", flush=True)
    if missing:
        print(f"peft + DeepSpeed left out: {missing}", flush=True)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks
    runs: dict[str, list[list]] = {s: [] for s in systems}
    for rep in range(args.repeats):
        for system in rotated(systems, rep):
            runs[system].append(run_ranks(_worker, WORLD, (system, args.steps), system))
        print(f"repeat {rep + 1}/{args.repeats} done", flush=True)
    rows = {}
    for system, reps in runs.items():
        step = statistics.median(max(r[1] for r in ranks) for ranks in reps)
        rss = statistics.median(max(r[2] for r in ranks) for ranks in reps)
        states = max((r[3] for ranks in reps for r in ranks), key=lambda m: sum(m[k] for k in STATE_KEYS))
        rows[system] = (step, rss, states)
    base_t, base_m, base_s = rows["trident full"][0], rows["trident full"][1], sum(rows["trident full"][2].values())
    print()
    print("| system | trainable | step ms | time / full | peak RSS / rank MiB | RSS / full | model states / rank MiB "
          "(params + grads + optim) | theory MiB | states / full |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for system, (step, rss, states) in rows.items():
        trainable, want = theory(_adapter_rank(system))
        total = sum(states[k] for k in STATE_KEYS)
        print(f"| {system} | {trainable:,} ({100 * trainable / n_params:.1f}%) | {step * 1000:.1f} | "
              f"{step / base_t:.3f} | {rss / 2**20:.1f} | {rss / base_m:.3f} | "
              f"{_mib(total)} ({' + '.join(_mib(states[k]) for k in STATE_KEYS)}) | "
              f"{_mib(sum(want.values()))} ({' + '.join(_mib(want[k]) for k in STATE_KEYS)}) | "
              f"{total / base_s:.3f} |")

if __name__ == "__main__":
    main()
