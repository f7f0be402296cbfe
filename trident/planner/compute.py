"""Compute seconds of one micro-batch on one pipeline stage, GEMM by GEMM.

Each transformer layer is its GEMMs, each priced at its own shape on the device's curve
(`GPUSpec.gemm_curve()`: measured here, or the published curve of a GPU preset):

    qkv        [T, h] x [h, (h + 2 kv) / t]        attention out  [T, h / t] x [h / t, h]
    MLP in     [T, h] x [h, f / t] (x2 gated)      MLP out        [T, f / t] x [f / t, h]
    scores     b a / t batched [s', d] x [d, s]    values         b a / t batched [s', s] x [s, d]

with T = b s' tokens of the micro-batch on this rank (s' = s / cp), t the tensor-parallel size,
f the MLP width, a the heads and d the head width. Backward runs two GEMMs per forward one (the
input gradient [m, n] x [n, k] and the weight gradient [k, m] x [m, n]). The head adds the
logits GEMM [T, h] x [h, V / t]. Element-wise traffic (`time.elementwise_bytes_per_token`)
goes at the sustained memory bandwidth (backward: twice the forward's), and every layer pays
a fixed cost per kernel: `KERNELS_FORWARD` + `KERNELS_BACKWARD` kernels at
`GPUSpec.kernel_seconds` (launch latency on a GPU, an autograd op's dispatch on a CPU) -- what
makes small layers slower than their FLOPs say. The loss adds its memory-bound passes over the
[T, V / t] logits in fp32 (`LOSS_PASSES`): with a 50k vocabulary and a narrow model they cost
as much as several layers. With `Workload.fp8` the four dense GEMMs of a layer go at the GPU's FP8 peak
(`GPUSpec.fp8_gemm_curve()`), where it has FP8 units, and their operands' float8 casts are added at
the memory bandwidth (`fp8_cast_bytes`). A calibrated device prices fused attention
at the rate measured for its kernel (`GPUSpec.attention_rates`, by head width): on a CPU it
runs at about half the GEMM rate, and much slower still for narrow heads.
"""

from __future__ import annotations

from dataclasses import dataclass

from trident.planner.gemm import attention_rate, gemm_seconds
from trident.planner.kernels import KERNELS_PER_LAYER, flash_share, loss_bytes, rmsnorm_extra_kernels
from trident.planner.layout import Layout, Workload, attention_kind, local_seq_len, stage_layers
from trident.planner.presets import Cluster, ModelSpec

KERNELS_FORWARD, KERNELS_BACKWARD = KERNELS_PER_LAYER["fused"]
"""Kernels of one layer's forward besides its GEMMs: two norms, the activation, two residual
adds, head split/merge copies, softmax (or the fused attention), dropouts, bias adds."""
"""(KERNELS_BACKWARD: their backward kernels; most element-wise ops have one or two.)"""
KERNELS_HEAD = 8
"""Embedding lookup, final norm, loss (log-softmax, gather, mean) forward and backward."""
LOSS_PASSES = (4, 5)
"""fp32 passes over the [tokens, vocab / tp] logits the loss makes, forward and backward: the
log-softmax reads each row three times (its maximum, the sum of exponentials, the output) and
writes it once; backward, nll's dense gradient is written once, and the log-softmax's backward
reads it twice (its sum, the output) and the saved output once, and writes once. 16-bit logits
add the upcast (read e, write 4) and its backward copy (read 4, write e)."""


def loss_bytes_per_logit(activation_bytes: int) -> tuple[float, float]:
    """(forward, backward) HBM bytes the cross-entropy loss moves per logit (`LOSS_PASSES`)."""
    upcast = activation_bytes + 4 if activation_bytes < 4 else 0
    return 4 * LOSS_PASSES[0] + upcast, 4 * LOSS_PASSES[1] + upcast


@dataclass(frozen=True)
class MicroBatchCompute:
    """Seconds of one micro-batch on the busiest stage: forward, backward, recomputed forward."""

    forward: float
    backward: float
    recompute: float


def layer_gemms(model: ModelSpec, layout: Layout, workload: Workload) -> list[tuple[float, float, float, float]]:
    """One layer's forward GEMMs on one rank as (m, n, k, count)."""
    t, h = layout.tp, model.d_model
    s_local = local_seq_len(layout, workload)
    tokens = layout.micro_batch * s_local
    mlp_in = (2 if model.gated_mlp else 1) * model.ff_dim / t
    experts = model.moe_k if model.num_experts else 1
    heads = model.n_head / t
    d = h / model.n_head
    return [(tokens, (h + 2 * model.kv_dim) / t, h, 1), (tokens, h, h / t, 1),
            (tokens, mlp_in, h, experts), (tokens, h, model.ff_dim / t, experts),
            (s_local, workload.seq_len, d, layout.micro_batch * heads),
            (s_local, d, workload.seq_len, layout.micro_batch * heads)]


FP8_CAST_PASSES = (2, 1)
"""(reads, writes) of one dynamic float8 cast of an operand of e-byte elements: its amax pass reads
it, the scale-and-cast pass reads it again and writes the 1-byte float8 copy (torchao's casts;
inductor may fuse the amax into the kernel that produced the operand, so this errs slow)."""


