"""Predicted vs published throughput of large training runs: is the planner right at scale?

Every run below is a published measurement with its model, cluster and layout. The planner
predicts it from the GPU presets in trident/planner/presets.py, unchanged: the same
constants for every A100 run. What differs between runs is only what the papers report: the
model, the layout, the batch, and the cluster's network (Selene: 8 x 200 Gb/s HDR InfiniBand
per DGX A100, the preset; Jean Zay: 4 x 100 Gb/s Omni-Path per 8-GPU node).

Published figures are hardware TFLOP/s per GPU by Narayanan et al. 2021's formula
96 B s l h^2 (1 + s/6h + V/16lh), which counts the recomputed forward of full activation
checkpointing; the planner's `hardware_flops_per_gpu` counts the same FLOPs.

Runs whose paper gives no micro-batch size (Narayanan et al.'s Table 1 weak-scaling runs) get
the largest micro-batch that fits (`fit_micro_batch`), as the people who ran them chose one.
Throughput is compared as the paper reports it: hardware TFLOP/s per GPU, or tokens/s per GPU
(torchtitan).

    python bench/planner_vs_published.py          # table, sources, and the known limits
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

from trident.planner import Estimate, Layout, ModelSpec, Workload, estimate, make_cluster, model_preset
from trident.planner.search import fit_micro_batch

NARAYANAN = "Narayanan et al. 2021, arXiv:2104.04473, Table 2"
MTNLG = "Smith et al. 2022, arXiv:2201.11990, section 2.4"
BLOOM = ("BigScience, arXiv:2211.05100 and bigscience-workshop/bigscience train/tr11-176B-ml "
         "(layout, batch; 'about 150 TFLOPs' in the model's training card)")
WEAK_SCALING = "Narayanan et al. 2021, arXiv:2104.04473, Table 1 (weak scaling; no micro-batch given)"
OPT = ("Zhang et al. 2022, arXiv:2205.01068, section 2.4: 992 A100 80GB, FSDP with Megatron tensor "
       "parallelism (tp 8), 'up to 147 TFLOP/s per GPU'; 2M-token batches (992 x 2048)")
TORCHTITAN = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Tables 1 and 3: Llama 3.1 8B, "
              "FSDP, local batch 2, eager bf16 (no compile, no Float8); their 'selective' checkpointing recomputes "
              "every second layer whole (torchtitan's default selective_ac_option '2'), priced here as full "
              "checkpointing, which recomputes every layer: the prediction errs on the slow side")
JEAN_ZAY = {"inter_node_bandwidth": 4 * 100e9 / 8 / 8}  # 4 x 100 Gb/s Omni-Path per 8 GPUs, bytes/s per GPU
GRAND_TETON = {"memory_bytes": 96 * 2**30, "hbm_bandwidth": 2.4e12}  # torchtitan's H100 96GB HBM2e at 500 W


@dataclass(frozen=True)
class Run:
    """A published measurement: what ran, where, and the TFLOP/s (or tokens/s) per GPU it reported.

    `layout.micro_batch` 0 means the paper does not say: the largest that fits is used."""

    name: str
    source: str
    model: str | ModelSpec
    gpus: int
    layout: Layout
    workload: Workload
    published_tflops: float
    network: tuple = ()
    gpu: str = "a100-80gb"
    metric: str = "tflops"  # or "tokens" (tokens/s per GPU)

    def predict(self) -> Estimate:
        cluster = make_cluster(self.gpu, self.gpus, 8, **dict(self.network))
        spec = model_preset(self.model) if isinstance(self.model, str) else self.model
        if self.layout.micro_batch == 0:
            return fit_micro_batch(spec, replace(self.layout, micro_batch=1), cluster, self.workload)
        return estimate(spec, self.layout, cluster, self.workload)


def _run(name: str, source: str, model: str | ModelSpec, gpus: int, tp: int, pp: int, batch: int, tflops: float,
         stage: int = 0, micro: int = 1, precision: str = "fp16", network: tuple = ()) -> Run:
    layout = Layout(gpus // (tp * pp), tp, pp, stage, micro, "full")
    return Run(name, source, model, gpus, layout, Workload(2048, batch, precision, attention="eager", dropout=True),
               tflops, network)


def _weak(params: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
          tflops: float) -> Run:
    """A row of Narayanan et al.'s Table 1: vocabulary 51200, sequence 2048, no micro-batch given."""
    spec = ModelSpec(f"gpt-{params}", layers, hidden, heads, 51200, 2048)
    return _run(f"Megatron-LM weak scaling {params}", WEAK_SCALING, spec, gpus, tp, pp, batch, tflops, micro=0)


