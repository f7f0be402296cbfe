"""Communication: alpha-beta times of collectives, and the bytes each parallel axis moves per step.

A message of S bytes between two ranks costs alpha + S / beta (latency, bandwidth). Over a
group of n ranks (Thakur et al. 2005; Chan et al. 2007; NCCL's ring and tree algorithms):

    ring reduce-scatter / all-gather   (n-1) alpha + (n-1)/n  S / beta
    ring all-reduce                    2 (n-1) alpha + 2 (n-1)/n  S / beta
    tree all-reduce (double binary)    2 log2(n) alpha + 2 S / beta   (pipelined chunks)

S is the full buffer (all-gather: the gathered size). A group that spans m nodes with k ranks
in each runs hierarchically: reduce-scatter inside the node over NVLink, the k shards of S/k
each reduced over the network in parallel (every GPU has its own share of the node's adapters),
then all-gather inside the node. `LINK_EFFICIENCY` is the share of a link's rate that NCCL's
bus bandwidth reaches on large messages.

ZeRO-3's per-module gathers and gradient reduce-scatters are flat instead
(`flat_collective_time`): one collective over the whole dp group per module (DeepSpeed's stage
3, FSDP), no NVLink stage in front of the network (ZeRO++'s hpZ, Wang et al. 2023, exists to add
one). Every rank of a node runs the same gather at the same moment, so each rank's
(n-1)/n S crosses the network at its own share of the node's adapters, and the ring's n - 1
steps pay NVLink's latency inside nodes and the network's between them. This is what makes
ZeRO-3 without model parallelism collapse at a fixed global batch (Narayanan et al. 2021,
Table 2): each GPU moves all the parameters three or four times a step whatever the GPU count,
while its share of the batch, the compute that hides it, halves each time the GPUs double.

Ranks are ordered (pp, dp, cp, ep, tp), tp fastest, so a tp group is consecutive ranks, a dp
group strides by tp and a pp neighbour is tp * dp ranks away (times cp and ep when they are > 1).
Context parallelism adds its attention traffic (`context_parallel_traffic`) and joins the
gradient reduction: the "dp" group is dp x cp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trident.moe.dispatch import moe_all_to_all_bytes
from trident.planner.compression import gradient_bytes, parameter_gather_bytes
from trident.planner.layout import Layout, Workload, cp_groups, grad_accumulation, local_seq_len, stage_layers
from trident.planner.memory import StateBytes, cp_kv_dim, rank_parameter_counts
from trident.planner.muon import gather_units, matrices_per_stage
from trident.planner.presets import Cluster, ModelSpec
from trident.planner.zero3_modules import (FP8_GATHERED, zero3_kept_for_backward, zero3_layer_modules,
                                           zero3_module_elements, zero3_named_module_elements, zero3_outer_modules)

LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s, per rank, per direction
    latency: float    # seconds per message


def ring_reduce_scatter(size: float, n: int, link: Link) -> float:
    """Also the all-gather time: S is the full (gathered) buffer."""
    return 0.0 if n <= 1 else (n - 1) * link.latency + (n - 1) / n * size / link.bandwidth


def ring_all_reduce(size: float, n: int, link: Link) -> float:
    return 2 * ring_reduce_scatter(size, n, link)


def tree_all_reduce(size: float, n: int, link: Link) -> float:
    return 0.0 if n <= 1 else 2 * math.ceil(math.log2(n)) * link.latency + 2 * size / link.bandwidth


def all_reduce(size: float, n: int, link: Link) -> float:
    """The faster of ring and tree, as NCCL picks: tree wins on small messages over many ranks."""
    return min(ring_all_reduce(size, n, link), tree_all_reduce(size, n, link))


@dataclass(frozen=True)
class GroupSpan:
    """A process group laid over nodes: `per_node` ranks in each of `nodes` nodes."""

    size: int
    per_node: int
    nodes: int


def group_span(axis: str, layout: Layout, gpus_per_node: int) -> GroupSpan:
    """How the tp, ep, cp, dp or pp group of rank 0 sits on nodes of `gpus_per_node` GPUs.

    Mesh order (pp, dp, cp, ep, tp): a cp group strides by tp x ep; "dp" is the gradient
    reduction group, dp x cp (cp ranks hold the same weights), cp inside it."""
    inner = layout.tp * layout.ep
    stride = {"tp": 1, "ep": layout.tp, "cp": inner, "dp": inner, "pp": inner * layout.cp * layout.dp}[axis]
    size = {"tp": layout.tp, "ep": layout.ep, "cp": layout.cp, "dp": layout.dp * layout.cp, "pp": layout.pp}[axis]
    return _span(size, stride, gpus_per_node)


def _span(size: int, stride: int, gpus_per_node: int) -> GroupSpan:
    per_node = max(1, min(size, gpus_per_node // stride)) if stride <= gpus_per_node else 1
    return GroupSpan(size, per_node, -(-size // per_node))


def _links(cluster: Cluster) -> tuple[Link, Link]:
    g = cluster.gpu
    return (Link(g.intra_node_bandwidth * LINK_EFFICIENCY, g.intra_node_latency),
            Link(g.inter_node_bandwidth * LINK_EFFICIENCY, g.inter_node_latency))


def collective_time(op: str, size: float, span: GroupSpan, cluster: Cluster, in_step: bool = False) -> float:
    """Seconds for one `op` ("all_reduce", "reduce_scatter", "all_gather") of `size` bytes.
    `in_step`: issued alone after compute (ZeRO-1/2's once-a-step collectives), which a CPU
    calibration times apart from back-to-back calls (`<op>.in_step`)."""
    intra, inter = _links(cluster)
    if span.size <= 1:
        return 0.0
    fit = (_measured(cluster, f"{op}.in_step") if in_step else None) or _measured(cluster, op)
    if fit is not None:
        return fit.seconds(op, size, span.size)
    if span.nodes == 1:
        return all_reduce(size, span.size, intra) if op == "all_reduce" else ring_reduce_scatter(size, span.size, intra)
    k, m = span.per_node, span.nodes
    if op == "all_reduce":
        return 2 * ring_reduce_scatter(size, k, intra) + all_reduce(size / k, m, inter)
    return ring_reduce_scatter(size, k, intra) + ring_reduce_scatter(size / k, m, inter)


def _measured(cluster: Cluster, op: str):
    """The calibrated alpha-beta fit of `op` when the cluster was measured (`--cluster`)."""
    cal = cluster.calibration
    return cal.collective(op) if cal is not None else None


def flat_collective_time(op: str, size: float, span: GroupSpan, cluster: Cluster) -> float:
    """One flat ring all-gather or reduce-scatter of `size` bytes over `span` (ZeRO-3's
    per-module collectives): inside one node the NVLink ring; across nodes the ring's slowest
    link, each rank's share of the node's network adapters, carries its (n-1)/n S, and of the
    n - 1 steps, n - m cross NVLink and m - 1 the network. A calibrated cluster uses its fit."""
    if span.size <= 1:
        return 0.0
    fit = _measured(cluster, op)
    if fit is not None:
        return fit.seconds(op, size, span.size)
    intra, inter = _links(cluster)
    n, m = span.size, span.nodes
    if m == 1:
        return ring_reduce_scatter(size, n, intra)
    return (n - m) * intra.latency + (m - 1) * inter.latency + (n - 1) / n * size / inter.bandwidth


def p2p_time(size: float, cluster: Cluster, layout: Layout) -> float:
    """One pipeline send between neighbouring stages. Across nodes the tp ranks each send 1/tp
    of the tensor over their own adapters (Megatron's scatter/gather) and all-gather it after."""
    fit = _measured(cluster, "p2p")
    if fit is not None:
        return fit.seconds("p2p", size, 2)
    intra, inter = _links(cluster)
    if layout.world_size // layout.pp < cluster.gpus_per_node:
        return intra.latency + size / intra.bandwidth
    if layout.tp > 1:
        return inter.latency + size / layout.tp / inter.bandwidth + ring_reduce_scatter(size, layout.tp, intra)
    return inter.latency + size / inter.bandwidth


@dataclass(frozen=True)
class Traffic:
    """One kind of collective in a step: its bytes per call, calls per step, and time."""

    axis: str
    op: str
    what: str
    bytes_per_call: float
    calls: int
    seconds: float
    overlapped: bool
    exposed: float | None = None  # seconds on the critical path when known here (cp's ring: not all hidden)
    phase: str = ""  # "forward" or "backward" when the traffic belongs to one (cp)

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_call * self.calls


def data_parallel_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                          state: StateBytes) -> list[Traffic]:
    """Gradient and parameter collectives over the dp group per optimizer step.

    Stages 0-1 reduce once per step (stage 0 all-reduces, stage 1 reduce-scatters and
    all-gathers the updated parameters), stage 2 reduce-scatters on every micro-batch, stage 3
    gathers every module's parameters before its forward and again before its backward, one
    collective per module (`zero3_gathers`). Stage 0-2's reduction overlaps backward except
    for the last bucket; stage 3's gathers are prefetched and its collectives are flat (how
    much of them hides is `trident.planner.zero3`). Only trainable parameters (LoRA's adapters) have gradients and
    change; stage 3 gathers the frozen ones as well. `workload.compression` shrinks the
    bytes (`trident.planner.compression`).
    """
    span = group_span("dp", layout, cluster.gpus_per_node)
    if span.size <= 1:
        return []
    gas = grad_accumulation(layout, workload) or 1
    _, trainable = rank_parameter_counts(model, layout, workload)
    c = workload.compression
    grads = gradient_bytes(c, trainable, state.gradient, span.size)
    stage = layout.zero_stage

    def t(axis_op: str, what: str, size: float, calls: int, overlapped: bool) -> Traffic:
        one = (flat_collective_time(axis_op, size, span, cluster) if stage == 3 else
               collective_time(axis_op, size, span, cluster, in_step=stage in (1, 2)))
        return Traffic("dp", axis_op, what, size, calls, calls * one, overlapped)

    what = "gradients" + (" (compressed)" if c is not None and c.active and grads < trainable * state.gradient else "")
    if stage == 0:
        return [t("all_reduce", what, grads, 1, True)]
    out = [t("reduce_scatter", what, grads, 1 if stage == 1 else gas, stage >= 2)]
    if stage == 3:
        out += zero3_gathers(model, layout, workload, cluster, state)
    else:
        out.append(t("all_gather", "updated parameters", trainable * state.parameter, 1, False))
    return out


def zero3_gathers(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                  state: StateBytes) -> list[Traffic]:
    """Stage 3's parameter all-gathers, flat over the dp group: one per module per pass, each
    paying the ring's latency and its bytes; forward, the recomputed forward (full
    recomputation), then backward, where a module the recompute gathered and kept
    (`zero3_kept_for_backward`) is not gathered again. Without recomputation backward gathers
    every module again (the ZeRO paper's 3 Psi). Gathers after the forward stay inside a node
    under ZeRO++'s hpZ; under fp8.all_gather the dense layers' weights move one byte per element."""
    gas = grad_accumulation(layout, workload) or 1
    c = workload.compression
    span = group_span("dp", layout, cluster.gpus_per_node)
    modules = [(n in FP8_GATHERED, e) for n, e in zero3_named_module_elements(model, layout, workload)]
    if not modules or span.size <= 1:
        return []
    hpz = c.hpz_partition_size if c is not None else 1
    back_span = _span(min(hpz, span.size), layout.tp * layout.ep, cluster.gpus_per_node) if hpz > 1 else span

    priced: dict[tuple[bool, float, int], float] = {}

    def one(fm: tuple[bool, float], where: GroupSpan) -> float:
        if (*fm, where.size) not in priced:
            size = parameter_gather_bytes(c, fm[1], state.parameter, fm[0])
            priced[(*fm, where.size)] = flat_collective_time("all_gather", size, where, cluster)
        return priced[(*fm, where.size)]

    full = layout.activation_checkpointing == "full"
    backward = modules
    if full:
        layer = [(n in FP8_GATHERED, e) for n, e in zero3_layer_modules(model, layout)
                 if e > workload.zero3_persistence_threshold]
        kept = zero3_kept_for_backward([e for _, e in layer], workload)
        first, last = zero3_outer_modules(model, layout)
        outer = [(False, m) for m in first + last if m > workload.zero3_persistence_threshold]
        backward = outer + [fe for fe, k in zip(layer, kept) if not k] * stage_layers(model, layout.pp)
    inside = f", inside hpZ groups of {hpz}" if hpz > 1 else ""
    out = [_gathers("parameters, forward (one per module)", modules, gas, state, c,
                    sum(one(m, span) for m in modules), "forward")]
    if full:
        out.append(_gathers(f"parameters, recomputed forward (one per module{inside})", modules, gas, state, c,
                            sum(one(m, back_span) for m in modules), "backward"))
    if backward:
        out.append(_gathers(f"parameters, backward (one per module not kept from the recompute{inside})" if full
                            else f"parameters, backward (one per module{inside})", backward, gas, state, c,
                            sum(one(m, back_span) for m in backward), "backward"))
    return out


def _gathers(what: str, modules: list[tuple[bool, float]], gas: int, state: StateBytes, c, one_pass: float,
             phase: str) -> Traffic:
    mean = sum(parameter_gather_bytes(c, m, state.parameter, fp8) for fp8, m in modules) / len(modules)
    return Traffic("dp", "all_gather", what, mean, gas * len(modules), gas * one_pass, True, None, phase)


def tensor_parallel_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> list[Traffic]:
    """Megatron's f/g pairs: per layer two all-reduces of the [b, s, h] activations in forward
    and two in backward (+ two for a recomputed forward); sequence parallelism turns each into
    a reduce-scatter plus an all-gather of the same bytes. The vocabulary-split embedding adds
    one all-reduce each way. All on the critical path."""
    if layout.tp <= 1:
        return []
    span = group_span("tp", layout, cluster.gpus_per_node)
    gas = grad_accumulation(layout, workload) or 1
    size = layout.micro_batch * local_seq_len(layout, workload) * model.d_model * workload.activation_bytes
    per_layer = 4 + (2 if layout.activation_checkpointing == "full" else 0)
    calls = gas * (per_layer * stage_layers(model, layout.pp) + 2)
    if layout.sequence_parallel:
        one = sum(collective_time(op, size, span, cluster) for op in ("reduce_scatter", "all_gather"))
        return [Traffic("tp", "reduce_scatter+all_gather", "activations", 2 * size, calls, calls * one, False)]
    return [Traffic("tp", "all_reduce", "activations", size, calls,
                    calls * collective_time("all_reduce", size, span, cluster), False)]


def pipeline_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> list[Traffic]:
    """Each micro-batch's activations go forward and their gradients come back across each
    stage boundary (interleaving multiplies the boundaries by the virtual stages)."""
    if layout.pp <= 1:
        return []
    gas = grad_accumulation(layout, workload) or 1
    size = layout.micro_batch * local_seq_len(layout, workload) * model.d_model * workload.activation_bytes
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    calls = 2 * gas * v
    return [Traffic("pp", "send/recv", "activations and their gradients", size, calls,
                    calls * p2p_time(size, cluster, layout), False)]


def expert_parallel_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> list[Traffic]:
    """Per MoE layer and micro-batch: dispatch and combine all-to-alls in forward and their
    conjugates in backward (two more with full recomputation), on the critical path. Each
    moves micro x seq x k rows of d_model values; priced like a reduce-scatter of that size."""
    if layout.ep <= 1 or not model.num_experts:
        return []
    span = group_span("ep", layout, cluster.gpus_per_node)
    gas = grad_accumulation(layout, workload) or 1
    tokens = layout.micro_batch * local_seq_len(layout, workload)  # cp: this rank's tokens
    size = tokens * model.moe_k * model.d_model * workload.activation_bytes
    per_layer = 4 + (2 if layout.activation_checkpointing == "full" else 0)
    moe_layers = model.moe_layers * stage_layers(model, layout.pp) // model.n_layer
    calls = gas * per_layer * moe_layers
    return [Traffic("ep", "all_to_all", "token rows to and from experts", size, calls,
                    calls * collective_time("reduce_scatter", size, span, cluster), False)]


def all_to_all_time(size: float, span: GroupSpan, cluster: Cluster) -> float:
    """One all-to-all in which every rank sends `size` bytes split evenly over the n ranks of
    `span` ((n - 1) / n of it leaves the rank, to n - 1 peers): the share for peers on other
    nodes goes over the network while the rest goes over NVLink."""
    if span.size <= 1:
        return 0.0
    fit = _measured(cluster, "all_to_all")
    if fit is not None:
        return fit.seconds("all_to_all", size, span.size)
    intra, inter = _links(cluster)
    n, k = span.size, span.per_node
    near = (k - 1) * intra.latency + (k - 1) / n * size / intra.bandwidth if k > 1 else 0.0
    far = (n - k) * inter.latency + (n - k) / n * size / inter.bandwidth if n > k else 0.0
    return max(near, far)


def cp_block_bytes(model: ModelSpec, layout: Layout, workload: Workload) -> tuple[float, float]:
    """(k/v block, dK/dV block) bytes one ring step moves per micro-batch and layer: keys and
    values of the rank's b x s/C tokens ([B, H_kv, T/C, D] twice) in the activation format, and
    their gradients in fp32. Under hybrid the block is [B, H_kv/U, U T/C, D]: the same bytes."""
    tokens = layout.micro_batch * local_seq_len(layout, workload)
    kv = cp_kv_dim(model, layout.tp)
    return tokens * 2 * kv * workload.activation_bytes, tokens * 2 * kv * 4


def ulysses_bytes(model: ModelSpec, layout: Layout, workload: Workload) -> float:
    """Bytes of one direction's four Ulysses all-to-alls (q, k, v and the output forward; their
    gradients backward) per micro-batch and layer: b (s/C) (2 h + 2 kv_dim) e, each a rank's
    whole tensor (per tp rank: h / tp, kv_dim / tp)."""
    tokens = layout.micro_batch * local_seq_len(layout, workload)
    return tokens * (2 * model.d_model / layout.tp + 2 * cp_kv_dim(model, layout.tp)) * workload.activation_bytes


def context_parallel_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> list[Traffic]:
    """cp's attention traffic per optimizer step (Liu et al. 2023, ring attention; Jacobs et al.
    2023, DeepSpeed-Ulysses), per layer and micro-batch:

      ring (R ranks)  forward: R - 1 sends of the k/v block; backward: R - 1 k/v blocks and R
                      fp32 dK/dV blocks (the gradients travel home with their block); full
                      recompute runs the forward's R - 1 sends again. Each ring step's sends run
                      while the step's block is computed (forward: f = the layer's attention
                      FLOPs on this rank / R; backward 2 f) and only what exceeds it is exposed.
      Ulysses (U)     4 all-to-alls forward (q, k, v, out) and 4 backward (6 with full
                      recompute), b (s/C) (2 h + 2 kv_dim) e bytes per direction, blocking.
      hybrid          Ulysses inside groups of U, the ring across the C / U groups.

    The attention FLOPs are the time model's (the whole sequence per token, not halved for
    the causal mask): the same compute the step time charges."""
    if layout.cp <= 1:
        return []
    gas = grad_accumulation(layout, workload) or 1
    layers = stage_layers(model, layout.pp)
    full = layout.activation_checkpointing == "full"
    u, ring = cp_groups(layout, workload)
    out = []
    if u > 1:  # a Ulysses group: u consecutive cp ranks; a ring: every u-th
        span = _span(u, layout.tp * layout.ep, cluster.gpus_per_node)
        size = ulysses_bytes(model, layout, workload) / 4  # the four all-to-alls' mean size
        one = all_to_all_time(size, span, cluster)
        for phase, per_layer in (("forward", 4), ("backward", 4 + (4 if full else 0))):
            calls = gas * layers * per_layer
            what = f"Ulysses q, k, v, out{' (and gradients)' if phase == 'backward' else ''}, {phase}" + (
                " + recomputed forward" if phase == "backward" and full else "")
            out.append(Traffic("cp", "all_to_all", what, size, calls, calls * one, False, calls * one, phase))
    if ring > 1:
        kv_bytes, dkv_bytes = cp_block_bytes(model, layout, workload)
        spans_nodes = _span(ring, layout.tp * layout.ep * u, cluster.gpus_per_node).nodes > 1
        intra, inter = _links(cluster)
        link = inter if spans_nodes else intra
        t_kv, t_dkv = (link.latency + n / link.bandwidth for n in (kv_bytes, dkv_bytes))
        g = cluster.gpu
        attention_flops = (layout.micro_batch * local_seq_len(layout, workload) * model.forward_flops_per_token(
            workload.seq_len)[1] / model.n_layer / layout.tp)
        f = attention_flops / ring / (g.peak_flops * g.gemm_efficiency)  # one ring step's block, forward
        per = gas * layers
        fwd = max(0.0, t_kv - f)
        bwd_kv = (ring - 1) * max(0.0, t_kv - 2 * f) + ((ring - 1) * fwd if full else 0.0)
        bwd_dkv = (ring - 1) * (max(0.0, t_kv + t_dkv - 2 * f) - max(0.0, t_kv - 2 * f)) + max(0.0, t_dkv - 2 * f)
        sends = per * (ring - 1)
        out += [Traffic("cp", "send/recv", "ring k/v blocks, forward", kv_bytes, sends, sends * t_kv, True,
                        sends * fwd, "forward"),
                Traffic("cp", "send/recv", "ring k/v blocks, backward" + (" + recomputed forward" if full else ""),
                        kv_bytes, sends * (2 if full else 1), sends * (2 if full else 1) * t_kv, True, per * bwd_kv,
                        "backward"),
                Traffic("cp", "send/recv", "ring fp32 dK/dV blocks, backward", dkv_bytes, per * ring,
                        per * ring * t_dkv, True, per * bwd_dkv, "backward")]
    return out


def muon_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> list[Traffic]:
    """Muon's whole-matrix gathers (trident.zero.muon, trident.optim.muon), in fp32, once per step.

    Under ZeRO 1-3 every unit (a matrix, `trident.planner.muon.gather_units`) is gathered to its
    owner and its update scattered back: per unit a collective of its whole fp32 buffer, 4 M / units bytes
    (M the elements of the stage's matrices on this rank: its layers / tp; norm gains and
    biases, < 1%, counted in), timed like an all-gather of it (the owner's link carries
    (n - 1) / n of it), one after the other. Tensor-parallel slices are then gathered whole
    over tp by each matrix's owner (stage 0: every rank, each of its matrices)."""
    if workload.optimizer.lower() != "muon":
        return []
    matrices = stage_layers(model, layout.pp) * model.layer_parameters() / layout.tp
    dp = group_span("dp", layout, cluster.gpus_per_node)
    out = []
    if layout.zero_stage and dp.size > 1:
        units = gather_units(model, layout)
        unit = 4 * matrices / units
        one = units * collective_time("all_gather", unit, dp, cluster)
        out += [Traffic("dp", "gather", "Muon momenta to their owner ranks", unit, units, one, False),
                Traffic("dp", "scatter", "Muon updates from their owner ranks", unit, units, one, False)]
    tp = group_span("tp", layout, cluster.gpus_per_node)
    if tp.size > 1:
        owners = dp.size if layout.zero_stage else 1
        calls = max(1, round(matrices_per_stage(model, layout) / owners))
        whole = 4 * matrices * tp.size / owners / calls
        out.append(Traffic("tp", "all_gather", "Muon matrices whole", whole, calls,
                           calls * collective_time("all_gather", whole, tp, cluster), False))
    return out


def step_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                 state: StateBytes) -> list[Traffic]:
    """Every collective one rank takes part in per optimizer step."""
    return (data_parallel_traffic(model, layout, workload, cluster, state)
            + muon_traffic(model, layout, workload, cluster)
            + tensor_parallel_traffic(model, layout, workload, cluster)
            + expert_parallel_traffic(model, layout, workload, cluster)
            + context_parallel_traffic(model, layout, workload, cluster)
            + pipeline_traffic(model, layout, workload, cluster))


def replica_gradient_bytes(num_params: float, replicas: int, bytes_per_grad: int = 4) -> float:
    """Gradient bytes that enter one data-parallel reduction: each replica's full gradient.

    GPT-3's 175e9 fp32 gradients (700 GB) from 128 replicas are 89.6 TB per iteration. A ring
    all-reduce puts 2 (N-1)/N of that on the wire per replica, about twice as much."""
    return num_params * bytes_per_grad * replicas


def ring_all_reduce_wire_bytes(num_params: float, replicas: int, bytes_per_grad: int = 4) -> float:
    """Bytes all replicas together send in one ring all-reduce of the gradients."""
    return 2 * (replicas - 1) / replicas * num_params * bytes_per_grad * replicas
