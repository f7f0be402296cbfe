"""trident on one GPU against a plain PyTorch loop training the same GPT: step time, tokens/s, MFU,
peak memory, and the ops and host syncs a step dispatches (written to bench/results/gpu.md).

The plain loop is what a user writes without trident: `torch.autocast(bfloat16)`,
`torch.optim.AdamW(fused=True)`, `clip_grad_norm_(1.0, foreach=True)` (and `torch.compile(model)`
for the compiled row). trident runs the same model from the same seed with `bf16.enabled`,
AdamW, `gradient_clipping: 1.0`, at ZeRO stage 0, 1, 2, 3, ZeRO-2 with `offload_optimizer: cpu`,
and stage 0 with `compile.enabled`; `fp8` and `fp8-compile` are stage 0 and compile with the `fp8`
section added (torchao float8, tensorwise, the tied head kept in bf16). Each system builds its
model, takes WARMUP steps, then STEPS timed ones (CUDA events around each step; the median is
reported); the model is freed before the next system. MFU = tokens/s x (6 N + 12 L d T) / peak
bf16 FLOP/s, N counting the untied parameters once. Ratios are trident / plain in the same run on the same GPU.

Targets (issue 31): stage 0 >= 0.97x plain eager (MFU >= 45% at 1.3B), ZeRO-1/2 >= 0.95x,
ZeRO-3 >= 0.90x, compile >= 0.95x plain compile, offload >= 2x the 8.2k tokens/s of 2026-11-27.
It also prints the first 10 losses of offload beside stage 0's (bf16: they agree to ~1e-2).
`--fp8` (issue 36) runs only the 1.3B model as stage0, fp8, compile and fp8-compile and prints FP8's
tokens/s over bf16's, eager and compiled (H100 / H200: compute capability 8.9 or more).

    python bench/gpu.py [--models 124m,1.3b] [--systems ...] [--steps 10] [--out bench/results/gpu.md]
    python bench/gpu.py --fp8 [--out bench/results/gpu_fp8.md]

Needs CUDA (refuses without it); about 6 minutes on one H100 or H200 (bench/README.md, "On a GPU").
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

MODELS = {
    "124m": dict(shape=dict(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, d_model=768), micro=16),
    "1.3b": dict(shape=dict(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, d_model=2048), micro=8),
}
SYSTEMS = ("plain", "plain-compile", "stage0", "zero1", "zero2", "zero3", "offload", "compile")
FP8_SYSTEMS = ("stage0", "fp8", "compile", "fp8-compile")  # `--fp8`: each FP8 row beside its bf16 twin
FP8_BASE = {"fp8": "stage0", "fp8-compile": "compile"}
SLOW = {("1.3b", "plain-compile"), ("1.3b", "compile"), ("1.3b", "fp8-compile")}  # 1.3B compiles: left out by default
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}
WARMUP = 3
OFFLOAD_BEFORE = 8.2e3  # tokens/s of ZeRO-2 + offload on the 1.3B model, 2026-11-27 (H200)


def build(shape: dict, device: torch.device) -> torch.nn.Module:
    from trident.models.gpt import GPT, GPTConfig
    torch.manual_seed(0)
    return GPT(GPTConfig(**shape, dropout=0.0)).to(device)


def trident_config(system: str, micro: int) -> dict:
    stage = {"stage0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "offload": 2}.get(system, 0)
    zero = {"stage": stage}
    if system == "offload":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    config = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": 1, "steps_per_print": 0,
              "bf16": {"enabled": True}, "gradient_clipping": 1.0, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.1}}}
    if system in ("compile", "fp8-compile"):
        config["compile"] = {"enabled": True}
    if system in FP8_BASE:
        config["fp8"] = {"enabled": True, "recipe": "tensorwise", "filter": {"skip": ["lm_head"]}}
    return config


def make_step(system: str, shape: dict, micro: int, device: torch.device):
    """(step function taking (x, y) and returning the loss tensor, the engine or None)."""
    if system.startswith("plain"):
        model = build(shape, device)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
        run = torch.compile(model) if system == "plain-compile" else model

        def plain_step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = run(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss
        return plain_step, None
    import trident
    engine, *_ = trident.initialize(model=build(shape, "cpu"), config=trident_config(system, micro))

    def trident_step(x, y):
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        return loss
    return trident_step, engine


def measure(model_name: str, system: str, steps: int, device: torch.device) -> dict:
    spec = MODELS[model_name]
    shape, micro = spec["shape"], spec["micro"]
    g = torch.Generator(device="cpu").manual_seed(1)
    data = torch.randint(0, shape["vocab_size"], (WARMUP + steps, micro, shape["seq_len"] + 1), generator=g).to(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    step, engine = make_step(system, shape, micro, device)
    losses, times = [], []
    for i in range(WARMUP + steps):
        x, y = data[i, :, :-1], data[i, :, 1:]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        loss = step(x, y)
        end.record()
        end.synchronize()
        losses.append(float(loss))
        if i >= WARMUP:
            times.append(start.elapsed_time(end) / 1e3)
    cost = None
    if engine is not None or system == "plain":
        from trident.monitor.step_cost import StepCost
        with StepCost() as cost:
            step(data[0, :, :-1], data[0, :, 1:])
        torch.cuda.synchronize()
    seconds = statistics.median(times)
    tokens = micro * shape["seq_len"]
    result = dict(model=model_name, system=system, ms=seconds * 1e3, tokens_s=tokens / seconds,
                  mfu=tokens / seconds * flops_per_token(shape) / peak_flops(device),
                  peak_gib=torch.cuda.max_memory_allocated(device) / 2**30, losses=losses,
                  ops=cost.ops if cost else None, launches=cost.launches if cost else None,
                  syncs=cost.host_syncs if cost else None, predicted_ms=predicted_ms(model_name, system, device))
    if engine is not None:
        engine.destroy()
    del step, engine, data
    gc.collect()
    torch.cuda.empty_cache()
    return result


def predicted_ms(model_name: str, system: str, device: torch.device) -> float | None:
    """trident.planner's step time for a trident row (None for the plain ones or an unknown GPU)."""
    if system.startswith("plain") or system.endswith("compile"):
        return None
    from trident.tools.gpu_device import gpu_preset_name
    from trident.models.gpt import GPTConfig
    from trident.planner import Layout, Workload, estimate, make_cluster, model_from_gpt_config

    gpu = gpu_preset_name(torch.cuda.get_device_name(device), torch.cuda.get_device_properties(device).total_memory)
    if gpu is None:
        return None
    spec = MODELS[model_name]
    stage = {"stage0": 0, "zero1": 1, "zero2": 2, "zero3": 3, "offload": 2, "fp8": 0}[system]
    layout = Layout(dp=1, micro_batch=spec["micro"], zero_stage=stage,
                    offload_optimizer="cpu" if system == "offload" else "none")
    workload = Workload(seq_len=spec["shape"]["seq_len"], global_batch=spec["micro"], precision="bf16",
                        optimizer="adam", fp8=system == "fp8")
    shape = GPTConfig(**spec["shape"])
    return 1e3 * estimate(model_from_gpt_config(shape), layout, make_cluster(gpu, 1), workload).time.step


