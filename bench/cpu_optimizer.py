"""The CPU optimizer step (ZeRO-Offload's): trident's CPUAdam against torch.optim.AdamW's three
implementations and DeepSpeed's C++ CPU Adam, on 100M and 400M fp32 parameters.

Systems, all AdamW (decoupled weight decay 0.01, lr 1e-3): torch "for-loop" (foreach=False),
torch foreach, torch fused, trident.optim.CPUAdam, and deepspeed.ops.adam.DeepSpeedCPUAdam when
DeepSpeed imports and builds its op (run the script with .venv-bench/bin/python, see
bench/README.md). The parameters are one flat tensor (how ZeRO's master partition is laid out)
or 100 equal tensors. Every system steps the same parameters and gradients; the step after the
first (which allocates the state) is timed, `--steps` times, and repeats rotate the systems'
order. Medians; ratios against the fastest torch implementation.

    python bench/cpu_optimizer.py [--sizes 100 400] [--repeats 3] [--steps 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

SYSTEMS = ["torch for-loop", "torch foreach", "torch fused", "trident CPUAdam", "DeepSpeed CPUAdam"]


def _make(system: str, params: list[torch.Tensor]) -> torch.optim.Optimizer | None:
    kw = dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    if system == "torch for-loop":
        return torch.optim.AdamW(params, foreach=False, **kw)
    if system == "torch foreach":
        return torch.optim.AdamW(params, foreach=True, **kw)
    if system == "torch fused":
        return torch.optim.AdamW(params, fused=True, **kw)
    if system == "trident CPUAdam":
        from trident.optim import CPUAdam
        return CPUAdam(params, adamw_mode=True, **kw)
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam
    except ImportError:
        return None
    return DeepSpeedCPUAdam(params, adamw_mode=True, **kw)


def _time(system: str, params: list[torch.Tensor], init: list[torch.Tensor], steps: int) -> float | None:
    with torch.no_grad():
        for p, x in zip(params, init):
            p.copy_(x)
    opt = _make(system, params)
    if opt is None:
        return None
    opt.step()  # allocates the state
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - start)
    del opt
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 400], help="millions of parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"threads: {torch.get_num_threads()}, torch {torch.__version__}\n")
    print("| parameters | layout | system | step ms | vs fastest torch |\n| ---: | --- | --- | ---: | ---: |")
    for millions in args.sizes:
        n = millions * 1_000_000
        for layout, count in (("1 flat tensor", 1), ("100 tensors", 100)):
            g = torch.Generator().manual_seed(0)
            init = [torch.randn(n // count, generator=g) for _ in range(count)]
            params = [torch.nn.Parameter(x.clone()) for x in init]
            for p in params:
                p.grad = torch.randn(p.shape, generator=g) * 1e-2
            runs: dict[str, list[float]] = {s: [] for s in SYSTEMS}
            for repeat in range(args.repeats):
                order = SYSTEMS[repeat % len(SYSTEMS):] + SYSTEMS[:repeat % len(SYSTEMS)]
                for system in order:
                    t = _time(system, params, init, args.steps)
                    if t is not None:
                        runs[system].append(t)
            medians = {s: statistics.median(v) for s, v in runs.items() if v}
            best = min(v for s, v in medians.items() if s.startswith("torch"))
            for system in SYSTEMS:
                if system in medians:
                    print(f"| {millions}M | {layout} | {system} | {medians[system] * 1e3:.1f} | "
                          f"{medians[system] / best:.2f} |", flush=True)
                else:
                    print(f"| {millions}M | {layout} | {system} | not available | |", flush=True)
            del params, init
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