RUNS = [
    *[_run("Megatron-LM GPT-3 175B", NARAYANAN, "gpt3-175b", n, 8, 12, 1536, tf)
      for n, tf in ((384, 153), (768, 149), (1536, 141))],
    *[_run("Megatron-LM 530B", NARAYANAN, "mt-nlg-530b", n, 8, 35, 2240, tf)
      for n, tf in ((560, 171), (1120, 167), (2240, 159))],
    _run("BLOOM-176B", BLOOM, "bloom-176b", 384, 4, 12, 2048, 150, stage=1, micro=2, precision="bf16",
         network=tuple(JEAN_ZAY.items())),
    *[_run("MT-NLG 530B", MTNLG, "mt-nlg-530b", n, 8, 35, 1920, tf, stage=1, precision="bf16")
      for n, tf in ((2240, 126), (2800, 121), (3360, 113))],
    _weak("1.7B", 24, 2304, 24, 1, 1, 32, 512, 137),
    _weak("3.6B", 32, 3072, 30, 2, 1, 64, 512, 138),
    _weak("7.5B", 32, 4096, 36, 4, 1, 128, 512, 142),
    _weak("18.4B", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _weak("39.1B", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _weak("76.1B", 80, 10240, 60, 8, 4, 1024, 1792, 140),
    _weak("145.6B", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _weak("310.1B", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _weak("529.6B", 128, 20480, 105, 8, 35, 2520, 2520, 163),
    _weak("1T", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    Run("OPT-175B (FSDP = ZeRO-3, tp 8)", OPT, "opt-175b", 992, Layout(124, 8, 1, 3, 8, "full"),
        Workload(2048, 992, "fp16", attention="eager", dropout=True), 147),
]

# Published runs the planner does not model: DeepSpeed ZeRO-3 without model parallelism in
# 2021 (same paper, same table). Its measured step time stays near 67 s from 768 to 1536 GPUs.
# Per-module gathers (latency x calls, prefetch-bounded overlap) narrow the gap but the 768- and
# 1536-GPU rows remain far slower than any gather model explains.
# torchtitan's H100s are not the preset: 500 W, HBM2e, a peak "between SXM and NVL" that they
# do not know (their footnote 2); the SXM preset's 989 TFLOP/s predicts them ~40% fast.
LIMITS = [*[Run("ZeRO-3 175B (no model parallelism)", NARAYANAN, "gpt3-175b", n,
                Layout(n, 1, 1, 3, mb, "full"), Workload(2048, 1536, "fp16", attention="eager", dropout=True), tf)
            for n, mb, tf in ((384, 4, 144), (768, 2, 88), (1536, 1, 44))],
          *[Run("Llama 3.1 8B torchtitan FSDP (ZeRO-3)", TORCHTITAN, "llama3-8b", n, Layout(n, 1, 1, 3, 2, "full"),
                Workload(8192, 2 * n, "bf16"), tps, tuple(GRAND_TETON.items()), "h100-80gb", "tokens")
            for n, tps in ((8, 5762), (128, 5605))]]

HEAD = ["| run | GPUs | layout | published TFLOP/s (or tokens/s) per GPU | predicted | error | predicted tokens/s/GPU "
        "| bubble | tp comm |", "|---|---|---|---|---|---|---|---|---|"]


def row(run: Run) -> tuple[str, float]:
    est = run.predict()
    if not est.fits:
        raise AssertionError(f"{run.name} on {run.gpus} GPUs: the planner says it does not fit "
                             f"({est.memory.device_total / 2**30:.1f} GiB)")
    t = est.time
    predicted = t.hardware_flops_per_gpu / 1e12 if run.metric == "tflops" else t.tokens_per_s_per_gpu
    unit = "" if run.metric == "tflops" else " tok/s"
    error = predicted / run.published_tflops - 1
    return (f"| {run.name} | {run.gpus} | {est.layout.describe()} | {run.published_tflops:g}{unit} | {predicted:.0f} | "
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
    return 0 if len(within) >= len(errors) - 1 else 1


if __name__ == "__main__":
    sys.exit(main())
