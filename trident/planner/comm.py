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

Ranks are ordered (pp, dp, tp), tp fastest, so a tp group is consecutive ranks, a dp group
strides by tp and a pp neighbour is tp * dp ranks away.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trident.planner.layout import Layout, Workload, grad_accumulation, stage_layers
from trident.planner.memory import StateBytes, rank_parameter_counts
from trident.planner.presets import Cluster, ModelSpec

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
    """How the tp, dp or pp group of rank 0 sits on nodes of `gpus_per_node` GPUs."""
    stride = {"tp": 1, "dp": layout.tp, "pp": layout.tp * layout.dp}[axis]
    size = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp}[axis]
    per_node = max(1, min(size, gpus_per_node // stride)) if stride <= gpus_per_node else 1
    return GroupSpan(size, per_node, -(-size // per_node))


def _links(cluster: Cluster) -> tuple[Link, Link]:
    g = cluster.gpu
    return (Link(g.intra_node_bandwidth * LINK_EFFICIENCY, g.intra_node_latency),
            Link(g.inter_node_bandwidth * LINK_EFFICIENCY, g.inter_node_latency))


def collective_time(op: str, size: float, span: GroupSpan, cluster: Cluster) -> float:
    """Seconds for one `op` ("all_reduce", "reduce_scatter", "all_gather") of `size` bytes."""
    intra, inter = _links(cluster)
    if span.size <= 1:
        return 0.0
    if span.nodes == 1:
        return all_reduce(size, span.size, intra) if op == "all_reduce" else ring_reduce_scatter(size, span.size, intra)
    k, m = span.per_node, span.nodes
    if op == "all_reduce":
        return 2 * ring_reduce_scatter(size, k, intra) + all_reduce(size / k, m, inter)
    return ring_reduce_scatter(size, k, intra) + ring_reduce_scatter(size / k, m, inter)


def p2p_time(size: float, cluster: Cluster, layout: Layout) -> float:
    """One pipeline send between neighbouring stages. Across nodes the tp ranks each send 1/tp
    of the tensor over their own adapters (Megatron's scatter/gather) and all-gather it after."""
    intra, inter = _links(cluster)
    if layout.tp * layout.dp < cluster.gpus_per_node:
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

    @property
    def bytes_per_step(self) -> float:
        return self.bytes_per_call * self.calls


def data_parallel_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                          state: StateBytes) -> list[Traffic]:
    """Gradient and parameter collectives over the dp group per optimizer step.

    Stages 0-1 reduce once per step (stage 0 all-reduces, stage 1 reduce-scatters and
    all-gathers the updated parameters), stage 2 reduce-scatters on every micro-batch, stage 3
    also all-gathers each layer's parameters for forward and for backward on every micro-batch.
    Stage 0-2's reduction overlaps backward except for the last bucket; stage 3's gathers are
    prefetched, so they overlap compute too. Only trainable parameters (LoRA's adapters) have
    gradients and change; stage 3 gathers the frozen ones as well.
    """
    span = group_span("dp", layout, cluster.gpus_per_node)
    if span.size <= 1:
        return []
    gas = grad_accumulation(layout, workload) or 1
    psi, trainable = rank_parameter_counts(model, layout, workload)
    grads, params = trainable * state.gradient, psi * state.parameter
    stage = layout.zero_stage

    def t(axis_op: str, what: str, size: float, calls: int, overlapped: bool) -> Traffic:
        seconds = calls * collective_time(axis_op, size, span, cluster)
        return Traffic("dp", axis_op, what, size, calls, seconds, overlapped)

    if stage == 0:
        return [t("all_reduce", "gradients", grads, 1, True)]
    out = [t("reduce_scatter", "gradients", grads, 1 if stage == 1 else gas, stage >= 2)]
    if stage == 3:
        out.append(t("all_gather", "parameters (forward + backward)", params, 2 * gas, True))
    else:
        out.append(t("all_gather", "updated parameters", trainable * state.parameter, 1, False))
    return out


def tensor_parallel_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster) -> list[Traffic]:
    """Megatron's f/g pairs: per layer two all-reduces of the [b, s, h] activations in forward
    and two in backward (+ two for a recomputed forward); sequence parallelism turns each into
    a reduce-scatter plus an all-gather of the same bytes. The vocabulary-split embedding adds
    one all-reduce each way. All on the critical path."""
    if layout.tp <= 1:
        return []
    span = group_span("tp", layout, cluster.gpus_per_node)
    gas = grad_accumulation(layout, workload) or 1
    size = layout.micro_batch * workload.seq_len * model.d_model * workload.activation_bytes
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
    size = layout.micro_batch * workload.seq_len * model.d_model * workload.activation_bytes
    v = layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1
    calls = 2 * gas * v
    return [Traffic("pp", "send/recv", "activations and their gradients", size, calls,
                    calls * p2p_time(size, cluster, layout), False)]


def step_traffic(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                 state: StateBytes) -> list[Traffic]:
    """Every collective one rank takes part in per optimizer step."""
    return (data_parallel_traffic(model, layout, workload, cluster, state)
            + tensor_parallel_traffic(model, layout, workload, cluster)
            + pipeline_traffic(model, layout, workload, cluster))


def replica_gradient_bytes(num_params: float, replicas: int, bytes_per_grad: int = 4) -> float:
    """Gradient bytes that enter one data-parallel reduction: each replica's full gradient.

    GPT-3's 175e9 fp32 gradients (700 GB) from 128 replicas are 89.6 TB per iteration. A ring
    all-reduce puts 2 (N-1)/N of that on the wire per replica, about twice as much."""
    return num_params * bytes_per_grad * replicas


def ring_all_reduce_wire_bytes(num_params: float, replicas: int, bytes_per_grad: int = 4) -> float:
    """Bytes all replicas together send in one ring all-reduce of the gradients."""
    return 2 * (replicas - 1) / replicas * num_params * bytes_per_grad * replicas
