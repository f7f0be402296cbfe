"""What the planner is asked about: a parallel layout, and the training run it serves.

`Layout` is one point of the search space (dp x tp x pp ranks, ZeRO stage, offload,
activation checkpointing, sequence parallelism, micro-batch, pipeline schedule). `Workload` is
what does not change between layouts: sequence length, global batch, precision, optimizer.
`layout_problems` says why a layout is invalid for a model and a world size, in words a user
can act on; the search and `estimate` both use it, so neither proposes what the other rejects.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from trident.planner.compression import CommCompression
from trident.planner.kernels import check_kernels
from trident.planner.presets import ModelSpec

Checkpointing = Literal["none", "selective", "op", "full"]
"""none; selective (Megatron's: the attention scores); op (per-op selective, torch's selective
checkpointing with a policy: matmul and attention outputs saved, everything else recomputed);
full (each layer's input only)."""
Offload = Literal["none", "cpu", "nvme"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
Precision = Literal["bf16", "fp16", "fp32"]
CpMethod = Literal["ring", "ulysses", "hybrid"]
CP_METHODS = ("ring", "ulysses", "hybrid")

LORA_TARGETS = ("q", "k", "v", "qkv", "o", "mlp")
"""Linear layers of a block LoRA can adapt: separate or fused query/key/value projections, the
attention output, every matrix of the MLP."""
DEFAULT_LORA_TARGETS = ("qkv", "o", "mlp")
"""What `lora.target_modules`' default (qkv, proj, fc) adapts on trident's reference GPT."""


@dataclass(frozen=True)
class Layout:
    """One way to run a model on dp * cp * ep * tp * pp ranks (tp innermost, as trident's mesh orders them).

    `ep` > 1 splits an MoE model's experts over ep ranks that also see different data: dense
    weights then have dp x ep data-parallel replicas, expert weights dp. `cp` > 1 splits every
    sequence over cp ranks (context parallelism; mesh order pp, dp, cp, ep, tp): they hold the
    same weights, so gradients are reduced and ZeRO partitions over dp x cp (x ep), and
    `Workload.cp_method` says how their attention talks."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero_stage: int = 0
    micro_batch: int = 1
    activation_checkpointing: Checkpointing = "none"
    sequence_parallel: bool = False
    offload_optimizer: Offload = "none"
    offload_params: Offload = "none"
    schedule: Schedule = "1f1b"
    virtual_stages: int = 1
    ep: int = 1
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.ep * self.tp * self.pp

    @property
    def gradient_replicas(self) -> int:
        """Ranks a dense weight's gradient is averaged over and ZeRO partitions over: dp x cp x ep
        (cp ranks hold the same weights and see other parts of the same sequences)."""
        return self.data_parallel * self.cp

    @property
    def data_parallel(self) -> int:
        """Ranks that see different samples: dp x ep."""
        return self.dp * self.ep

    def describe(self) -> str:
        """`dp8 tp4 pp12 zero1 mb2 ckpt=full sp offload=cpu/none 1f1b`-style summary."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}", f"zero{self.zero_stage}", f"mb{self.micro_batch}"]
        if self.ep > 1:
            parts.insert(1, f"ep{self.ep}")
        if self.cp > 1:
            parts.insert(1, f"cp{self.cp}")
        if self.activation_checkpointing != "none":
            parts.append(f"ckpt={self.activation_checkpointing}")
        if self.sequence_parallel:
            parts.append("sp")
        if self.offload_optimizer != "none" or self.offload_params != "none":
            parts.append(f"offload={self.offload_optimizer}/{self.offload_params}")
        if self.pp > 1:
            parts.append(self.schedule + (f"x{self.virtual_stages}" if self.virtual_stages > 1 else ""))
        return " ".join(parts)


@dataclass(frozen=True)
class Workload:
    """The training run: tokens per sequence, sequences per optimizer step, number formats.

    `attention="flash"` keeps no seq x seq score matrix (a fused kernel); `"eager"` stores the
    softmax and its dropout as Korthikanti et al. 2022 count them. `lora_r` > 0 fine-tunes
    with LoRA adapters of that rank on `lora_targets` (see `LORA_TARGETS`): the model is
    frozen, only the adapters have gradients, optimizer states, gradient traffic and an
    optimizer step. Compute is still priced as full training: the frozen weights' skipped
    weight-gradient GEMMs (about a third of the FLOPs) are counted and the adapters' own small
    GEMMs are not, so a LoRA step time errs on the slow side.

    `cp_method` is how a layout with cp > 1 reaches the other ranks' tokens in attention
    (`context_parallel.method`): "ring" (key/value blocks around the cp ring), "ulysses"
    (all-to-alls to head shards) or "hybrid" (Ulysses inside groups of `cp_ulysses_size`, the
    ring across them). Under cp > 1 attention is priced as "flash" whatever `attention` says:
    ring and Ulysses attention keep no seq x seq scores.

    `compression` prices compressed communication (1-bit optimizers, 16-bit gradient
    reduction, ZeRO++; `trident.planner.compression`). ZeRO-3 gathers each module's
    parameters: `zero3_prefetch_elems` (DeepSpeed's `stage3_prefetch_bucket_size`) bounds how
    far ahead they are fetched, modules of at most `zero3_persistence_threshold` elements
    (`stage3_param_persistence_threshold`) stay whole and are never gathered, and a module
    gathered for a recomputed forward stays gathered for its backward when the parameters
    gathered in between are at most `zero3_max_reuse_distance` elements
    (`stage3_max_reuse_distance`).
    """

    seq_len: int
    global_batch: int
    precision: Precision = "bf16"
    optimizer: str = "adam"
    attention: Literal["flash", "eager"] = "flash"
    dropout: bool = False
    reduce_bucket_elems: int = 500_000_000
    lora_r: int = 0
    lora_targets: tuple[str, ...] = DEFAULT_LORA_TARGETS
    cp_method: CpMethod = "ring"
    cp_ulysses_size: int | None = None
    compression: CommCompression | None = None
    zero3_prefetch_elems: int = 50_000_000
    zero3_persistence_threshold: int = 100_000
    zero3_max_reuse_distance: int = 1_000_000_000
    kernels: str = "fused"
    """The kernels of the memory-bound work between GEMMs and of attention: "eager", "compile"
    or "fused" (`trident.planner.kernels`). The dataclass default is "fused", the pricing the
    published Megatron rows were fitted with; `trident plan` passes what trident runs (compile
    when the `compile` section is on, else eager)."""
    fp8: bool = False
    """The layers' dense GEMMs (qkv, attention out, MLP in and out, forward and backward) run in
    float8 (the `fp8` section) at the GPU's FP8 rate; attention's batched GEMMs and the head stay
    16-bit; the casts' element-wise passes are priced at the memory bandwidth
    (`trident.planner.compute.fp8_cast_bytes`)."""

    def __post_init__(self) -> None:
        check_kernels(self.kernels)
        if self.cp_method not in CP_METHODS:
            raise ValueError(f"cp_method must be one of {', '.join(CP_METHODS)}, got {self.cp_method!r}")
        if self.cp_method == "hybrid" and (not isinstance(self.cp_ulysses_size, int) or self.cp_ulysses_size < 1):
            raise ValueError(f"cp_method 'hybrid' needs cp_ulysses_size (ranks per Ulysses group, >= 1), got "
                             f"{self.cp_ulysses_size!r}")
        if isinstance(self.lora_r, bool) or not isinstance(self.lora_r, int) or self.lora_r < 0:
            raise ValueError(f"lora_r must be a non-negative integer (0 = full fine-tuning), got {self.lora_r!r}")
        if self.lora_r:
            unknown = [t for t in self.lora_targets if t not in LORA_TARGETS]
            if unknown or not self.lora_targets:
                raise ValueError(f"lora_targets {list(self.lora_targets)}: each must be one of "
                                 f"{', '.join(LORA_TARGETS)} (and at least one)")
            if "qkv" in self.lora_targets and {"q", "k", "v"} & set(self.lora_targets):
                raise ValueError(f"lora_targets {list(self.lora_targets)}: 'qkv' is the fused q, k and v "
                                 "projection; name either it or q/k/v, not both")

    @property
    def activation_bytes(self) -> int:
        return 4 if self.precision == "fp32" else 2

    def tokens_per_step(self) -> int:
        return self.seq_len * self.global_batch


def grad_accumulation(layout: Layout, workload: Workload) -> int | None:
    """Micro-batches per optimizer step on each data-parallel rank, or None if not whole."""
    per_step = layout.data_parallel * layout.micro_batch
    return workload.global_batch // per_step if workload.global_batch % per_step == 0 else None


def local_seq_len(layout: Layout, workload: Workload) -> float:
    """Tokens of each sequence one rank holds: seq_len / cp (context parallelism splits it)."""
    return workload.seq_len / layout.cp


def attention_kind(layout: Layout, workload: Workload) -> str:
    """How attention keeps its activations: the workload's choice, or "flash" under cp > 1 (ring
    and Ulysses attention keep the output and log-sum-exp, never the seq x seq scores)."""
    return "flash" if layout.cp > 1 else workload.attention


def cp_groups(layout: Layout, workload: Workload) -> tuple[int, int]:
    """(Ulysses group size, ring size) of the cp axis: (1, cp) for ring, (cp, 1) for Ulysses,
    (U, cp / U) for hybrid."""
    if layout.cp <= 1:
        return 1, 1
    if workload.cp_method == "ring":
        return 1, layout.cp
    if workload.cp_method == "ulysses":
        return layout.cp, 1
    u = workload.cp_ulysses_size or 1
    return u, max(1, layout.cp // u)


def stage_layers(model: ModelSpec, pp: int) -> int:
    """Transformer layers on the busiest pipeline stage (an uneven split rounds up)."""
    return -(-model.n_layer // pp)


def layout_problems(model: ModelSpec, layout: Layout, workload: Workload, world_size: int | None = None,
                    even_stages: bool = True) -> list[str]:
    """Why `layout` cannot run `model`; empty when it can (memory is judged separately).

    `even_stages=False` accepts pipeline stages of unequal depth (the planner then costs the
    busiest one), as hand-partitioned published runs use; the search always asks for even ones.
    """
    problems = []
    if world_size is not None and layout.world_size != world_size:
        cp = f" x cp {layout.cp}" if layout.cp > 1 else ""
        problems.append(f"dp {layout.dp}{cp} x tp {layout.tp} x pp {layout.pp} = {layout.world_size} ranks, "
                        f"not the {world_size} GPUs given; every GPU must hold one rank")
    problems += _cp_problems(model, layout, workload)
    if model.n_head % layout.tp:
        problems.append(f"tp {layout.tp} does not divide the {model.n_head} attention heads")
    elif model.kv_heads % layout.tp and layout.tp % model.kv_heads:
        problems.append(f"tp {layout.tp} and the {model.kv_heads} key/value heads do not divide one another")
    chunks = layout.pp * (layout.virtual_stages if layout.schedule == "interleaved_1f1b" else 1)
    if model.n_layer % chunks and (even_stages or chunks > model.n_layer):
        virtual = f" x {layout.virtual_stages} virtual stages" if chunks != layout.pp else ""
        problems.append(f"pp {layout.pp}{virtual} does not divide the {model.n_layer} layers")
    if layout.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {layout.zero_stage} does not exist; use 0, 1, 2 or 3")
    if layout.zero_stage > 1 and layout.pp > 1:
        problems.append(f"ZeRO stage {layout.zero_stage} with pipeline parallelism re-reduces gradients on every "
                        "micro-batch; use stage 0 or 1 with pp > 1 (as DeepSpeed requires)")
    if layout.offload_params != "none" and layout.zero_stage != 3:
        problems.append("parameter offload needs ZeRO stage 3 (only stage 3 partitions parameters)")
    if layout.offload_optimizer != "none" and layout.zero_stage == 0:
        problems.append("optimizer offload needs ZeRO stage >= 1 (stage 0 keeps the optimizer on the device)")
    if layout.sequence_parallel and layout.tp == 1:
        problems.append("sequence parallelism splits along the tensor-parallel group; it needs tp > 1")
    if layout.micro_batch < 1:
        problems.append(f"micro-batch {layout.micro_batch} must be >= 1")
    elif grad_accumulation(layout, workload) is None:
        problems.append(f"global batch {workload.global_batch} is not a multiple of dp {layout.dp} x micro-batch "
                        f"{layout.micro_batch}")
    if workload.seq_len > model.seq_len and model.position == "learned":
        problems.append(f"seq_len {workload.seq_len} exceeds the model's {model.seq_len} learned positions")
    return problems


def _cp_problems(model: ModelSpec, layout: Layout, workload: Workload) -> list[str]:
    """Context parallelism's rules: 2 x cp equal chunks per sequence (the zigzag layout), and
    Ulysses' head split (the heads on each tp rank divisible by the Ulysses group)."""
    if layout.cp == 1:
        return []
    if layout.cp < 1:
        return [f"cp {layout.cp} must be >= 1"]
    problems = []
    if workload.seq_len % (2 * layout.cp):
        problems.append(f"seq_len {workload.seq_len} is not divisible by 2 x cp = {2 * layout.cp}: context "
                        f"parallelism cuts every sequence into 2 x cp equal chunks (each rank holds two, "
                        f"for an even causal load); use a sequence length that is a multiple of {2 * layout.cp} "
                        f"or another cp")
    u, _ = cp_groups(layout, workload)
    if workload.cp_method == "hybrid" and layout.cp % u:
        problems.append(f"cp_ulysses_size {u} does not divide cp {layout.cp} (hybrid: Ulysses inside groups of "
                        f"cp_ulysses_size ranks, the ring across them)")
    elif u > 1:
        heads, kv_heads = model.n_head // layout.tp, max(1, model.kv_heads // layout.tp)
        if heads % u or kv_heads % u:
            problems.append(f"Ulysses over {u} cp ranks splits the attention heads, but each tp rank has {heads} "
                            f"query and {kv_heads} key/value heads, not divisible by {u}; use a cp (or Ulysses "
                            f"size) dividing them, or cp_method 'ring'")
    return problems
