"""ZeRO-3's step, module by module: how much of its communication the compute hides.

Stage 3 gathers each module's parameters just before the module runs and reduce-scatters the
gradients as they come; the per-step volume is `comm.zero3_gathers` and the reduce-scatter of
`comm.data_parallel_traffic`. Whether those seconds add to the step depends on the order things
can happen in, which this module plays out for one micro-batch (forward, then backward with
the recomputed forward of each layer), on two resources:

- the compute stream runs the modules one after another; a module starts when the one before
  it is done and its own parameters have arrived;
- the communication stream (one per process group, as NCCL's are) runs the collectives one
  after another in the order they were issued. When module i starts, the gathers of the next
  modules are issued, up to `stage3_prefetch_bucket_size` elements ahead (at least the next
  gathered module: DeepSpeed's prefetch loop adds a parameter before it checks the bucket; 0
  turns prefetch off, so each module's gather is issued when it is needed). A
  collective waits for the compute issued before it (NCCL's stream waits on the stream that
  issued it), so a gather issued as module i starts cannot begin before module i - 1 is done.
- gradients fill buckets of `reduce_bucket_size` elements in backward; a full bucket's
  reduce-scatter is issued when the module that filled it is done, and the last, partial one
  when backward ends.

The micro-batch takes as long as the later of the two streams finishes; what it takes beyond
its compute is the exposed communication. So a prefetch depth of one module hides a gather
only as far as the module before it computes (a small module before a large one exposes the
difference), the first gather of the micro-batch waits in full, and when the collectives take
longer than the compute (ZeRO-3 at scale: bytes per GPU fixed, compute per GPU shrinking as
GPUs are added at a fixed batch) the step is the communication stream's time.

Compute is the stage's (`time.StageTime`: forward, backward, recomputed forward, tensor-parallel
collectives included) laid over the modules in proportion to their GEMM time; element-wise work
and the attention scores form a module without parameters after the qkv projection.

Not modelled: `stage3_max_live_parameters` (DeepSpeed also stops prefetching while more than
that many elements are gathered), and trident's own prefetch, which takes only modules that fit
in the bucket whole and stops at the first that does not (`trident.zero.stage3`): with the
default bucket it does not prefetch past modules of more than 5e7 elements, where DeepSpeed
takes one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trident.planner.comm import GroupSpan, _span, flat_collective_time, group_span
from trident.planner.compression import gradient_bytes, parameter_gather_bytes
from trident.planner.compute import _fwd_bwd, layer_gemms
from trident.planner.layout import Layout, Workload, local_seq_len, stage_layers
from trident.planner.memory import StateBytes, rank_parameter_counts
from trident.planner.presets import Cluster, ModelSpec
from trident.planner.zero3_modules import FP8_GATHERED, zero3_kept_for_backward, zero3_layer_modules, zero3_outer_modules


@dataclass
class Ops:
    """Modules' turns in order, as parallel lists: elements gathered for each (0: none, persistent
    or kept), its compute seconds, its gather's seconds, the gradient elements it produces, and the
    seconds of the reduce-scatter issued when it is done."""

    elements: list[float] = field(default_factory=list)
    compute: list[float] = field(default_factory=list)
    gather: list[float] = field(default_factory=list)
    grads: list[float] = field(default_factory=list)
    reduce: list[float] = field(default_factory=list)

    def extend(self, other: Ops, times: int = 1) -> None:
        for name in ("elements", "compute", "gather", "grads", "reduce"):
            getattr(self, name).extend(getattr(other, name) * times)

    def add(self, elements: float, compute: float, gather: float = 0.0, grads: float = 0.0) -> None:
        self.elements.append(elements)
        self.compute.append(compute)
        self.gather.append(gather)
        self.grads.append(grads)
        self.reduce.append(0.0)


@dataclass(frozen=True)
class Zero3Schedule:
    """One micro-batch of stage 3 played out: its duration, its compute, and the collectives."""

    seconds: float
    compute: float
    gathers: float
    reduce_scatters: float
    without_reduce_scatters: float  # the same played without them: what the gathers alone cost

    @property
    def exposed(self) -> float:
        """Seconds the communication adds to the micro-batch's compute."""
        return max(0.0, self.seconds - self.compute)

    @property
    def gathers_exposed(self) -> float:
        """Of `exposed`, what the gathers would leave exposed on their own."""
        return min(self.exposed, max(0.0, self.without_reduce_scatters - self.compute))


def play(ops: Ops, prefetch_elems: float, reduce: bool = True) -> float:
    """Seconds until both streams are done with `ops` (the rules in the module docstring);
    `reduce=False` leaves the reduce-scatters out."""
    elements, gathers, compute, reduces = ops.elements, ops.gather, ops.compute, ops.reduce
    n = len(elements)
    link = prev_end = 0.0
    ready = [0.0] * n
    issued, window, ahead = 0, 0.0, 0  # gathers of ops[:issued] issued; elements and modules issued ahead
    for i in range(n):
        if issued > i:
            window -= elements[i]
            ahead -= gathers[i] > 0
        else:
            if gathers[i] > 0:
                link = (link if link > prev_end else prev_end) + gathers[i]
                ready[i] = link
            issued = i + 1
        while prefetch_elems > 0 and issued < n and (ahead == 0 or window < prefetch_elems):
            g = gathers[issued]
            if g > 0:
                link = (link if link > prev_end else prev_end) + g
                ready[issued] = link
                ahead += 1
            window += elements[issued]
            issued += 1
        prev_end = (ready[i] if ready[i] > prev_end else prev_end) + compute[i]
        if reduce and reduces[i] > 0:
            link = (link if link > prev_end else prev_end) + reduces[i]
    return max(prev_end, link)


