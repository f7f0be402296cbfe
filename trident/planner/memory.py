"""Bytes per rank: model states (the ZeRO formulas, in one place), activations, buffers.

Model states (Rajbhandari et al. 2020, "ZeRO", section 5): with Psi parameters on N
data-parallel ranks and P, G, K bytes per parameter of weights, gradients and optimizer states
(fp32 master weights count as optimizer states, K = 12 for mixed-precision Adam):

    stage 0   (P + G + K) Psi            stage 2   P Psi + (G + K) Psi / N
    stage 1   (P + G) Psi + K Psi / N    stage 3   (P + G + K) Psi / N

With LoRA (or any frozen part) only Psi_t of the Psi parameters train: the frozen ones cost P
bytes each (partitioned under stage 3 like the rest), the trainable ones P + G + K as above, so
G and K multiply Psi_t instead of Psi. Adapters add r (in + out) parameters per adapted linear
layer, split over tp the way their base layer is.

Activations per transformer layer and micro-batch (Korthikanti et al. 2022, "Reducing
Activation Recomputation in Large Transformer Models", section 4): s b h (34 + 5 a s / h)
bytes in 16-bit with dropout and unfused attention; with tensor parallelism t the
layer norms, their outputs and the dropout masks (10 s b h) stay whole on every rank unless
sequence parallelism splits them too. `layer_activation_bytes` derives those numbers from the
tensors autograd keeps, so other formats and fused attention follow from the same count.

Context parallelism over C ranks: each rank holds s / C tokens of every sequence, so its
activations (the head's too) are those of s / C tokens, with attention priced as fused ("flash"):
ring and Ulysses attention keep the output and log-sum-exp, never the scores. Model states
partition over dp x C, the ranks that hold the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

from trident.planner.layout import (DEFAULT_LORA_TARGETS, Layout, Workload, attention_kind, cp_groups,
                                    grad_accumulation, local_seq_len, stage_layers)
from trident.planner.presets import Cluster, ModelSpec
from trident.planner.zero3_modules import zero3_kept_for_backward, zero3_layer_modules, zero3_module_elements

OPTIMIZER_STATE_BYTES = {"adam": 8, "adamw": 8, "lion": 4, "adagrad": 4, "sgd": 4, "sgd-nomomentum": 0, "muon": 4}
"""fp32 optimizer state per parameter: Adam's two moments, one momentum/sum for the others (Muon:
its matrices' momentum; the AdamW it runs for embeddings, norms and biases is not counted)."""

FRAGMENTATION = 0.10
"""Margin on transient allocations (activations, buffers) for the caching allocator's fragmentation."""


@dataclass(frozen=True)
class StateBytes:
    """Bytes per parameter: working weights, gradients, fp32 master copy, optimizer moments."""

    parameter: float
    gradient: float
    master: float
    optimizer: float

    @property
    def k(self) -> float:
        """The ZeRO paper's K: optimizer-side bytes per parameter (masters + moments)."""
        return self.master + self.optimizer


def optimizer_state_bytes(optimizer: str) -> int:
    try:
        return OPTIMIZER_STATE_BYTES[optimizer.lower()]
    except KeyError:
        raise ValueError(f"unknown optimizer {optimizer!r} for the memory model; choose one of "
                         f"{', '.join(OPTIMIZER_STATE_BYTES)}") from None


def mixed_precision_bytes(precision: str = "bf16", optimizer: str = "adam") -> StateBytes:
    """The textbook accounting: 16-bit weights and gradients + fp32 masters, or all fp32."""
    opt = optimizer_state_bytes(optimizer)
    if precision == "fp32":
        return StateBytes(4, 4, 0, opt)
    if precision in ("bf16", "fp16"):
        return StateBytes(2, 2, 4, opt)
    raise ValueError(f"unknown precision {precision!r}; choose bf16, fp16 or fp32")


def trident_state_bytes(stage: int, precision: str = "bf16", optimizer: str = "adam") -> StateBytes:
    """What trident's engine holds: as the textbook, except that stage 0 accumulates and
    all-reduces gradients in one fp32 buffer (4 bytes) whatever the compute precision."""
    base = mixed_precision_bytes(precision, optimizer)
    return StateBytes(base.parameter, 4, base.master, base.optimizer) if stage == 0 else base


