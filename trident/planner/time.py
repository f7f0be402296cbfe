"""Step time: compute, communication on the critical path, pipeline bubble; tokens/s and MFU.

Compute of one micro-batch on one pipeline stage is its GEMMs, each at its own shape's rate
(`trident.planner.compute`: the GPU preset's published curve or the table `--calibrate`
measured here), its element-wise traffic (norms, activations, dropout, residual adds,
softmax) at the sustained memory bandwidth, and a fixed cost per kernel. Training FLOPs are 3x forward (backward computes two
products per forward one: 6 x parameters x tokens for the dense part); full activation
checkpointing runs each layer's forward again in backward (4x), selective checkpointing only
the attention scores, per-op checkpointing ("op") only the element-wise chain between the saved
matmul outputs (no FLOPs counted). MFU counts the 3x FLOPs only, HFU the recomputation too (Korthikanti et
al. 2022, section 6; Chowdhery et al. 2022, appendix B).

Per micro-batch the forward takes t_f and the backward t_b (tensor-parallel collectives and
pipeline sends included: they block the next kernel). A pipeline of p stages and m
micro-batches takes (m + p - 1)(t_f + t_b) with 1F1B or GPipe; interleaving v chunks per rank
divides the (p - 1) bubble by v; zero-bubble H1 leaves about a third of it (Qi et al. 2023).
Data-parallel collectives overlap the backward they follow when pp = 1 and wait for the
pipeline flush when pp > 1 (as Megatron-LM and DeepSpeed's pipeline engine schedule them).
ZeRO-3's gathers and reduce-scatters are played out module by module (`trident.planner.zero3`):
they hide only as far as prefetch depth, bucket sizes and the compute between them allow.

Context parallelism over C ranks gives each rank s / C tokens of every sequence (their
attention still spans all s: the causal work is load-balanced by the zigzag layout), so compute
per rank is 1/C; the `cp` term is its attention traffic left on the critical path (Ulysses'
all-to-alls, ring sends longer than the block they overlap; `comm.context_parallel_traffic`).
"""

from __future__ import annotations

from dataclasses import dataclass

from trident.planner.comm import Traffic, step_traffic
from trident.planner.kernels import gated_activation_bytes, norm_bytes, rotary_bytes
from trident.planner.compute import micro_batch_compute
from trident.planner.layout import Layout, Workload, attention_kind, grad_accumulation, local_seq_len, stage_layers
from trident.planner.memory import StateBytes, rank_parameter_counts
from trident.planner.muon import newton_schulz_seconds
from trident.planner.presets import Cluster, ModelSpec
from trident.planner.zero3 import zero3_schedule

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
    """HBM traffic of one layer's element-wise kernels in forward, per token, on one tp rank
    (`elementwise_bytes_fwd_bwd`'s forward)."""
    return elementwise_bytes_fwd_bwd(model, seq_len, layout, workload)[0]


def elementwise_bytes_fwd_bwd(model: ModelSpec, seq_len: int, layout: Layout,
                              workload: Workload) -> tuple[float, float]:
    """(forward, backward) HBM traffic of one layer's element-wise kernels per token on one tp rank,
    under `workload.kernels` (`trident.planner.kernels` counts each op's passes).

    Kept whole on every tp rank (unless sequence parallel): two norms and two
    bias-dropout-residual adds (read 2 e h, write e h, and a mask). Split over tp: the MLP
    activation over d_ff, rotary over q and k, and, for eager attention, scale-mask-softmax and
    its dropout over the a x s scores of each token (flash: q, k, v read and the output written once).
    """
    kern = workload.kernels
    e, h, t = workload.activation_bytes, model.d_model, layout.tp
    norm_f, norm_b = norm_bytes(kern, model.norm, e)
    residual = (6 * e + (2 if workload.dropout else 0)) * h
    whole_f, whole_b = 2 * norm_f * h + residual, 2 * norm_b * h + 2 * residual
    if model.gated_mlp:
        act_f, act_b = gated_activation_bytes(kern, e)
    else:
        act_f, act_b = 2 * e, 4 * e
    split_f, split_b = act_f * model.ff_dim, act_b * model.ff_dim
    if model.position == "rotary":
        rot_f, rot_b = rotary_bytes(kern, e)
        split_f, split_b = split_f + rot_f * (h + model.kv_dim), split_b + rot_b * (h + model.kv_dim)
    if attention_kind(layout, workload) == "eager":
        scores = (2 * e + ((2 * e + 1) if workload.dropout else 0)) * model.n_head * seq_len
    else:
        scores = 4 * e * h  # the fused kernel reads q, k, v and writes its output once
    split_f, split_b = split_f + scores, split_b + 2 * scores
    sp = t if layout.sequence_parallel else 1
    return whole_f / sp + split_f / t, whole_b / sp + split_b / t


