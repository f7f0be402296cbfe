"""Step time: compute, communication on the critical path, pipeline bubble; tokens/s and MFU.

Compute of one micro-batch on one pipeline stage is its matrix-multiply FLOPs at the GPU's
sustained GEMM rate plus its element-wise traffic (norms, activations, dropout, residual adds,
softmax) at the sustained HBM bandwidth. Training FLOPs are 3x forward (backward computes two
products per forward one: 6 x parameters x tokens for the dense part); full activation
checkpointing runs each layer's forward again in backward (4x), selective checkpointing only
the attention scores. MFU counts the 3x FLOPs only, HFU the recomputation too (Korthikanti et
al. 2022, section 6; Chowdhery et al. 2022, appendix B).

Per micro-batch the forward takes t_f and the backward t_b (tensor-parallel collectives and
pipeline sends included: they block the next kernel). A pipeline of p stages and m
micro-batches takes (m + p - 1)(t_f + t_b) with 1F1B or GPipe; interleaving v chunks per rank
divides the (p - 1) bubble by v; zero-bubble H1 leaves about a third of it (Qi et al. 2023).
Data-parallel collectives overlap the backward they follow when pp = 1 and wait for the
pipeline flush when pp > 1 (as Megatron-LM and DeepSpeed's pipeline engine schedule them).

Context parallelism over C ranks gives each rank s / C tokens of every sequence (their
attention still spans all s: the causal work is load-balanced by the zigzag layout), so compute
per rank is 1/C; the `cp` term is its attention traffic left on the critical path (Ulysses'
all-to-alls, ring sends longer than the block they overlap; `comm.context_parallel_traffic`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trident.planner.comm import Traffic, step_traffic
from trident.planner.layout import Layout, Workload, attention_kind, grad_accumulation, local_seq_len, stage_layers
from trident.planner.memory import StateBytes, rank_parameter_counts
from trident.planner.presets import Cluster, ModelSpec

HOST_BANDWIDTH_PER_GPU = 25e9
"""Host memory bandwidth a GPU's CPU optimizer share gets (a DDR4/DDR5 node of ~200-300 GB/s over 8 GPUs)."""
NVME_BANDWIDTH_PER_NODE = 20e9
"""Aggregate NVMe read or write bandwidth of a node (a few PCIe 4 drives)."""
OPTIMIZER_BYTES_PER_PARAM = 30
"""An Adam step reads weights, gradient, masters and two moments and writes four of them back."""


def training_flops_per_token(model: ModelSpec, seq_len: int, checkpointing: str = "none") -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) per token: 3x forward, plus recomputed forward work."""
    dense, scores, logits = model.forward_flops_per_token(seq_len)
    model_flops = 3 * (dense + scores + logits)
    extra = dense + scores if checkpointing == "full" else (scores if checkpointing == "selective" else 0.0)
    return model_flops, model_flops + extra


def elementwise_bytes_per_token(model: ModelSpec, seq_len: int, layout: Layout, workload: Workload) -> float:
    """HBM traffic of one layer's element-wise kernels in forward, per token, on one tp rank.

    Kept whole on every tp rank (unless sequence parallel): two norms (read + write e h each)
    and two bias-dropout-residual adds (read 2 e h, write e h, and a mask). Split over tp: the
    MLP activation (read and write e d_ff, gated: read 2, write 1) and, for eager attention,
    scale-mask-softmax and its dropout over the a x s scores of each token.
    """
    e, h, t = workload.activation_bytes, model.d_model, layout.tp
    whole = (4 * e + 6 * e + (2 if workload.dropout else 0)) * h
    split = (3 if model.gated_mlp else 2) * e * model.ff_dim
    if attention_kind(layout, workload) == "eager":
        split += (2 * e + ((2 * e + 1) if workload.dropout else 0)) * model.n_head * seq_len
    else:
        split += 4 * e * h  # the fused kernel reads q, k, v and writes its output once
    return whole / (t if layout.sequence_parallel else 1) + split / t


@dataclass(frozen=True)
class StageTime:
    """One micro-batch on the busiest stage: forward and backward seconds, and their parts."""

    forward: float
    backward: float
    compute: float
    tp_comm: float
    pp_comm: float
    cp_comm: float = 0.0


def _stage_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                traffic: list[Traffic], gas: int) -> StageTime:
    g = cluster.gpu
    tokens = layout.micro_batch * local_seq_len(layout, workload)  # cp: each rank's share of every sequence
    layers = stage_layers(model, layout.pp)
    dense, scores, logits = model.forward_flops_per_token(workload.seq_len)
    fwd_layer_flops = tokens * (dense + scores) / model.n_layer * layers / layout.tp
    fwd_flops = fwd_layer_flops + tokens * logits / layout.tp
    ew = tokens * layers * elementwise_bytes_per_token(model, workload.seq_len, layout, workload)
    gemm_rate, hbm_rate = g.peak_flops * g.gemm_efficiency, g.hbm_bandwidth * g.memory_efficiency
    fwd = fwd_flops / gemm_rate + ew / hbm_rate
    recompute = 0.0
    if layout.activation_checkpointing == "full":
        recompute = fwd_layer_flops / gemm_rate + ew / hbm_rate
    elif layout.activation_checkpointing == "selective":
        recompute = tokens * scores / model.n_layer * layers / layout.tp / gemm_rate
    bwd = 2 * fwd + recompute
    tp = sum(x.seconds for x in traffic if x.axis in ("tp", "ep")) / gas  # ep: MoE all-to-alls, also blocking
    pp = sum(x.seconds for x in traffic if x.axis == "pp") / gas
    cp_fwd, cp_bwd = (sum(x.exposed for x in traffic if x.axis == "cp" and x.phase == phase) / gas
                      for phase in ("forward", "backward"))
    share_fwd = 2 / (6 if layout.activation_checkpointing == "full" else 4)  # forward's share of tp collectives
    return StageTime(fwd + share_fwd * tp + pp / 2 + cp_fwd, bwd + (1 - share_fwd) * tp + pp / 2 + cp_bwd, fwd + bwd,
                     tp, pp, cp_fwd + cp_bwd)


def bubble_fraction_of_flush(layout: Layout) -> float:
    """Idle (p - 1) micro-batch slots of a flush, scaled by the schedule."""
    if layout.pp <= 1:
        return 0.0
    if layout.schedule == "interleaved_1f1b":
        return (layout.pp - 1) / layout.virtual_stages
    if layout.schedule == "zb_h1":
        return (layout.pp - 1) / 3
    return float(layout.pp - 1)


def _dp_exposed(traffic: list[Traffic], layout: Layout, stage: StageTime, gas: int) -> float:
    """Data-parallel seconds not hidden under compute: overlapped collectives hide under the
    boundary micro-batch's backward (stages 0-1), every backward (2), all compute (3)."""
    dp = [x for x in traffic if x.axis == "dp"]
    if layout.pp > 1:
        return sum(x.seconds for x in dp)
    hidden = sum(x.seconds for x in dp if x.overlapped)
    window = {3: gas * (stage.forward + stage.backward), 2: gas * stage.backward}.get(layout.zero_stage, stage.backward)
    return sum(x.seconds for x in dp if not x.overlapped) + max(0.0, hidden - window)