@dataclass(frozen=True)
class ModelStates:
    """Bytes of model states one rank holds (the keys of `engine.memory_breakdown()`)."""

    parameters: float
    gradients: float
    optimizer_states: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states

    def as_dict(self) -> dict[str, float]:
        return {"parameters": self.parameters, "gradients": self.gradients, "optimizer_states": self.optimizer_states}


def model_state_bytes(num_params: float, stage: int, dp: int, state: StateBytes,
                      trainable: float | None = None) -> ModelStates:
    """Per-rank model states of `num_params` parameters under ZeRO `stage` over `dp` ranks, of
    which `trainable` (default: all) have gradients and optimizer states; the others are
    frozen and cost their parameter bytes only."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage must be 0, 1, 2 or 3, got {stage}")
    if dp < 1:
        raise ValueError(f"the data-parallel size must be >= 1, got {dp}")
    trainable = num_params if trainable is None else trainable
    if not 0 <= trainable <= num_params:
        raise ValueError(f"trainable parameters must be between 0 and the {num_params:g} parameters, got "
                         f"{trainable:g}")
    return ModelStates(num_params * state.parameter / (dp if stage >= 3 else 1),
                       trainable * state.gradient / (dp if stage >= 2 else 1),
                       trainable * state.k / (dp if stage >= 1 else 1))


def zero_paper_bytes(num_params: float, stage: int, dp: int, k: float = 12) -> float:
    """Figure 1 of the ZeRO paper: fp16 weights and gradients (2 + 2 bytes) and K bytes of
    optimizer state per parameter; total model-state bytes per GPU."""
    return model_state_bytes(num_params, stage, dp, StateBytes(2, 2, 0, k)).total


def rank_parameters(model: ModelSpec, tp: int, pp: int, ep: int = 1) -> float:
    """Parameters on the busiest rank: its stage's layers (plus embeddings on the first stage,
    the output layer on the last, a tied table held by both) split over tp ranks; an MoE
    model's experts are whole on each tp rank and split over ep (`rank_expert_parameters`)."""
    experts = rank_expert_parameters(model, pp, ep)
    dense_all = model.num_parameters() - model.expert_parameters()
    if pp == 1:
        return dense_all / tp + experts
    layers = stage_layers(model, pp) / model.n_layer * (dense_all - model.embedding_parameters())
    table = model.vocab_size * model.d_model
    first = table + (model.seq_len * model.d_model if model.position == "learned" else 0)
    return (layers + max(first, table + model.d_model)) / tp + experts


def rank_expert_parameters(model: ModelSpec, pp: int = 1, ep: int = 1) -> float:
    """Expert parameters on one rank: its stage's share of the MoE layers' experts, / ep."""
    return model.expert_parameters() * stage_layers(model, pp) / model.n_layer / ep


def moe_state_bytes(model: ModelSpec, layout: Layout, state: StateBytes) -> ModelStates:
    """Model states of one rank of an MoE model: dense weights partitioned (ZeRO) over their
    dp x ep replicas, expert weights (1/ep of them) over their dp replicas."""
    params = rank_parameters(model, layout.tp, layout.pp, layout.ep)
    experts = rank_expert_parameters(model, layout.pp, layout.ep)
    dense = model_state_bytes(params - experts, layout.zero_stage, layout.gradient_replicas, state)
    expert = model_state_bytes(experts, layout.zero_stage, layout.dp * layout.cp, state)
    return ModelStates(*(a + b for a, b in zip(dense.as_dict().values(), expert.as_dict().values())))


def lora_layer_parameters(model: ModelSpec, r: int, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS,
                          tp: int = 1) -> float:
    """LoRA adapter parameters of one transformer layer on one tp rank: r (in + out) for each
    targeted linear layer, A (r x in) and B (out x r) split as `trident.peft` splits them.

    Column-split layers (q, k, v, qkv, the MLP's up and gate matrices) keep A whole and split
    B's rows; row-split ones (o, the MLP's down matrix) split A's columns and keep B whole.
    """
    h, kv, ff = model.d_model, model.kv_dim, model.ff_dim

    def column(n_in: float, n_out: float) -> float:
        return r * (n_in + n_out / tp)

    def row(n_in: float, n_out: float) -> float:
        return r * (n_in / tp + n_out)

    up = column(h, ff) * (2 if model.gated_mlp else 1)  # a gated MLP has up and gate matrices
    per_target = {"q": column(h, h), "k": column(h, kv), "v": column(h, kv), "qkv": column(h, h + 2 * kv),
                  "o": row(h, h), "mlp": up + row(ff, h)}
    unknown = [t for t in targets if t not in per_target]
    if unknown:
        raise ValueError(f"LoRA targets {unknown}: choose among {', '.join(per_target)}")
    return sum(per_target[t] for t in targets)