@dataclass(frozen=True)
class StageTime:
    """One micro-batch on the busiest stage: forward and backward seconds, and their parts."""

    forward: float
    backward: float
    compute: float
    tp_comm: float
    pp_comm: float
    cp_comm: float = 0.0
    recompute: float = 0.0  # of backward: the recomputed forward


def _stage_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                traffic: list[Traffic], gas: int) -> StageTime:
    tokens = layout.micro_batch * local_seq_len(layout, workload)  # cp: each rank's share of every sequence
    ew_f, ew_b = (tokens * b for b in elementwise_bytes_fwd_bwd(model, workload.seq_len, layout, workload))
    mb = micro_batch_compute(model, layout, workload, cluster, ew_f, ew_b)
    fwd, bwd = mb.forward, mb.backward
    tp = sum(x.seconds for x in traffic if x.axis in ("tp", "ep")) / gas  # ep: MoE all-to-alls, also blocking
    pp = sum(x.seconds for x in traffic if x.axis == "pp") / gas
    cp_fwd, cp_bwd = (sum(x.exposed for x in traffic if x.axis == "cp" and x.phase == phase) / gas
                      for phase in ("forward", "backward"))
    share_fwd = 2 / (6 if layout.activation_checkpointing == "full" else 4)  # forward's share of tp collectives
    return StageTime(fwd + share_fwd * tp + pp / 2 + cp_fwd, bwd + (1 - share_fwd) * tp + pp / 2 + cp_bwd, fwd + bwd,
                     tp, pp, cp_fwd + cp_bwd, mb.recompute)


def bubble_fraction_of_flush(layout: Layout) -> float:
    """Idle (p - 1) micro-batch slots of a flush, scaled by the schedule."""
    if layout.pp <= 1:
        return 0.0
    if layout.schedule == "interleaved_1f1b":
        return (layout.pp - 1) / layout.virtual_stages
    if layout.schedule == "zb_h1":
        return (layout.pp - 1) / 3
    return float(layout.pp - 1)


def communication_overlaps_compute(cluster: Cluster) -> bool:
    """Whether collectives run beside compute. A GPU has engines of its own for them (NCCL
    kernels on a side stream, copy engines); gloo on a CPU moves and sums the bytes with the
    same cores that compute, so an "overlapped" reduction still takes its time from the step."""
    cal = cluster.calibration
    return cal is None or cal.device != "cpu"


def _dp_exposed(model: ModelSpec, traffic: list[Traffic], layout: Layout, workload: Workload, cluster: Cluster,
                state: StateBytes, stage: StageTime, gas: int, overlap: bool = True) -> tuple[float, float]:
    """(data-parallel seconds not hidden under compute, of which ZeRO-3 gathers). Overlapped
    reductions hide under the boundary micro-batch's backward (stages 0-1) or every backward
    (2); stage 3's gathers and reduce-scatters as `trident.planner.zero3` plays them out, module
    by module. Without `overlap` (CPU ranks) nothing hides."""
    dp = [x for x in traffic if x.axis == "dp"]
    if not overlap:
        return sum(x.seconds for x in dp), sum(x.seconds for x in dp if x.phase in ("forward", "backward"))
    if layout.pp > 1:
        return sum(x.seconds for x in dp), 0.0
    if layout.zero_stage >= 3 and dp:
        schedule = zero3_schedule(model, layout, workload, cluster, state, stage.forward, stage.backward,
                                  stage.recompute)
        return gas * schedule.exposed, gas * schedule.gathers_exposed
    hidden = sum(x.seconds for x in dp if x.overlapped)
    window = gas * stage.backward if layout.zero_stage >= 2 else stage.backward
    return sum(x.seconds for x in dp if not x.overlapped) + max(0.0, hidden - window), 0.0