def _layer_weights(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                   names: list[str]) -> tuple[list[float], list[float], float, float]:
    """Forward and backward GEMM seconds of each of a layer's modules (`names`, with "attention"
    for the module without parameters), and of the head."""
    curve, e = cluster.gpu.gemm_curve(), workload.activation_bytes
    gemms = layer_gemms(model, layout, workload)
    (qf, qb), (pf, pb), (inf_, inb), (outf, outb) = (_fwd_bwd(curve, *g, e) for g in gemms[:4])
    af, ab = (sum(x) for x in zip(*(_fwd_bwd(curve, *g, e) for g in gemms[4:])))
    experts = max(1, names.count("mlp_in"))
    table = {"norm": (0.0, 0.0), "qkv": (qf, qb), "attention": (af, ab), "proj": (pf, pb),
             "mlp_in": (inf_ / experts, inb / experts), "mlp_out": (outf / experts, outb / experts)}
    tokens = layout.micro_batch * local_seq_len(layout, workload)
    head_f, head_b = _fwd_bwd(curve, tokens, model.vocab_size / layout.tp, model.d_model, 1, e)
    return [table[n][0] for n in names], [table[n][1] for n in names], head_f, head_b


def zero3_schedule(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster, state: StateBytes,
                   forward: float, backward: float, recompute: float) -> Zero3Schedule:
    """Play one micro-batch of stage 3 whose forward takes `forward` seconds and whose backward
    `backward` (of which `recompute` recomputes the forward)."""
    c, thr = workload.compression, workload.zero3_persistence_threshold
    span = group_span("dp", layout, cluster.gpus_per_node)
    hpz = c.hpz_partition_size if c is not None else 1
    back = _span(min(hpz, span.size), layout.tp * layout.ep, cluster.gpus_per_node) if hpz > 1 else span

    def gather(elems: float, where: GroupSpan, fp8: bool) -> float:
        size = parameter_gather_bytes(c, elems, state.parameter, fp8)
        return flat_collective_time("all_gather", size, where, cluster) if elems > thr else 0.0

    def module(ops: Ops, elems: float, compute: float, where: GroupSpan = span, grads: float = 0.0,
               keep: bool = False, name: str = "outer") -> None:
        gathered = elems > thr and not keep
        ops.add(elems if gathered else 0.0, compute, gather(elems, where, name in FP8_GATHERED) if gathered else 0.0,
                grads)

    modules = zero3_layer_modules(model, layout)
    modules.insert(2, ("attention", 0.0))
    names, elems = [n for n, _ in modules], [e for _, e in modules]
    fw, bw, head_f, head_b = _layer_weights(model, layout, workload, cluster, names)
    layers = stage_layers(model, layout.pp)
    full = layout.activation_checkpointing == "full"
    f_scale = forward / max(1e-30, layers * sum(fw) + head_f)
    r_scale = recompute / max(1e-30, layers * sum(fw)) if full else 0.0
    b_scale = (backward - recompute) / max(1e-30, layers * sum(bw) + head_b)
    selective = recompute / layers if layout.activation_checkpointing in ("selective", "op") else 0.0
    first, last = zero3_outer_modules(model, layout)
    final_norm, head = last[0], sum(last[1:])  # the output layer's own weight when untied (else 0)
    gathered = [i for i, e in enumerate(elems) if e > thr]
    kept = dict(zip(gathered, zero3_kept_for_backward([elems[i] for i in gathered], workload))) if full else {}

    forward_layer, backward_layer, ops = Ops(), Ops(), Ops()
    for n, e, w in zip(names, elems, fw):
        module(forward_layer, e, f_scale * w, name=n)
    if full:
        for n, e, w in zip(names, elems, fw):
            module(backward_layer, e, r_scale * w, back, name=n)
    for i in reversed(range(len(elems))):
        module(backward_layer, elems[i], b_scale * bw[i] + (selective if names[i] == "attention" else 0.0), back,
               elems[i], kept.get(i, False), names[i])
    for e in first:
        module(ops, e, 0.0)
    ops.extend(forward_layer, layers)
    module(ops, final_norm, 0.0)
    module(ops, head, f_scale * head_f)
    start = len(ops.elements)
    module(ops, head, b_scale * head_b, back, head)
    module(ops, final_norm, 0.0, back, final_norm)
    ops.extend(backward_layer, layers)
    for e in reversed(first):
        module(ops, e, 0.0, back, e)
    reduced = _place_reduce_scatters(model, layout, workload, cluster, state, ops, start)
    return Zero3Schedule(play(ops, workload.zero3_prefetch_elems), sum(ops.compute), sum(ops.gather), reduced,
                         play(ops, workload.zero3_prefetch_elems, reduce=False))


def _place_reduce_scatters(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                           state: StateBytes, ops: Ops, start: int) -> float:
    """Put a reduce-scatter after each backward op (from `start` on) that fills a bucket of
    `reduce_bucket_size` gradient elements, and the last partial bucket after the last op;
    their total seconds."""
    span = group_span("dp", layout, cluster.gpus_per_node)
    params, trainable = rank_parameter_counts(model, layout, workload)
    share = trainable / params if params else 0.0  # LoRA: only the adapters' gradients are reduced
    bucket, total = 0.0, 0.0

    def reduce(elements: float) -> float:
        size = gradient_bytes(workload.compression, elements, state.gradient, span.size)
        return flat_collective_time("reduce_scatter", size, span, cluster)

    for i in range(start, len(ops.grads)):
        bucket += share * ops.grads[i]
        if bucket >= workload.reduce_bucket_elems:
            ops.reduce[i] = reduce(bucket)
            total, bucket = total + ops.reduce[i], 0.0
    if bucket > 0 and len(ops.grads) > start:
        last = reduce(bucket)
        ops.reduce[-1] += last
        total += last
    return total