def lora_parameters(model: ModelSpec, r: int, targets: tuple[str, ...] = DEFAULT_LORA_TARGETS, tp: int = 1,
                    pp: int = 1) -> float:
    """Adapter parameters on the busiest rank (its stage's layers, on one tp rank)."""
    return stage_layers(model, pp) * lora_layer_parameters(model, r, targets, tp)


def rank_parameter_counts(model: ModelSpec, layout: Layout, workload: Workload) -> tuple[float, float]:
    """(parameters, trainable parameters) on the busiest rank: the model's, all trainable; with
    `workload.lora_r`, the frozen model plus its adapters, of which only the adapters train."""
    base = rank_parameters(model, layout.tp, layout.pp, layout.ep)
    if not workload.lora_r:
        return base, base
    adapters = lora_parameters(model, workload.lora_r, workload.lora_targets, layout.tp, layout.pp)
    return base + adapters, adapters


PLACE = {"none": "device", "cpu": "host", "nvme": "nvme"}
"""Where an offload setting ("none", "cpu", "nvme") puts the bytes it moves."""


@dataclass(frozen=True)
class Placement:
    """Where one rank's model states live when parts are offloaded."""

    device: float
    host: float
    nvme: float


def place_model_states(states: ModelStates, layout: Layout) -> Placement:
    """Optimizer offload moves the optimizer states (with the fp32 masters) off the device;
    parameter offload (stage 3) moves the parameter partition too. Gradients stay on the device."""
    where = {"device": states.gradients, "host": 0.0, "nvme": 0.0}
    where[PLACE[layout.offload_optimizer]] += states.optimizer_states
    where[PLACE[layout.offload_params]] += states.parameters
    return Placement(where["device"], where["host"], where["nvme"])


# -- activations ----------------------------------------------------------------------------

def layer_activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int = 1, sp: bool = False,
                           checkpointing: str = "none", act_bytes: int = 2, dropout: bool = True,
                           attention: str = "eager") -> float:
    """Bytes one transformer layer keeps for backward for one micro-batch, on one tp rank.

    Per token (units of h = d_model elements), with e bytes per element:
      kept whole on every tp rank unless `sp`: both norms' inputs (2e), the qkv and fc inputs
      (2e), two dropout masks (2 x 1 byte);
      split over tp: q, k, v (e + 2e kv/h), the output projection's input (e; a fused attention
      kernel's output is that same tensor, plus 4 bytes of log-sum-exp per head), the MLP's
      hidden activations (2 or 3 x e d_ff/h), and with eager attention the softmax (e a s/h),
      its dropout mask and output ((1 + e) a s/h).
    "selective" recomputes the a s/h terms; "full" keeps only the layer's input (e); "op" (per-op
    selective) keeps the layer's input (e) and the outputs of its matmuls and attention: q, k, v
    (e + 2e kv/h), the attention output and its log-sum-exp (e + 4 a/h), the output projection's
    (e), the MLP's input projections (1 or 2 x e d_ff/h) and its output projection (e).
    """
    s, b, h, a = seq_len, micro_batch, model.d_model, model.n_head
    e = act_bytes
    if checkpointing == "full":
        return s * b * h * e / (tp if sp else 1)
    if checkpointing == "op":
        split = e * (1 + 2 * model.kv_dim / h) + e + 4 * a / h + e * (2 if model.gated_mlp else 1) * model.ff_dim / h
        return s * b * h * ((e + 2 * e) / (tp if sp else 1) + split / tp)
    whole = 4 * e + (2 if dropout else 0)
    split = e * (1 + 2 * model.kv_dim / h) + e + e * (3 if model.gated_mlp else 2) * model.ff_dim / h
    if attention == "flash":
        split += 4 * a / h  # the kernel's fp32 log-sum-exp per head and token
    elif checkpointing != "selective":
        split += (e + ((1 + e) if dropout else 0)) * a * s / h
    return s * b * h * (whole / (tp if sp else 1) + split / tp)


