"""Every trident strategy beside its peer, in one interleaved run: `make bench`.

Rows (trident / peer step time, targets from issue 24):
  data parallelism (ZeRO stage 0) vs DDP, on issue 24's 3.7M GPT and on the demo GPT;
  ZeRO-1 / 2 / 3 vs DDP and vs DeepSpeed, ZeRO-3 also vs FSDP2 (and vs DDP on the demo GPT);
  tensor parallelism (tp = 2) vs DTensor; pipeline parallelism (pp = 2, 1F1B, 4 micro-batches)
  vs torch.distributed.pipelining; ZeRO-2 with the optimizer offloaded to the CPU vs DeepSpeed's;
  the demo GPT with `compile: {enabled: true}` vs eager (bench/compile_vs_eager.py's `run`:
  demo.json's engine, so clipping and its LR schedule).
Every run is 2 gloo ranks x 1 thread in fresh processes (one process per rank, system and run),
fp32, AdamW (lr 1e-4) without clipping (but for the compile row), global batch 16. For each
repeat every system runs once, in an order rotated by one each repeat; a system's step time is
its slowest rank's median over the timed steps, and the table holds medians over repeats.
DeepSpeed rows need DeepSpeed in this interpreter (`make bench` runs the suite with the bench
venv's python); a row whose system cannot run says why.

    python bench/suite.py [--repeats 5] [--steps 6] [--warmup 3] [--only ROW-TEXT ...] [--quick] [--out DIR]

Writes suite.md, suite.json and suite.png (suite-quick.* with --quick) into --out (bench/results).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import shlex
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import suite_report
from _common import build_gpt, rotated
from suite_jobs import SHAPES, Job, reason, run_job
from suite_report import RowSpec

SYSTEMS: dict[str, Job] = {
    "ddp": Job("ddp"), "trident-0": Job("trident"),
    **{f"trident-{s}": Job("trident", stage=s) for s in (1, 2, 3)},
    **{f"deepspeed-{s}": Job("deepspeed", stage=s) for s in (1, 2, 3)},
    "fsdp2": Job("fsdp2", stage=3),
    "tp": Job("tp"), "dtensor": Job("dtensor"), "pp": Job("pp"), "torch-pp": Job("torch-pp"),
    "trident-2-offload": Job("trident", stage=2, offload=True),
    "deepspeed-2-offload": Job("deepspeed", stage=2, offload=True),
    "demo-ddp": Job("ddp", "demo"), "demo-trident-0": Job("trident", "demo"),
    "demo-trident-3": Job("trident", "demo", stage=3),
    "compiled": Job("compile", "demo", compile=True), "eager": Job("compile", "demo"),
}

ROWS = [
    RowSpec("DP (ZeRO stage 0), GPT 3.7M", "trident-0", "DDP", "ddp", 1.00),
    RowSpec("DP (ZeRO stage 0), demo GPT", "demo-trident-0", "DDP", "demo-ddp", 1.00),
    RowSpec("ZeRO-1", "trident-1", "DDP", "ddp", 1.05),
    RowSpec("ZeRO-1", "trident-1", "DeepSpeed ZeRO-1", "deepspeed-1", 1.00),
    RowSpec("ZeRO-2", "trident-2", "DDP", "ddp", 1.05),
    RowSpec("ZeRO-2", "trident-2", "DeepSpeed ZeRO-2", "deepspeed-2", 1.00),
    RowSpec("ZeRO-3", "trident-3", "DDP", "ddp", 1.10),
    RowSpec("ZeRO-3", "trident-3", "DeepSpeed ZeRO-3", "deepspeed-3", 1.00),
    RowSpec("ZeRO-3", "trident-3", "FSDP2", "fsdp2", 1.00),
    RowSpec("ZeRO-3, demo GPT", "demo-trident-3", "DDP", "demo-ddp", 1.10),
    RowSpec("TP (tp=2)", "tp", "DTensor tp=2", "dtensor", 1.00),
    RowSpec("PP (pp=2, 1F1B, 4 micro-batches)", "pp", "torch pipelining 1F1B", "torch-pp", 1.00),
    RowSpec("ZeRO-2 + CPU optimizer offload", "trident-2-offload", "DeepSpeed ZeRO-2 + CPU offload",
            "deepspeed-2-offload", 1.00),
    RowSpec("compile, demo GPT (demo.json, DP)", "compiled", "eager", "eager", 1 / 1.2, "<= 0.833 (>= 1.2x faster)"),
]


def unavailable() -> dict[str, str]:
    """Systems that cannot run in this interpreter, with the reason."""
    reasons: dict[str, str] = {}
    if importlib.util.find_spec("deepspeed") is None:
        why = (f"deepspeed is not importable by {sys.executable}; `make bench` runs the suite with "
               f".venv-bench/bin/python (bench/README.md, 'DeepSpeed on CPU with gloo')")
        reasons |= {name: why for name, job in SYSTEMS.items() if job.kind == "deepspeed"}
    if not hasattr(importlib.import_module("torch.distributed.fsdp"), "fully_shard"):
        reasons["fsdp2"] = f"torch {torch.__version__} has no torch.distributed.fsdp.fully_shard"
    try:
        from trident.config.loader import load_config
        load_config({"train_micro_batch_size_per_gpu": 8, "compile": {"enabled": True}})
    except Exception as e:  # the config refuses the section: no compiled row yet
        reasons["compiled"] = f"trident's config refuses compile.enabled: {reason(e)}"
    if importlib.util.find_spec("compile_vs_eager") is None:
        reasons |= dict.fromkeys(("compiled", "eager"), "bench/compile_vs_eager.py (its `run`) is missing")
    return reasons


def selected(only: list[str] | None) -> tuple[list[RowSpec], list[str]]:
    """The rows whose text contains any of `only` (all rows without it), and the systems they need."""
    rows = [r for r in ROWS if not only or any(o.lower() in f"{r.strategy} {r.peer_label}".lower() for o in only)]
    if not rows:
        raise SystemExit(f"--only {only} matches no row; rows: {[f'{r.strategy} vs {r.peer_label}' for r in ROWS]}")
    names = list(dict.fromkeys(n for r in rows for n in (r.ours, r.peer)))
    return rows, names


def run(names: list[str], failures: dict[str, str], repeats: int, warmup: int, steps: int) -> dict[str, list[float]]:
    """Every repeat runs every system once, in rotated order; a system that fails is not run again."""
    samples: dict[str, list[float]] = {n: [] for n in names}
    log_dir, failed_before = tempfile.mkdtemp(prefix="bench-suite-"), len(failures)
    start = time.monotonic()
    for r in range(repeats):
        for name in rotated(names, r):
            if name in failures:
                continue
            result = run_job(SYSTEMS[name], warmup, steps, log_dir, f"{name}-r{r}")
            if isinstance(result, str):
                failures[name] = result
            else:
                samples[name].append(result)
            said = f"failed: {result}" if isinstance(result, str) else f"{1e3 * result:.1f} ms"
            print(f"[{time.monotonic() - start:5.0f} s] repeat {r + 1}/{repeats} {name}: {said}", flush=True)
    if len(failures) == failed_before:  # keep the rank logs only when a failure names them
        shutil.rmtree(log_dir, ignore_errors=True)
    return samples


def heading(args, elapsed: float, loads: tuple) -> str:
    ds_version = importlib.metadata.version("deepspeed") if importlib.util.find_spec("deepspeed") else "not installed"
    sizes = {k: sum(p.numel() for p in build_gpt(v).parameters()) / 1e6 for k, v in SHAPES.items()}
    quick = " **Quick smoke run: 2 repeats of 2 steps, the figures are not a measurement.**" if args.quick else ""
    return (f"`{' '.join(shlex.quote(a) for a in sys.argv)}` on {os.cpu_count()} cores, "
            f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {elapsed / 60:.1f} min, load average "
            f"{loads[0]:.1f} before / {loads[1]:.1f} after; torch {torch.__version__}, DeepSpeed {ds_version}. "
            f"GPT 3.7M: {SHAPES['gpt-3.7m']} ({sizes['gpt-3.7m']:.2f}M parameters); demo GPT: {SHAPES['demo']} "
            f"({sizes['demo']:.2f}M). 2 gloo ranks x 1 thread, fresh processes per system and run, fp32, AdamW "
            f"without clipping (compile row: demo.json's engine), global batch 16; {args.repeats} interleaved "
            f"repeats in rotating order, {args.warmup} warm-up + {args.steps} timed steps per run; step time = "
            f"the slowest rank's median, then the median over repeats.{quick}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per run before the timed ones")
    parser.add_argument("--only", nargs="+", help="rows whose 'strategy peer' text contains any of these")
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 repeats of 2 steps after 1 warm-up")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = parser.parse_args(argv)
    if args.quick:
        args.repeats, args.steps, args.warmup = 2, 2, 1
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the ranks: one compute thread each
    rows_spec, names = selected(args.only)
    failures = {n: why for n, why in unavailable().items() if n in names}
    for name, why in failures.items():
        print(f"{name}: not available: {why}", flush=True)
    loads, start = os.getloadavg()[0], time.monotonic()
    samples = run(names, failures, args.repeats, args.warmup, args.steps)
    elapsed = time.monotonic() - start
    rows = suite_report.summarize(rows_spec, samples, failures)
    text = heading(args, elapsed, (loads, os.getloadavg()[0]))
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / ("suite-quick" if args.quick else "suite")
    table = suite_report.markdown(rows, text)
    bound = None
    if "compiled" in names and "compiled" not in failures:
        import compile_vs_eager
        bound = compile_vs_eager.gemm_bound()
        table += (f"\nCompile's ceiling here: GEMMs are {bound['gemm_share']:.0%} of an eager demo-GPT step "
                  f"(torch.profiler self time, {bound['gemm_gflops']:.0f} GFLOP/s on one thread); inductor calls the same "
                  f"GEMM kernels, so compiling everything else away would give at most {bound['bound']:.2f}x "
                  f"(`bench/compile_vs_eager.py`'s `gemm_bound`).\n")
    stem.with_suffix(".md").write_text(table)
    meta = {"command": sys.argv, "repeats": args.repeats, "warmup": args.warmup, "steps": args.steps,
            "elapsed_s": round(elapsed, 1), "quick": args.quick, "compile_bound": bound, "systems": {n: repr(SYSTEMS[n]) for n in names}}
    suite_report.write_json(stem.with_suffix(".json"), rows, meta, samples, failures)
    suite_report.plot(rows, stem.with_suffix(".png"), "trident / peer step time (2 ranks, gloo, CPU)")
    print("\n" + table + f"\nwrote {stem}.md, .json, .png ({elapsed / 60:.1f} min)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