def _optimizer_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                    state: StateBytes) -> float:
    _, trainable = rank_parameter_counts(model, layout, workload)  # frozen parameters take no step
    psi = trainable / (layout.dp * layout.cp if layout.zero_stage >= 1 else 1)
    g, cal = cluster.gpu, cluster.calibration
    if cal is not None:  # measured: an AdamW step per parameter and per tensor (ZeRO steps flat buffers)
        tensors = 1 if layout.zero_stage >= 1 else 12 * stage_layers(model, layout.pp) + 4
        step = psi * cal.optimizer_seconds_per_param + tensors * cal.optimizer_seconds_per_tensor
        if layout.offload_optimizer == "none":
            return step
        return step + psi * (state.gradient + state.parameter) / g.pcie_bandwidth
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
    zero3_gathers_exposed: float = 0.0  # part of dp_comm_exposed: stage 3's per-module gathers not hidden


def step_time(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster, state: StateBytes,
              traffic: list[Traffic] | None = None) -> TimeEstimate:
    """Predicted seconds per optimizer step of `layout` and the throughput it gives."""
    traffic = step_traffic(model, layout, workload, cluster, state) if traffic is None else traffic
    gas = grad_accumulation(layout, workload) or 1
    stage = _stage_time(model, layout, workload, cluster, traffic, gas)
    per_micro = stage.forward + stage.backward
    bubble = bubble_fraction_of_flush(layout) * per_micro
    dp, gathers = _dp_exposed(model, traffic, layout, workload, cluster, state, stage, gas,
                              communication_overlaps_compute(cluster))
    opt = _optimizer_time(model, layout, workload, cluster, state) + newton_schulz_seconds(model, layout, workload,
                                                                                           cluster)
    step = max(gas * per_micro + bubble + dp + opt, host_seconds(model, layout, gas, cluster))
    tokens = workload.tokens_per_step()
    gpus = layout.world_size
    model_flops, hw_flops = training_flops_per_token(model, workload.seq_len, layout.activation_checkpointing)
    per_gpu = tokens / step / gpus
    peak = cluster.gpu.peak_flops
    return TimeEstimate(gas * stage.compute, gas * stage.tp_comm, gas * stage.pp_comm, dp, bubble, opt, step,
                        tokens / step, per_gpu, model_flops * per_gpu, hw_flops * per_gpu,
                        model_flops * per_gpu / peak, hw_flops * per_gpu / peak, gas * stage.cp_comm, gathers)


HOST_OPS_PER_LAYER = 105
"""Operators one transformer layer dispatches in a micro-batch's forward and backward under
trident at stage 0, its gradient hooks included (`trident.monitor.step_cost` counts them: 105
for the reference GPT, against a plain loop's 117)."""
HOST_OPS_FIXED = 70
"""Embedding, head, loss, and the optimizer step (norm, clip, fused AdamW): per step."""
HOST_OPS_EXTRA_PER_LAYER = {"zero2": 12, "zero3": 34, "tp": 40}
"""More per layer and micro-batch: ZeRO-2/3's gradient staging (3's gathers too), tensor
parallelism's mappings and vocabulary-parallel loss (counted the same way)."""


def host_ops(model: ModelSpec, layout: Layout, gas: int) -> int:
    """Operators one optimizer step dispatches on the busiest rank."""
    per_layer = HOST_OPS_PER_LAYER
    if layout.zero_stage == 2:
        per_layer += HOST_OPS_EXTRA_PER_LAYER["zero2"]
    elif layout.zero_stage >= 3:
        per_layer += HOST_OPS_EXTRA_PER_LAYER["zero3"]
    if layout.tp > 1:
        per_layer += HOST_OPS_EXTRA_PER_LAYER["tp"]
    return gas * per_layer * stage_layers(model, layout.pp) + HOST_OPS_FIXED


def host_seconds(model: ModelSpec, layout: Layout, gas: int, cluster: Cluster) -> float:
    """The least a step takes on the host: its operators, each `GPUSpec.host_op_seconds`. The
    host runs ahead of the GPU (one sync a step), so a step costs max(device time, this)."""
    return host_ops(model, layout, gas) * cluster.gpu.host_op_seconds


def training_flops(num_params: float, tokens: float) -> float:
    """The 6 x parameters x tokens rule (Kaplan et al. 2020): GPT-3's 175e9 x 300e9 is 3.15e23."""
    return 6 * num_params * tokens