def _optimizer_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                    state: StateBytes) -> float:
    _, trainable = rank_parameter_counts(model, layout, workload)  # frozen parameters take no step
    psi = trainable / (layout.dp * layout.cp if layout.zero_stage >= 1 else 1)
    g = cluster.gpu
    if layout.offload_optimizer == "none":
        return psi * OPTIMIZER_BYTES_PER_PARAM / (g.hbm_bandwidth * g.memory_efficiency)
    transfer = psi * (state.gradient + state.parameter) / g.pcie_bandwidth
    host = psi * OPTIMIZER_BYTES_PER_PARAM / HOST_BANDWIDTH_PER_GPU
    if layout.offload_optimizer == "nvme":  # moments and masters are read and written back each step
        host += 2 * psi * state.k / (NVME_BANDWIDTH_PER_NODE / cluster.gpus_per_node)
    return transfer + host


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds per optimizer step by cause, and the throughput that follows."""

    compute: float
    tp_comm: float
    pp_comm: float
    dp_comm_exposed: float
    bubble: float
    optimizer: float
    step: float
    tokens_per_s: float
    tokens_per_s_per_gpu: float
    model_flops_per_gpu: float
    hardware_flops_per_gpu: float
    mfu: float
    hfu: float
    cp_comm: float = 0.0  # context parallelism's exposed attention traffic (ring sends not hidden, Ulysses)


def step_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster, state: StateBytes,
              traffic: list[Traffic] | None = None) -> TimeEstimate:
    """Predicted seconds per optimizer step of `layout` and the throughput it gives."""
    traffic = step_traffic(model, layout, workload, cluster, state) if traffic is None else traffic
    gas = grad_accumulation(layout, workload) or 1
    stage = _stage_time(model, layout, workload, cluster, traffic, gas)
    per_micro = stage.forward + stage.backward
    bubble = bubble_fraction_of_flush(layout) * per_micro
    dp = _dp_exposed(traffic, layout, stage, gas)
    opt = _optimizer_time(model, layout, workload, cluster, state)
    step = gas * per_micro + bubble + dp + opt
    tokens = workload.tokens_per_step()
    gpus = layout.world_size
    model_flops, hw_flops = training_flops_per_token(model, workload.seq_len, layout.activation_checkpointing)
    per_gpu = tokens / step / gpus
    peak = cluster.gpu.peak_flops
    return TimeEstimate(gas * stage.compute, gas * stage.tp_comm, gas * stage.pp_comm, dp, bubble, opt, step,
                        tokens / step, per_gpu, model_flops * per_gpu, hw_flops * per_gpu,
                        model_flops * per_gpu / peak, hw_flops * per_gpu / peak, gas * stage.cp_comm)


def training_flops(num_params: float, tokens: float) -> float:
    """The 6 x parameters x tokens rule (Kaplan et al. 2020): GPT-3's 175e9 x 300e9 is 3.15e23."""
    return 6 * num_params * tokens
