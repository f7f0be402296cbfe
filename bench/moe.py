"""Mixture of experts: trident's MoE GPT (8 experts, top-2) at ep=1 and ep=2 against the dense GPT
with the same active parameters, and against DeepSpeed-MoE on the same layer sizes.

All on 2 ranks, gloo on CPU, one thread per rank, fp32, torch's AdamW, the same token batches
(each rank its own). The MoE GPT's blocks hold 8 experts of d_ff = 2 d_model; a token visits 2,
so it passes through as many MLP weights as the dense GPT's d_ff = 4 d_model MLP. Systems:

  dense          the dense GPT, trident data parallelism (dp 2)
  trident-ep1    MoE GPT, every rank all 8 experts (dp 2)
  trident-ep2    MoE GPT, 4 experts per rank (ep 2); tokens move by all-to-all
  deepspeed-ep1  the same GPT with `deepspeed.moe.layer.MoE` blocks (ep_size 1), DeepSpeed's engine
  deepspeed-ep2  the same with ep_size 2

DeepSpeed gets the settings that match trident's routing (use_rts=False, no second-expert
sampling, capacity_factor 1, min_capacity 4, dropping on); it pads every expert's batch to the
capacity, trident sends only the kept rows. Every (system, repeat) runs in fresh processes, in
rotating order repeat by repeat, so machine noise hits them alike. Reported per system: the
median over repeats of the slowest rank's median step time, tokens/s over both ranks, the share
of the step spent inside all-to-all calls (torch.distributed.all_to_all_single timed on each rank,
the slowest rank's share), the largest peak RSS of a rank, and the expert bytes a rank holds.

    python bench/moe.py [--repeats 3] [--steps 10] [--systems dense trident-ep1 ...]

DeepSpeed runs only where it is importable (the bench venv, .venv-bench).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from _common import peak_rss_bytes, rotated, run_ranks, start_rank, timed_steps, token_batches

BASE = dict(vocab_size=4096, seq_len=128, n_layer=4, n_head=4, d_model=256, dropout=0.0)
EXPERTS, K, EXPERT_FF = 8, 2, 512
DENSE_FF = K * EXPERT_FF  # same active MLP weights per token
MICRO, WARMUP, LR = 4, 3, 1e-4
ROUTING = dict(capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=4, drop_tokens=True)
SYSTEMS = ("dense", "trident-ep1", "trident-ep2", "deepspeed-ep1", "deepspeed-ep2")


class AllToAllClock:
    """Seconds spent inside torch.distributed.all_to_all_single (both systems call it)."""

    def __init__(self) -> None:
        self.seconds, self._real = 0.0, dist.all_to_all_single

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return self._real(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start
        dist.all_to_all_single = timed


def _gpt(moe: bool, deepspeed_ep: int = 0):
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    if not moe:
        return GPT(GPTConfig(**BASE, d_ff=DENSE_FF))
    spec = dict(num_experts=EXPERTS, k=K, aux_loss_coef=1.0, **ROUTING)
    model = GPT(GPTConfig(**BASE, d_ff=EXPERT_FF, moe=spec))
    if deepspeed_ep:  # the same blocks with DeepSpeed's layer (which returns the same triple)
        from deepspeed.moe.layer import MoE as DeepSpeedMoE
        from trident.models.gpt import MLP
        for block in model.blocks:
            block.mlp = DeepSpeedMoE(BASE["d_model"], MLP(model.config), num_experts=EXPERTS, ep_size=deepspeed_ep,
                                     k=K, use_rts=False, top2_2nd_expert_sampling=False, **ROUTING)
    return model


def _trident(system: str):
    import trident
    ep = 2 if system == "trident-ep2" else 1
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "steps_per_print": 0,
           "optimizer": {"type": "AdamW", "params": {"lr": LR}}, "expert_parallel": {"size": ep}}
    engine, *_ = trident.initialize(model=_gpt(system != "dense"), config=cfg)
    return engine


def _deepspeed(system: str):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    deepspeed.init_distributed(dist_backend="gloo")
    model = _gpt(True, deepspeed_ep=int(system[-1]))
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                   "name": "parameters"})
    optimizer = torch.optim.AdamW(groups, lr=LR, foreach=True)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1,
           "steps_per_print": 2**31 - 1, "zero_optimization": {"stage": 0}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine


def _worker(rank: int, port: int, system: str, steps: int, out) -> None:
    start_rank(rank, 2, port)
    sys.stdout = open(os.devnull, "w")  # start-up tables stay out of the report
    if not system.startswith("deepspeed"):
        dist.init_process_group("gloo", rank=rank, world_size=2)
    clock = AllToAllClock()
    engine = (_deepspeed if system.startswith("deepspeed") else _trident)(system)
    module = getattr(engine, "module", engine)
    expert_bytes = sum(p.numel() * p.element_size() for n, p in module.named_parameters() if "expert" in n)

    def step(batch: torch.Tensor) -> None:
        engine.backward(engine(batch[:, :-1], batch[:, 1:]))
        engine.step()

    batches = token_batches(rank, BASE, MICRO)
    for _ in range(WARMUP):
        step(next(batches))
    clock.seconds = 0.0
    start = time.perf_counter()
    median, _ = timed_steps(step, batches, 0, steps)
    share = clock.seconds / (time.perf_counter() - start)
    out.put((rank, median, share, peak_rss_bytes(), expert_bytes))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    args = parser.parse_args(argv)
    systems = list(args.systems)
    if importlib.util.find_spec("deepspeed") is None:
        dropped = [s for s in systems if s.startswith("deepspeed")]
        systems = [s for s in systems if not s.startswith("deepspeed")]
        if dropped:
            print(f"skipping {', '.join(dropped)}: deepspeed is not importable here (run with .venv-bench)")
    runs: dict[str, list[tuple]] = {s: [] for s in systems}
    for repeat in range(args.repeats):
        for system in rotated(systems, repeat):
            ranks = run_ranks(_worker, 2, (system, args.steps), system)
            runs[system].append((max(r[1] for r in ranks), max(r[2] for r in ranks), max(r[3] for r in ranks),
                                 max(r[4] for r in ranks)))
    tokens = 2 * MICRO * BASE["seq_len"]
    print(f"\nMoE GPT: {BASE['n_layer']} blocks x {EXPERTS} experts (d_ff {EXPERT_FF}), top-{K}; dense GPT d_ff "
          f"{DENSE_FF}; d_model {BASE['d_model']}, seq {BASE['seq_len']}, micro {MICRO} per rank, 2 ranks, "
          f"fp32, {args.repeats} repeats x {args.steps} steps (medians)\n")
    head = f"{'system':<15}{'step ms':>9}{'tokens/s':>10}{'a2a share':>11}{'peak RSS MiB':>14}{'expert MiB/rank':>17}"
    print(head)
    summary = {}
    for system in systems:
        step = statistics.median(r[0] for r in runs[system])
        share = statistics.median(r[1] for r in runs[system])
        rss = statistics.median(r[2] for r in runs[system])
        experts = runs[system][0][3]
        summary[system] = step
        print(f"{system:<15}{1e3 * step:>9.1f}{tokens / step:>10.0f}{100 * share:>10.1f}%{rss / 2**20:>14.0f}"
              f"{experts / 2**20:>17.2f}")
    print()
    for a, b in (("trident-ep1", "dense"), ("trident-ep2", "dense"), ("trident-ep2", "trident-ep1"),
                 ("trident-ep1", "deepspeed-ep1"), ("trident-ep2", "deepspeed-ep2")):
        if a in summary and b in summary:
            print(f"step time {a} / {b}: {summary[a] / summary[b]:.2f}")


if __name__ == "__main__":
    main()