def flops_per_token(shape: dict) -> float:
    d, layers, t, v = shape["d_model"], shape["n_layer"], shape["seq_len"], shape["vocab_size"]
    n = layers * 12 * d * d + v * d  # blocks plus the (tied) embedding / head matrix
    return 6 * n + 12 * layers * d * t


def peak_flops(device: torch.device) -> float:
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in PEAK_BF16.items() if k in name), 989e12)


def ratio_row(r: dict, by: dict) -> str:
    base = {"plain": None, "plain-compile": None, "compile": "plain-compile", **FP8_BASE}.get(r["system"], "plain")
    ref = by.get((r["model"], base)) if base else None
    if r["system"] == "offload":
        return f"{r['tokens_s'] / OFFLOAD_BEFORE:.2f}x of 2026-11-27"
    return f"{ref['ms'] / r['ms']:.2f}x of {base}" if ref else ""


def report(results: list[dict], device: torch.device) -> str:
    by = {(r["model"], r["system"]): r for r in results}
    lines = [f"# trident on one GPU: {torch.cuda.get_device_name(device)}, torch {torch.__version__}",
             "", "`python bench/gpu.py` (median of the timed steps; ratios are speed, trident / plain, same run).", "",
             "| model | system | step ms | tokens/s | MFU | peak GiB | ops / launches / syncs a step | ratio "
             "| planner ms (measured / predicted) |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in results:
        counts = f"{r['ops']} / {r['launches']} / {r['syncs']}" if r["ops"] is not None else ""
        planned = f"{r['predicted_ms']:.1f} ({r['ms'] / r['predicted_ms']:.2f})" if r["predicted_ms"] else ""
        lines.append(f"| {r['model']} | {r['system']} | {r['ms']:.1f} | {r['tokens_s'] / 1e3:.1f}k | "
                     f"{100 * r['mfu']:.1f}% | {r['peak_gib']:.1f} | {counts} | {ratio_row(r, by)} | {planned} |")
    for model in dict.fromkeys(r["model"] for r in results):
        base, off = by.get((model, "stage0")), by.get((model, "offload"))
        if base and off:
            lines += ["", f"{model}: losses of the first {min(10, len(base['losses']))} steps, stage 0 vs offload:",
                      "", "| step | stage 0 | offload | rel. diff |", "| ---: | ---: | ---: | ---: |"]
            for i, (a, b) in enumerate(zip(base["losses"][:10], off["losses"][:10])):
                lines.append(f"| {i + 1} | {a:.4f} | {b:.4f} | {abs(a - b) / abs(a):.1e} |")
    lines += [f"\n{line}" for line in fp8_ratios(by)]
    return "\n".join(lines) + "\n"


def fp8_ratios(by: dict) -> list[str]:
    """FP8 over bf16 tokens/s for each model and mode measured both ways in this run."""
    out = []
    for (model, system), r in by.items():
        base = by.get((model, FP8_BASE.get(system)))
        if base:
            mode = "compiled" if system.endswith("compile") else "eager"
            out.append(f"{model} {mode}: fp8 {r['tokens_s'] / 1e3:.1f}k vs bf16 {base['tokens_s'] / 1e3:.1f}k "
                       f"tokens/s = {r['tokens_s'] / base['tokens_s']:.2f}x")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="124m,1.3b")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--with-slow", action="store_true", help="also compile the 1.3B model")
    parser.add_argument("--fp8", action="store_true",
                        help=f"FP8 against bf16 on the 1.3B model: systems {','.join(FP8_SYSTEMS)} (compiles it)")
    parser.add_argument("--out", default=None, help="markdown report (default bench/results/gpu.md, "
                        "with --fp8 bench/results/gpu_fp8.md)")
    args = parser.parse_args()
    if args.fp8:
        args.models, args.systems, args.with_slow = "1.3b", ",".join(FP8_SYSTEMS), True
    args.out = args.out or str(Path(__file__).parent / "results" / ("gpu_fp8.md" if args.fp8 else "gpu.md"))
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU (see bench/README.md, 'On a GPU')")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    results = []
    for model in args.models.split(","):
        for system in args.systems.split(","):
            if (model, system) in SLOW and not args.with_slow:
                continue
            t0 = time.perf_counter()
            results.append(measure(model, system, args.steps, device))
            r = results[-1]
            print(f"{model:>5} {system:>13}: {r['ms']:7.1f} ms  {r['tokens_s'] / 1e3:6.1f}k tok/s  "
                  f"MFU {100 * r['mfu']:4.1f}%  peak {r['peak_gib']:5.1f} GiB  ops {r['ops']}  "
                  f"syncs {r['syncs']}  ({time.perf_counter() - t0:.0f} s)", flush=True)
    for line in fp8_ratios({(r["model"], r["system"]): r for r in results}):
        print(line, flush=True)
    text = report(results, device)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