def fp8_cast_bytes(model: ModelSpec, layout: Layout, workload: Workload) -> tuple[float, float]:
    """HBM bytes of one layer's float8 casts on one rank, (forward, backward).

    A linear layer y = x w^T ([m, k] x [k, n]) casts x and w for the forward GEMM, the output
    gradient [m, n] and w for the input gradient, and the output gradient and x again (scaled
    along the other dimension) for the weight gradient: torchao casts each GEMM's operands from
    the 16-bit tensors, six casts per layer. Each moves (2 e + 1) bytes per element."""
    reads, writes = FP8_CAST_PASSES
    per_element = reads * workload.activation_bytes + writes
    fwd = bwd = 0.0
    for m, n, k, count in layer_gemms(model, layout, workload)[:4]:
        fwd += count * (m * k + n * k) * per_element
        bwd += count * (2 * m * n + n * k + m * k) * per_element
    return fwd, bwd


def _fwd_bwd(curve, m: float, n: float, k: float, count: float, e: int) -> tuple[float, float]:
    fwd = gemm_seconds(curve, m, n, k, e, count)
    bwd = gemm_seconds(curve, m, k, n, e, count) + gemm_seconds(curve, k, n, m, e, count)
    return fwd, bwd


def micro_batch_compute(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                        elementwise_bytes: float, elementwise_backward: float | None = None) -> MicroBatchCompute:
    """Forward, backward and recompute seconds of one micro-batch on the busiest stage.

    `elementwise_bytes` is one layer's element-wise traffic for the micro-batch, forward;
    `elementwise_backward` its backward's (None: twice the forward's)."""
    g = cluster.gpu
    curve, e = g.gemm_curve(), workload.activation_bytes
    layers = stage_layers(model, layout.pp)
    fwd_layer = bwd_layer = 0.0
    flash = attention_kind(layout, workload) == "flash"
    gemms = layer_gemms(model, layout, workload)
    dense, attention = gemms[:4], gemms[4:]
    fp8_curve = g.fp8_gemm_curve() if workload.fp8 else None  # `fp8`: at the FP8 rate where there is one
    for m, n, k, count in dense:
        f, b = _fwd_bwd(fp8_curve or curve, m, n, k, count, e)
        fwd_layer, bwd_layer = fwd_layer + f, bwd_layer + b
    if fp8_curve is not None:
        cast_f, cast_b = fp8_cast_bytes(model, layout, workload)
        fwd_layer += cast_f / (g.hbm_bandwidth * g.memory_efficiency)
        bwd_layer += cast_b / (g.hbm_bandwidth * g.memory_efficiency)
    if flash and (g.attention_rates or g.hopper_attention):  # the fused kernel at its measured / published rate
        flops = sum(2.0 * m * n * k * count for m, n, k, count in attention)
        if g.attention_rates:
            rate = attention_rate(g.attention_rates, model.d_model / model.n_head)
        else:
            rate = flash_share(workload.kernels) * g.peak_flops
        fwd_layer, bwd_layer = fwd_layer + flops / rate, bwd_layer + 2 * flops / rate
    else:
        for m, n, k, count in attention:
            f, b = _fwd_bwd(curve, m, n, k, count, 0 if flash else e)  # flash keeps scores on chip
            fwd_layer, bwd_layer = fwd_layer + f, bwd_layer + b
    bandwidth = g.hbm_bandwidth * g.memory_efficiency
    ew_bwd = 2 * elementwise_bytes if elementwise_backward is None else elementwise_backward
    k_fwd, k_bwd = KERNELS_PER_LAYER[workload.kernels]
    k_fwd += rmsnorm_extra_kernels(workload.kernels, model.norm)
    fwd_layer += elementwise_bytes / bandwidth + k_fwd * g.kernel_seconds
    bwd_layer += ew_bwd / bandwidth + k_bwd * g.kernel_seconds
    tokens = layout.micro_batch * local_seq_len(layout, workload)
    head_f, head_b = _fwd_bwd(curve, tokens, model.vocab_size / layout.tp, model.d_model, 1, e)
    logits = tokens * model.vocab_size / layout.tp
    loss_f, loss_b = (logits * b / bandwidth
                      for b in loss_bytes(workload.kernels, e, loss_bytes_per_logit(e)))
    head_f, head_b = head_f + loss_f, head_b + loss_b
    head_k = KERNELS_HEAD * g.kernel_seconds
    forward, backward = layers * fwd_layer + head_f + head_k / 2, layers * bwd_layer + head_b + head_k / 2
    if layout.activation_checkpointing == "full":
        recompute = layers * fwd_layer
    elif layout.activation_checkpointing == "selective":
        scores = layer_gemms(model, layout, workload)[4:]
        recompute = layers * sum(gemm_seconds(curve, m, n, k, e, c) for m, n, k, c in scores)
    elif layout.activation_checkpointing == "op":  # no GEMM or attention again: the element-wise chain only
        recompute = layers * (elementwise_bytes / bandwidth + k_fwd * g.kernel_seconds)
    else:
        recompute = 0.0
    return MicroBatchCompute(forward, backward + recompute, recompute)
