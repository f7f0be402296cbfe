"""Predicted vs measured on this machine: step time and model-state memory of trident's own runs.

Calibrates this machine on 2 gloo ranks (or loads --cluster FILE), then runs the reference
GPT (trident/tools/planner_check.py: 4 layers, d_model 256, 64 tokens, micro-batch 8, fp32, AdamW)
in every layout of the planner's check -- DP, ZeRO 1-3, tp=2, pp=2 (1F1B), ZeRO-2 with the
optimizer on the host -- and prints, per layout, the planner's step time and the median of the
measured steps after warm-up, and predicted / measured model-state bytes, as ratios. The
calibration used is printed with them (and written with --save FILE).

    python bench/planner_vs_measured.py [--cluster FILE] [--save FILE] [--json]

Timing on a shared machine is noise-prone: run it on a quiet one for figures to quote.
"""

from __future__ import annotations

import argparse
import json
import sys


from trident.tools import planner_check as check
from trident.planner.cluster import Calibration, load_calibration, save_calibration
from trident.testing.distributed import run_on_ranks, shutdown_pool

BOUND = 0.20


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cluster", help="a cluster file from `trident plan --calibrate` (default: calibrate now)")
    parser.add_argument("--save", help="write the calibration used to this file")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        cal = (load_calibration(args.cluster) if args.cluster
               else Calibration.from_json(run_on_ranks(2, check.calibrate_on_rank, timeout=600)[0]))
        if args.save:
            save_calibration(cal, args.save)
        rows = [check.compare(c, cal, run_on_ranks(2, check.measure_layout, c, timeout=600)) for c in check.LAYOUTS]
    finally:
        shutdown_pool()
    if args.json:
        print(json.dumps({"calibration": cal.to_json(), "rows": rows}, indent=1))
    else:
        print(f"calibration: {cal.describe()}\n")
        print("| layout | predicted s | measured s (median) | time ratio | state bytes ratio |\n|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['layout']} | {r['predicted_s']:.3f} | {r['measured_s']:.3f} | {r['time_ratio']:.2f} | "
                  f"{r['memory_ratio']:.3f} |")
    within = sum(abs(r["time_ratio"] - 1) <= BOUND for r in rows)
    print(f"\nstep time within {100 * BOUND:.0f}% on {within} of {len(rows)} layouts", file=sys.stderr)
    return 0 if within == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