def output_activation_bytes(model: ModelSpec, micro_batch: int, seq_len: int, tp: int, act_bytes: int) -> float:
    """The last stage's head at its peak, the start of backward: final norm input and
    output-layer input (e each), the fp32 log-probabilities the cross-entropy keeps (4 V bytes
    per token), and their gradient and the logits' gradient being computed (2 x 4 V); the
    vocabulary is split over tp."""
    tokens = seq_len * micro_batch
    return tokens * (2 * act_bytes * model.d_model + 3 * 4 * model.vocab_size / tp)


def in_flight_micro_batches(layout: Layout, grad_accum: int) -> float:
    """Micro-batches whose activations the first pipeline stage holds at its peak."""
    if layout.pp == 1:
        return 1
    if layout.schedule == "gpipe":
        return grad_accum
    if layout.schedule == "interleaved_1f1b":
        return min(grad_accum, layout.pp) * (1 + (layout.pp - 1) / (layout.pp * layout.virtual_stages))
    return min(grad_accum, layout.pp)


def activation_memory(model: ModelSpec, layout: Layout, workload: Workload) -> float:
    """Peak activation bytes on the busiest rank (first stage, or the only one)."""
    gas = grad_accumulation(layout, workload) or 1
    seq = local_seq_len(layout, workload)  # context parallelism: each rank holds seq_len / cp tokens
    kw = dict(micro_batch=layout.micro_batch, seq_len=seq, tp=layout.tp, sp=layout.sequence_parallel,
              act_bytes=workload.activation_bytes, dropout=workload.dropout,
              attention=attention_kind(layout, workload))
    per_layer = layer_activation_bytes(model, checkpointing=layout.activation_checkpointing, **kw)
    layers = stage_layers(model, layout.pp)
    first = layers * per_layer * in_flight_micro_batches(layout, gas)
    # Under full recompute one layer is rebuilt whole during its backward; the head's buffers
    # are gone by then, so the two peaks do not add up.
    rebuilt = layer_activation_bytes(model, checkpointing="none", **kw) if layout.activation_checkpointing == "full" \
        else 0.0
    head = output_activation_bytes(model, layout.micro_batch, seq, layout.tp, workload.activation_bytes)
    if layout.pp == 1:
        return first + max(head, rebuilt)
    return max(first + rebuilt, layers * per_layer + max(head, rebuilt))


def comm_buffer_bytes(model: ModelSpec, layout: Layout, workload: Workload, state: StateBytes) -> float:
    """Staging buffers of gradient reduction (stages 1-3), gathered modules (stage 3) and
    pipeline send/receive buffers."""
    _, trainable = rank_parameter_counts(model, layout, workload)
    total = 0.0
    if layout.zero_stage >= 1:
        total += min(workload.reduce_bucket_elems, trainable) * state.gradient
    if layout.zero_stage == 3:
        total += zero3_gathered_elements(model, layout, workload) * state.parameter
    if layout.pp > 1:
        total += 2 * layout.micro_batch * local_seq_len(layout, workload) * model.d_model * workload.activation_bytes
    return total + context_parallel_buffer_bytes(model, layout, workload)


def zero3_gathered_elements(model: ModelSpec, layout: Layout, workload: Workload) -> float:
    """Most parameter elements stage 3 holds gathered at once: the module running, those
    prefetched (up to `stage3_prefetch_bucket_size` elements, at least one more module) and,
    under full recomputation, a layer's modules kept from the recomputed forward for their
    backward (`zero3_kept_for_backward`)."""
    modules = zero3_module_elements(model, layout, workload)
    if not modules:
        return 0.0
    largest = max(modules)
    live = largest + (max(largest, workload.zero3_prefetch_elems) if workload.zero3_prefetch_elems > 0 else 0.0)
    if layout.activation_checkpointing == "full":
        layer = [e for _, e in zero3_layer_modules(model, layout) if e > workload.zero3_persistence_threshold]
        live += sum(e for e, kept in zip(layer, zero3_kept_for_backward(layer, workload)) if kept)
    return live


