"""Issue 45: published H100 runs of 2024-2025, each within 20% of its tokens/s per GPU, priced
with the kernels and the hardware that run had.

torchtitan (pytorch/torchtitan, benchmarks/llama3_h100_202412_torchtitan.md, torch of
2024-12-23): Llama 3.1 8B, FSDP (ZeRO-3), local batch 2, sequence 8192, bf16, per-op selective
activation checkpointing (their "selective" with `selective_ac_option = "op"`, the 8B config's),
Tables 1 (8 GPUs) and 3 (128 GPUs): FSDP (eager), + torch.compile (of each block), + Float8
(torchao). Their H100s are Grand Teton's SXM with 96 GB HBM2e at 500 W (preset `h100-96gb-500w`,
its derate stated in `trident.planner.presets`); 400 Gb/s RDMA per GPU between hosts.
torchtitan's op policy also recomputes every second matmul; the planner's "op" saves them all,
so it errs fast here by that recomputation, and on memory it overstates (99.3 GiB predicted
against 82.4 on 8 GPUs, 85.3 against 67.0 on 128): memory is not held to the published here.

Megatron Bridge (NVIDIA-NeMo/Megatron-Bridge, docs/performance-summary.md, 25.11 container,
DGX-H100): Llama 3 8B, 8 GPUs, FP8 current scaling, GBS 128, MBS 1, sequence 8192, FSDP, no
model parallelism, GA 16: 14,451 tokens/s per GPU; Transformer Engine's fused kernels; its
table gives no checkpointing, so none.
"""

from __future__ import annotations

import pytest

from trident.planner import Layout, Workload, estimate, make_cluster, model_preset

LLAMA = model_preset("llama3-8b")

# (name, GPUs, GPU preset, micro-batch, global batch, checkpointing, kernels, fp8, tokens/s per GPU, GiB)
ROWS = [
    ("torchtitan FSDP", 8, "h100-96gb-500w", 2, 16, "op", "eager", False, 5762, 82.4),
    ("torchtitan FSDP + compile", 8, "h100-96gb-500w", 2, 16, "op", "compile", False, 6667, 77.0),
    ("torchtitan FSDP + compile + Float8", 8, "h100-96gb-500w", 2, 16, "op", "compile", True, 8532, 76.8),
    ("torchtitan FSDP", 128, "h100-96gb-500w", 2, 256, "op", "eager", False, 5605, 67.0),
    ("torchtitan FSDP + compile", 128, "h100-96gb-500w", 2, 256, "op", "compile", False, 6514, 62.0),
    ("torchtitan FSDP + compile + Float8", 128, "h100-96gb-500w", 2, 256, "op", "compile", True, 8380, 61.8),
    ("Megatron Bridge FP8-CS FSDP", 8, "h100-80gb", 1, 128, "none", "fused", True, 14451, None),
]


def _estimate(row):
    _, gpus, gpu, micro, batch, ckpt, kernels, fp8, _, _ = row
    return estimate(LLAMA, Layout(gpus, 1, 1, 3, micro, ckpt), make_cluster(gpu, gpus, 8),
                    Workload(8192, batch, "bf16", "adamw", kernels=kernels, fp8=fp8))


def table() -> list[tuple[str, int, float, float, float | None, float | None]]:
    """(name, GPUs, published, predicted tokens/s per GPU, published GiB, predicted GiB) of `ROWS`."""
    out = []
    for row in ROWS:
        est = _estimate(row)
        out.append((row[0], row[1], row[8], est.time.tokens_per_s_per_gpu, row[9],
                    est.memory.device_total / 2**30))
    return out


@pytest.mark.parametrize("row", ROWS, ids=[f"{r[0]} {r[1]}" for r in ROWS])
def test_row_within_20_percent(row):
    est = _estimate(row)
    ratio = est.time.tokens_per_s_per_gpu / row[8]
    assert 0.8 <= ratio <= 1.2, f"{row[0]} on {row[1]} GPUs: predicted / published {ratio:.2f}"


def test_the_kernels_order_the_rows_as_published():
    """Eager < compile < compile + Float8, on 8 and on 128 GPUs."""
    for gpus in (8, 128):
        tps = [_estimate(r).time.tokens_per_s_per_gpu for r in ROWS if r[1] == gpus and r[0].startswith("torchtitan")]
        assert tps == sorted(tps)

