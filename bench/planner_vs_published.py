"""Predicted vs published throughput of large training runs: is the planner right at scale?

Every run below is a published measurement with its model, cluster and layout. The planner
predicts it from the GPU presets in trident/planner/presets.py, unchanged: the same
constants for every A100 run. What differs between runs is only what the papers report: the
model, the layout, the batch, and the cluster's network (Selene: 8 x 200 Gb/s HDR InfiniBand
per DGX A100, the preset; Jean Zay: 4 x 100 Gb/s Omni-Path per 8-GPU node).

Published figures are hardware TFLOP/s per GPU by Narayanan et al. 2021's formula
96 B s l h^2 (1 + s/6h + V/16lh), which counts the recomputed forward of full activation
checkpointing; the planner's `hardware_flops_per_gpu` counts the same FLOPs.

    python bench/planner_vs_published.py          # table, sources, and the known limits
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from trident.planner import Estimate, Layout, Workload, estimate, make_cluster, model_preset

NARAYANAN = "Narayanan et al. 2021, arXiv:2104.04473, Table 2"
MTNLG = "Smith et al. 2022, arXiv:2201.11990, section 2.4"
BLOOM = ("BigScience, arXiv:2211.05100 and bigscience-workshop/bigscience train/tr11-176B-ml "
         "(layout, batch; 'about 150 TFLOPs' in the model's training card)")
JEAN_ZAY = {"inter_node_bandwidth": 4 * 100e9 / 8 / 8}  # 4 x 100 Gb/s Omni-Path per 8 GPUs, bytes/s per GPU


@dataclass(frozen=True)
class Run:
    """A published measurement: what ran, where, and the TFLOP/s per GPU it reported."""

    name: str
    source: str
    model: str
    gpus: int
    layout: Layout
    workload: Workload
    published_tflops: float
    network: tuple = ()

    def predict(self) -> Estimate:
        cluster = make_cluster("a100-80gb", self.gpus, 8, **dict(self.network))
        return estimate(model_preset(self.model), self.layout, cluster, self.workload)


def _run(name: str, source: str, model: str, gpus: int, tp: int, pp: int, batch: int, tflops: float,
         stage: int = 0, micro: int = 1, precision: str = "fp16", network: tuple = ()) -> Run:
    layout = Layout(gpus // (tp * pp), tp, pp, stage, micro, "full")
    return Run(name, source, model, gpus, layout, Workload(2048, batch, precision, attention="eager", dropout=True),
               tflops, network)


RUNS = [
    *[_run("Megatron-LM GPT-3 175B", NARAYANAN, "gpt3-175b", n, 8, 12, 1536, tf)
      for n, tf in ((384, 153), (768, 149), (1536, 141))],
    *[_run("Megatron-LM 530B", NARAYANAN, "mt-nlg-530b", n, 8, 35, 2240, tf)
      for n, tf in ((560, 171), (1120, 167), (2240, 159))],
    _run("BLOOM-176B", BLOOM, "bloom-176b", 384, 4, 12, 2048, 150, stage=1, micro=2, precision="bf16",
         network=tuple(JEAN_ZAY.items())),
    *[_run("MT-NLG 530B", MTNLG, "mt-nlg-530b", n, 8, 35, 1920, tf, stage=1, precision="bf16")
      for n, tf in ((2240, 126), (2800, 121), (3360, 113))],
]

# Published runs the planner does not model: DeepSpeed ZeRO-3 without model parallelism in
# 2021 (same paper, same table). Its measured step time stays near 67 s from 768 to 1536 GPUs;
# the planner assumes NCCL-rate hierarchical all-gathers overlapped with compute.
LIMITS = [Run("ZeRO-3 175B (no model parallelism)", NARAYANAN, "gpt3-175b", n,
              Layout(n, 1, 1, 3, mb, "full"), Workload(2048, 1536, "fp16", attention="eager", dropout=True), tf)
          for n, mb, tf in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))]

HEAD = ["| run | GPUs | layout | published TFLOP/s/GPU | predicted | error | predicted tokens/s/GPU "
        "| bubble | tp comm |", "|---|---|---|---|---|---|---|---|---|"]


def row(run: Run) -> tuple[str, float]:
    est = run.predict()
    if not est.fits:
        raise AssertionError(f"{run.name} on {run.gpus} GPUs: the planner says it does not fit "
                             f"({est.memory.device_total / 2**30:.1f} GiB)")
    t = est.time
    predicted = t.hardware_flops_per_gpu / 1e12
    error = predicted / run.published_tflops - 1
    return (f"| {run.name} | {run.gpus} | {run.layout.describe()} | {run.published_tflops:g} | {predicted:.0f} | "
            f"{100 * error:+.0f}% | {t.tokens_per_s_per_gpu:.0f} | {100 * t.bubble / t.step:.0f}% | "
            f"{100 * t.tp_comm / t.step:.0f}% |"), error


def main() -> int:
    errors: dict[str, list[float]] = {}
    print("\n".join(HEAD))
    for run in RUNS:
        text, error = row(run)
        errors.setdefault(run.name, []).append(error)
        print(text)
    within = [name for name, errs in errors.items() if max(abs(e) for e in errs) <= 0.20]
    print(f"\nwithin 20% on every row: {len(within)} of {len(errors)} published runs ({', '.join(within)})")
    print("\noutside the model (see bench/PLANNER.md):\n" + "\n".join(HEAD))
    for run in LIMITS:
        print(row(run)[0])
    print("\nsources:")
    for name, source in dict.fromkeys((r.name, r.source) for r in RUNS + LIMITS):
        print(f"- {name}: {source}")
    return 0 if len(within) >= 3 else 1


if __name__ == "__main__":
    sys.exit(main())