def context_parallel_buffer_bytes(model: ModelSpec, layout: Layout, workload: Workload) -> float:
    """Buffers of cp's attention traffic on one rank. The ring holds the key/value block it
    computes on and the one arriving (2 x [b, s/C, 2 kv] in the activation format), and in
    backward the fp32 dK/dV block going out and the one coming in; Ulysses the send and receive
    buffers of its largest all-to-all (a [b, s/C, h] tensor each)."""
    if layout.cp <= 1:
        return 0.0
    tokens = layout.micro_batch * local_seq_len(layout, workload)
    h, kv = model.d_model / layout.tp, cp_kv_dim(model, layout.tp)
    u, ring = cp_groups(layout, workload)
    total = 0.0
    if ring > 1:
        total += 2 * tokens * 2 * kv * workload.activation_bytes + 2 * tokens * 2 * kv * 4
    if u > 1:
        total += 2 * tokens * h * workload.activation_bytes
    return total


def cp_kv_dim(model: ModelSpec, tp: int) -> float:
    """Key (or value) width on one tp rank: kv_dim / tp, or one head when tp exceeds the
    key/value heads (each tp rank then holds a copy of its group's head)."""
    return model.kv_dim / min(tp, model.kv_heads)


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per rank, by kind, and where model states live under offload."""

    states: ModelStates
    placement: Placement
    activations: float
    comm_buffers: float
    fragmentation: float
    capacity: float

    @property
    def device_total(self) -> float:
        return self.placement.device + self.activations + self.comm_buffers + self.fragmentation

    @property
    def fits(self) -> bool:
        return self.device_total <= self.capacity


def memory_estimate(model: ModelSpec, layout: Layout, workload: Workload, cluster: Cluster,
                    state: StateBytes | None = None) -> MemoryEstimate:
    """The whole per-rank memory picture of `layout` (textbook mixed-precision bytes by default)."""
    state = state or mixed_precision_bytes(workload.precision, workload.optimizer)
    params, trainable = rank_parameter_counts(model, layout, workload)
    if model.num_experts and not workload.lora_r:
        states = moe_state_bytes(model, layout, state)
    else:
        states = model_state_bytes(params, layout.zero_stage, layout.gradient_replicas, state, trainable)
    acts = activation_memory(model, layout, workload)
    buffers = comm_buffer_bytes(model, layout, workload, state)
    c = workload.compression
    if c is not None and c.hpz_partition_size > 1 and layout.zero_stage == 3:
        buffers += params * state.parameter / c.hpz_partition_size  # ZeRO++ hpZ: the secondary partition
    return MemoryEstimate(states, place_model_states(states, layout), acts, buffers,
                          FRAGMENTATION * (acts + buffers), cluster.gpu.memory_bytes)


# -- DeepSpeed's estimator questions ---------------------------------------------------------

@dataclass(frozen=True)
class StateEstimate:
    """Model-state memory for one (stage, offload) choice: per GPU on the device, per node on the host."""

    stage: int
    offload_optimizer: str
    offload_params: str
    device_per_gpu: float
    host_per_node: float


def zero_state_table(num_params: float, num_gpus: int, gpus_per_node: int, precision: str = "bf16",
                     optimizer: str = "adam", largest_layer_params: float | None = None,
                     trainable: float | None = None) -> list[StateEstimate]:
    """Every ZeRO stage and offload choice, in the manner of DeepSpeed's
    `estimate_zero2_model_states_mem_needs` / `estimate_zero3_...`: device bytes per GPU and host
    bytes per node. Stage 3 keeps the largest layer gathered while it runs. `trainable`: how
    many of the parameters train (default all; e.g. LoRA's adapters among the frozen model's)."""
    state = mixed_precision_bytes(precision, optimizer)
    choices = [(0, "none", "none"), (1, "none", "none"), (1, "cpu", "none"), (2, "none", "none"),
               (2, "cpu", "none"), (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu")]
    rows = []
    for stage, opt, par in choices:
        states = model_state_bytes(num_params, stage, num_gpus, state, trainable)
        placed = place_model_states(states, Layout(dp=num_gpus, zero_stage=stage, offload_optimizer=opt,
                                                   offload_params=par))
        device = placed.device
        if stage == 3 and largest_layer_params:
            device += largest_layer_params * state.parameter
        rows.append(StateEstimate(stage, opt, par, device, placed.host * gpus_per_node))
    return rows
